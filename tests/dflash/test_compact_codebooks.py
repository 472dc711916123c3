"""A DFlash 2 selector's codebooks over the draft vocabulary only ([Vd, r], our files) against the
published [V, r] layout with zero rows for the other tokens: the same scores, walks, tree children
and decoding; saved compact and loaded back; `blockspec export` writes the published layout, which
the reference package reads and our loader reads into the same scores."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.drafter import DFLASH2, DFlashDrafter, load_drafter, new_drafter_for_target, save_drafter
from blockspec.dflash.proposers.dflash2 import SelectorDistributions
from blockspec.dflash.selector import pick_best
from blockspec.engine.decoder import SpecDecoder
from blockspec.errors import CheckpointError
from blockspec.export import export_drafter
from blockspec.targets.hf import HFTarget

SIZES = dict(conv_group_size=16, selector_rank=8, selector_top_k=4)
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return HFTarget(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval(),
                    eos_token_ids=())


@pytest.fixture(scope="module")
def drafters(target) -> tuple[DFlashDrafter, DFlashDrafter, torch.Tensor]:
    """(compact, published) DFlash 2 drafters with the same draft vocabulary (every other token id
    below 300: anchors outside it are common) and the same codebook rows, large enough that the
    selector's walk leaves the unary argmax."""
    drafter = new_drafter_for_target(target.model.config, mask_token_id=3, num_layers=1, block_size=4, seed=1,
                                     architecture=DFLASH2, dflash2=SIZES)
    ids = torch.arange(0, 300, 2)
    drafter.set_draft_vocab(ids, 320)
    sel = drafter.candidate_selector
    with torch.no_grad():
        for name in CODEBOOKS:
            book = getattr(sel, name)
            book.mul_(150.0)
            keep = torch.zeros(book.shape[0], dtype=torch.bool)
            keep[ids] = True
            book[~keep] = 0.0  # what the published layout holds where the compact one has no row
    published = copy.deepcopy(drafter)
    drafter.candidate_selector.use_rows(ids)
    return drafter, published, ids


def test_compact_rows_are_the_draft_vocabulary_and_expand_to_the_published_layout(drafters):
    compact, published, ids = drafters
    sel = compact.candidate_selector
    assert sel.predecessor_codebook.shape == (ids.numel(), SIZES["selector_rank"])
    assert torch.equal(sel.token_ids, ids)
    for name, full in sel.published().items():
        assert torch.equal(full, getattr(published.candidate_selector, name)), name


def test_both_layouts_score_walk_and_branch_alike(drafters, target):
    compact, published, _ = drafters
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 3, 64, generator=g)  # [b, n, H]
    head = target.head()
    with torch.no_grad():
        cands = compact.candidates(hidden, head)
        assert torch.equal(published.candidates(hidden, head).ids, cands.ids)
        prev = torch.tensor([[1, 2, 5], [7, 8, 299], [301, 0, 3]])  # odd ids and >= 300: no compact row
        a = compact.selector_scores(hidden, prev, cands)
        b = published.selector_scores(hidden, prev, cands)
        assert torch.equal(a, b)
        outside = compact.candidate_selector.transitions(hidden[0, 0], torch.tensor(1), cands.ids[0, 0])
        assert not outside.any()  # a predecessor without a row scores its candidates by their unary logits
        anchor = torch.tensor([1, 4, 301])
        walk_c, _ = compact.walk(hidden, cands, anchor, pick_best)
        walk_p, _ = published.walk(hidden, cands, anchor, pick_best)
        assert torch.equal(walk_c, walk_p)
        assert not torch.equal(walk_c, cands.ids[..., 0])  # the selector changes the proposals here
        for i in range(3):
            kids = [SelectorDistributions(d.candidate_selector, hidden[i], cands.ids[i], cands.logits[i]).children(2, 6)
                    for d in (compact, published)]
            assert kids[0] == kids[1]


@pytest.mark.parametrize("tree_nodes", [0, 7])
def test_both_layouts_decode_alike_and_losslessly(drafters, target, tree_nodes):
    compact, published, _ = drafters
    prompts = [[5, 9, 12, 7], [30, 8], [100, 101, 102, 103, 104]]
    params = SamplingParams(max_new_tokens=16)
    plain = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)
    runs = [SpecDecoder(target, d, SpecConfig(block_size=4, tree_nodes=tree_nodes)).generate(prompts, params)
            for d in (compact, published)]
    for out in runs:
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert [r.stats.acceptance_lengths for r in runs[0]] == [r.stats.acceptance_lengths for r in runs[1]]


def test_saved_compact_and_loaded_in_either_layout(drafters, tmp_path):
    compact, published, ids = drafters
    path = save_drafter(compact, tmp_path / "c")
    state = load_file(str(path / "model.safetensors"))
    assert state["candidate_selector.successor_codebook"].shape == (ids.numel(), SIZES["selector_rank"])
    back = load_drafter(path, dtype=torch.float32)
    assert torch.equal(back.candidate_selector.token_ids, ids) and torch.equal(back.draft_vocab, ids)
    for name, t in compact.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    # the whole vocabulary proposed: the codebooks still need their rows' token ids
    whole = load_drafter(path, dtype=torch.float32, draft_vocab=False)
    assert whole.draft_vocab is None and torch.equal(whole.candidate_selector.token_ids, ids)
    # a published-layout drafter saves [V, r], and loads as it was
    full = load_drafter(save_drafter(published, tmp_path / "p"), dtype=torch.float32)
    assert full.candidate_selector.token_ids is None and full.candidate_selector.predecessor_codebook.shape[0] == 320
    # a compact file without its draft vocabulary is refused with the reason
    (path / "draft_vocab.safetensors").unlink()
    with pytest.raises(CheckpointError, match="predecessor_codebook.*one row per token id of draft_vocab.safetensors"):
        load_drafter(path)


def test_export_writes_the_published_layout_the_reference_reads(drafters, target, tiny_model_dir, tmp_path):
    from dflash.model import DFlash2DraftModel

    compact, published, ids = drafters
    src = save_drafter(compact, tmp_path / "c")
    result = export_drafter(src, "hf", tiny_model_dir, tmp_path / "x")
    state = load_file(str(result.path / "model.safetensors"))
    for name in CODEBOOKS:
        assert torch.equal(state[f"candidate_selector.{name}"], getattr(published.candidate_selector, name)), name
    assert not (result.path / "draft_vocab.safetensors").exists()
    ref, info = DFlash2DraftModel.from_pretrained(str(result.path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(ref.candidate_selector.successor_codebook.weight.float(),
                               state["candidate_selector.successor_codebook"], rtol=0, atol=0)
    # round trip: the export loads back as the compact drafter proposing from the whole vocabulary
    back = load_drafter(result.path, dtype=torch.float32)
    whole = load_drafter(src, dtype=torch.float32, draft_vocab=False)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 64, generator=g)
    with torch.no_grad():
        cands = back.candidates(hidden, target.head())
        prev = torch.randint(0, 320, (2, 3), generator=g)
        assert torch.equal(back.selector_scores(hidden, prev, cands), whole.selector_scores(hidden, prev, cands))
        anchor = torch.tensor([1, 2])
        assert torch.equal(back.walk(hidden, cands, anchor, pick_best)[0], whole.walk(hidden, cands, anchor, pick_best)[0])
