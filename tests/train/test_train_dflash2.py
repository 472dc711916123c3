"""Training DFlash 2 drafters (`blockspec train --arch dflash2`): the selector's loss against
speculators' scorer, steps that lower the loss, per-position measurements in the log, a saved
checkpoint that speculators' modules and our loader read and that decodes losslessly, and `--init`
from a DFlash drafter that proposes exactly what that drafter proposes before any training."""

from __future__ import annotations

import json

import pytest
import torch
from speculators_oracle import load_speculators_dflash2, their_hidden_by_layer, their_layers, their_selector
from support import CharTokenizer, one_thread, predictable_target, prompts  # noqa: F401 (fixture)

from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.drafter import DFLASH2, load_drafter, new_drafter_for_target
from blockspec.errors import CheckpointError, ConfigError
from blockspec.train.data import read_examples
from blockspec.train.datagen import regenerate
from blockspec.train.loss import position_weights
from blockspec.train.selector_loss import selector_loss, training_candidates
from blockspec.train.trainer import Trainer
from blockspec.train.train_config import TrainConfig
from blockspec.train.sequence import derived_seed, prepare_sequence, sequence_forward

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(conv_group_size=8, selector_rank=8, selector_top_k=4)



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Responses of the predictable tiny target (the next token follows from the current one)."""
    root = tmp_path_factory.mktemp("dflash2")
    target = predictable_target()
    regenerate(target, CharTokenizer(), prompts(8), root / "data", max_new_tokens=24, batch_size=8, progress=False,
               backend="hf")
    return target, read_examples(root / "data"), root


def _config(out, **over) -> TrainConfig:
    base = dict(out=str(out), num_layers=1, block_size=4, mask_token_id=63, anchors=16, batch_seqs=4, max_steps=10,
                lr=1e-2, warmup=0.0, init="random", arch="dflash2", save_dtype="float32", **SMALL)
    return TrainConfig(**{**base, **over})


@pytest.fixture(scope="module")
def trained(data):
    """Ten steps of a DFlash 2 drafter from random weights, with a quick eval at the end."""
    target, examples, root = data
    tok = CharTokenizer()
    evalp = [tok(tok.apply_chat_template(list(p.messages)))["input_ids"] for p in prompts(2, start=100)]
    tr = Trainer(_config(root / "run"), target, examples, eval_prompts=evalp, log_fn=lambda *a: None)
    result = tr.train()
    return target, root / "run", result


# ---- the selector loss --------------------------------------------------------------------------

def test_training_candidates_put_a_missing_label_in_the_last_slot():
    top = torch.tensor([[5, 3, 9], [7, 1, 2], [4, 8, 6]])
    cands, slot, inside = training_candidates(top, torch.tensor([3, 0, 6]))
    assert cands.tolist() == [[5, 3, 9], [7, 1, 0], [4, 8, 6]]
    assert slot.tolist() == [1, 2, 2] and inside.tolist() == [True, False, True]


def test_selector_loss_matches_speculators_scores_and_the_full_logits(monkeypatch):
    """sum(w * ce) over the training candidates scored by speculators' CandidateSelector from the
    full unary logits; gradients reach the hidden states through both the unary logits and the
    selector; the measurements use the real top K."""
    oracle = load_speculators_dflash2(monkeypatch)
    target = predictable_target()
    drafter = new_drafter_for_target(target.model.config, mask_token_id=63, block_size=4, architecture=DFLASH2,
                                     dflash2=SMALL, seed=1)
    with torch.no_grad():  # transitions as large as the unary logits
        for p in drafter.candidate_selector.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.7)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 64, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(64, 32, generator=g) * 0.4)
    m = 40
    hidden = torch.randn(m, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 64, (m,), generator=g)
    prev = torch.randint(0, 64, (m,), generator=g)
    weights = torch.rand(m, generator=g)
    logits = head(hidden)  # [m, V]
    top = logits.detach().topk(4, dim=-1).indices
    res = selector_loss(drafter.candidate_selector, hidden, hidden, head.weight.detach(), None, top, labels, prev,
                        weights)
    cands, slot, inside = training_candidates(top, labels)
    assert 0 < int(inside.sum()) < m  # both cases occur
    theirs = their_selector(oracle, drafter).score_candidates(logits, hidden, prev, cands)  # [m, K]
    want = (torch.nn.functional.cross_entropy(theirs, slot, reduction="none") * weights).sum()
    torch.testing.assert_close(res.total, want, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(res.total, hidden)
    (want_grad,) = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)
    best = cands.gather(1, theirs.argmax(-1, keepdim=True))[:, 0]
    assert torch.equal(res.correct, inside & (best == labels)) and torch.equal(res.in_top_k, inside)


def _fixed_batch_losses(tr: Trainer, target, examples) -> tuple[float, float]:
    """(unary, selector) loss of the trainer's drafter on the examples, each with the anchors of
    step 0, weight-normalised: a fixed batch to compare before and after training steps."""
    w = position_weights(4)
    unary, sel, wsum = 0.0, 0.0, 0.0
    with torch.no_grad():
        for i, ex in enumerate(examples):
            s = prepare_sequence(ex, 4, 16, 512, w, seed=derived_seed(0, "anchors", 0, i))
            parts: dict = {}
            sequence_forward(tr.drafter, target, s, tr._features(ex, s.ids.numel()), parts=parts)
            unary, sel, wsum = unary + parts["unary"], sel + parts["selector"], wsum + s.weight_sum
    return unary / wsum, sel / wsum


def test_dflash2_steps_lower_both_losses_on_a_fixed_batch(data, tmp_path):
    target, examples, _ = data
    tr = Trainer(_config(tmp_path / "o", max_steps=3), target, examples, log_fn=lambda *a: None)
    before = _fixed_batch_losses(tr, target, examples)
    records = [tr.train_step(step) for step in range(3)]
    after = _fixed_batch_losses(tr, target, examples)
    assert after[0] < 0.98 * before[0] and after[1] < 0.98 * before[1], (before, after)
    assert records[0]["loss"] == pytest.approx(records[0]["unary_loss"] + records[0]["selector_loss"], rel=1e-6)
    zero = Trainer(_config(tmp_path / "z", selector_loss_alpha=0.0), target, examples, log_fn=lambda *a: None)
    rec = zero.train_step(0)
    assert rec["loss"] == pytest.approx(rec["unary_loss"], rel=1e-6) and rec["selector_loss"] > 0


# ---- a training run: its log, its checkpoint ----------------------------------------------------

def test_log_has_the_per_position_measurements(trained):
    _, run, result = trained
    logs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    train = [r for r in logs if r["type"] == "train"]
    assert len(train) == 10
    for r in train:
        assert len(r["acc"]) == len(r["topk_recall"]) == len(r["selector_acc"]) == 3 and r["selector_top_k"] == 4
        for unary, recall, sel in zip(r["acc"], r["topk_recall"], r["selector_acc"]):
            assert 0 <= unary <= recall <= 1 and 0 <= sel <= recall  # top-1 and the pick are within the top K
        assert r["tau_proxy_selector"] >= 1.0
    assert train[-1]["loss"] < train[0]["loss"] and train[-1]["selector_loss"] < train[0]["selector_loss"]
    # the next token follows from the current one: given the true predecessor, the selector beats
    # the unary argmax beyond block position 1
    assert sum(train[-1]["selector_acc"][1:]) > sum(train[-1]["acc"][1:]), train[-1]
    evals = [r for r in logs if r["type"] == "eval"]
    assert evals and evals[-1]["selector_loss_full"] > 0 and evals[-1]["tau"] > 1.0
    png = (run / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(png[16:20], "big")
    assert width > 2000  # four panels: the by-position one added for DFlash 2


def test_saved_checkpoint_loads_in_speculators_and_ours_and_decodes_losslessly(trained, monkeypatch):
    oracle = load_speculators_dflash2(monkeypatch)
    target, run, _ = trained
    raw = json.loads((run / "drafter" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in SMALL} == SMALL and raw["dflash_config"]["conv_kernel_size"] == 2
    drafter = load_drafter(run / "drafter", dtype=torch.float32)
    assert drafter.cfg.dflash2
    ckpt = load_drafter(run / "checkpoint", dtype=torch.float32)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), ckpt.state_dict().items()):
        assert torch.equal(a, b), name
    # trained: the convolutions are no longer the identity, the selector no longer small
    assert drafter.layers[0].attention_conv.kernel_projection.weight.abs().max() > 1e-3
    layers = their_layers(oracle, drafter)  # strict loads: every weight name and shape as they read them
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(2, 6, len(drafter.target_layer_ids) * 32, generator=g)
    embeds = torch.randn(2, 4, 32, generator=g)
    pos = torch.arange(10)[None].expand(2, -1)
    with torch.no_grad():
        theirs = their_hidden_by_layer(oracle, drafter, feats, embeds, pos, None, layers)[-1]
        ours = drafter(feats, pos[:, :6], embeds, pos[:, 6:])
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        head = target.head()
        prev = torch.randint(0, 64, (2, 3), generator=g)
        cands = drafter.candidates(ours[:, 1:], head)
        ids, scores = their_selector(oracle, drafter).select(head(ours[:, 1:]).float(), ours[:, 1:], prev)
        assert torch.equal(cands.ids, ids)
        torch.testing.assert_close(drafter.selector_scores(ours[:, 1:], prev, cands), scores, rtol=1e-5, atol=1e-5)
    prompt = [[5, 9, 12, 7], [3, 30, 8]]
    params = SamplingParams(max_new_tokens=16)
    plain = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompt, params)
    spec = SpecDecoder(target, drafter, SpecConfig(block_size=4)).generate(prompt, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(sum(r.stats.acceptance_lengths) for r in spec) > sum(len(r.stats.acceptance_lengths) for r in spec)


def test_resume_continues_a_dflash2_run_and_refuses_another_arch(trained, data):
    target, run, _ = trained
    _, examples, _ = data
    tr = Trainer(_config(run, max_steps=11), target, examples, resume=True, log_fn=lambda *a: None)
    assert tr.step == 10 and tr.drafter.cfg.dflash2
    with pytest.raises(CheckpointError, match="holds a DFlash2DraftModel.*--arch"):
        Trainer(_config(run, arch="dflash", conv_group_size=None, selector_rank=None, selector_top_k=None),
                target, examples, resume=True, log_fn=lambda *a: None)


# ---- --init ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dflash_dir(data):
    """A DFlash drafter (a few steps trained, with a draft vocabulary) as a published directory."""
    target, examples, root = data
    cfg = _config(root / "plain", arch="dflash", conv_group_size=None, selector_rank=None, selector_top_k=None,
                  max_steps=4, loss_vocab="data")
    Trainer(cfg, target, examples, log_fn=lambda *a: None).train()
    return root / "plain" / "drafter"


def test_init_from_a_dflash_drafter_proposes_what_it_proposes(data, dflash_dir, tmp_path):
    """--init DIR --arch dflash2: backbone and draft vocabulary kept, identity convolutions, a
    selector whose transitions are all zero; so before training every hidden state, every greedy
    proposal and every speculative step's acceptance equals the DFlash drafter's. Training then
    moves the new modules."""
    target, examples, _ = data
    plain = load_drafter(dflash_dir, dtype=torch.float32)
    assert not plain.cfg.dflash2 and plain.draft_vocab is not None
    logs: list[str] = []
    tr = Trainer(_config(tmp_path / "two", init=str(dflash_dir), max_steps=2, loss_vocab="data"), target, examples,
                 log_fn=logs.append)
    two = tr.drafter
    assert two.cfg.dflash2 and (two.cfg.conv_group_size, two.cfg.selector_rank, two.cfg.selector_top_k) == (8, 8, 4)
    assert any("converted to DFlash 2" in line for line in logs)
    for name, w in plain.state_dict().items():
        assert torch.equal(two.state_dict()[name], w), name
    assert torch.equal(two.draft_vocab, plain.draft_vocab)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 7, len(plain.target_layer_ids) * 32, generator=g)
    embeds = torch.randn(3, 4, 32, generator=g)
    pos = torch.arange(11)[None].expand(3, -1)
    head = target.head()
    with torch.no_grad():
        h_plain = plain.eval()(feats, pos[:, :7], embeds, pos[:, 7:])
        h_two = two.eval()(feats, pos[:, :7], embeds, pos[:, 7:])
        assert torch.equal(h_two, h_plain)
        anchor = torch.randint(0, 64, (3,), generator=g)
        assert torch.equal(two.greedy_tokens(h_two[:, 1:], head, anchor), plain.greedy_tokens(h_plain[:, 1:], head))
    prompt = [[5, 9, 12, 7], [3, 30, 8], [40, 41]]
    params = SamplingParams(max_new_tokens=20)
    a = SpecDecoder(target, plain, SpecConfig(block_size=4)).generate(prompt, params)
    b = SpecDecoder(target, two, SpecConfig(block_size=4)).generate(prompt, params)
    assert [r.stats.acceptance_lengths for r in b] == [r.stats.acceptance_lengths for r in a]
    assert [r.token_ids for r in b] == [r.token_ids for r in a]
    two.train()
    tr.train()
    tuned = load_drafter(tmp_path / "two" / "drafter", dtype=torch.float32)
    assert tuned.cfg.dflash2 and torch.equal(tuned.draft_vocab, plain.draft_vocab)
    assert tuned.candidate_selector.hidden_projection.weight.abs().sum() > 0  # the selector learns from step 1


def test_init_target_and_random_build_dflash2_drafters(data, tmp_path):
    """--init target (the default) keeps copying target layers; the DFlash 2 modules start as
    identity convolutions beside them."""
    target, examples, _ = data
    tr = Trainer(_config(tmp_path / "t", init="target", max_steps=1), target, examples, log_fn=lambda *a: None)
    d = tr.drafter
    assert d.cfg.dflash2
    src = target.model.model.layers[d.cfg.num_target_layers - 1]
    assert torch.equal(d.layers[0].mlp.up_proj.weight, src.mlp.up_proj.weight)
    conv = d.layers[0].mlp_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
    assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
    assert torch.isfinite(torch.tensor(tr.train_step(0)["loss"]))


def test_arch_settings_are_checked(data, dflash_dir, trained, tmp_path):
    target, examples, _ = data
    _, run, _ = trained
    with pytest.raises(ConfigError, match="--selector-rank only apply to --arch dflash2"):
        TrainConfig(out=str(tmp_path / "a"), arch="dflash", selector_rank=8)
    with pytest.raises(ConfigError, match="add --arch dflash2"):
        TrainConfig(out=str(tmp_path / "a"), selector_top_k=8)
    with pytest.raises(ConfigError, match="--arch"):
        TrainConfig(out=str(tmp_path / "a"), arch="dflash3")
    # a DFlash 2 --init keeps its architecture by default, and its keys
    assert TrainConfig(out=str(tmp_path / "a"), init=str(run / "drafter")).architecture() == DFLASH2
    with pytest.raises(ConfigError, match="cannot be made from it"):
        Trainer(TrainConfig(out=str(tmp_path / "b"), block_size=4, mask_token_id=63, arch="dflash",
                            init=str(run / "drafter")), target, examples, log_fn=lambda *a: None)
    with pytest.raises(ConfigError, match="--selector-rank 8, the run asks for 16"):
        Trainer(TrainConfig(out=str(tmp_path / "c"), block_size=4, mask_token_id=63, arch="dflash2",
                            selector_rank=16, init=str(run / "drafter")), target, examples, log_fn=lambda *a: None)
    with pytest.raises(ConfigError, match="selector_top_k 100 exceeds vocab_size 64"):
        Trainer(_config(tmp_path / "d", init=str(dflash_dir), selector_top_k=100), target, examples,
                log_fn=lambda *a: None)


# ---- --train selector: the selector alone on a frozen backbone -----------------------------------

def test_train_selector_moves_the_selector_alone(data, dflash_dir, tmp_path):
    """--train selector on a DFlash drafter converted to DFlash 2: after a few steps every other
    tensor (backbone, identity convolutions) and the draft vocabulary are bit-identical, the
    backbone got no gradient (its forward ran without autograd), the selector's weights moved and
    its loss fell on a fixed batch; the unary loss is unchanged. The codebooks hold one row per
    draft-vocabulary token, in memory and on disk."""
    target, examples, _ = data
    tr = Trainer(_config(tmp_path / "sel", init=str(dflash_dir), train="selector", max_steps=6, lr=5e-2), target,
                 examples, log_fn=lambda *a: None)
    d = tr.drafter
    vocab = d.draft_vocab.clone()
    assert d.candidate_selector.predecessor_codebook.shape == (vocab.numel(), SMALL["selector_rank"])
    before = {k: v.clone() for k, v in d.state_dict().items()}
    first = _fixed_batch_losses(tr, target, examples)
    for step in range(6):
        tr.train_step(step)
    after = _fixed_batch_losses(tr, target, examples)
    backbone = [n for n, _ in d.named_parameters() if not n.startswith("candidate_selector.")]
    assert backbone and all(p.grad is None for n, p in d.named_parameters() if n in backbone)
    for name, t in d.state_dict().items():
        if name.startswith("candidate_selector."):
            assert not torch.equal(t, before[name]), name
        else:
            assert torch.equal(t, before[name]), name
    assert torch.equal(d.draft_vocab, vocab)
    assert after[0] == first[0] and after[1] < 0.95 * first[1], (first, after)
    saved = load_drafter(tr.save_final(), dtype=torch.float32)
    assert torch.equal(saved.draft_vocab, vocab)
    assert saved.candidate_selector.successor_codebook.shape == (vocab.numel(), SMALL["selector_rank"])
    plain = load_drafter(dflash_dir, dtype=torch.float32)
    for name, t in plain.state_dict().items():
        assert torch.equal(saved.state_dict()[name], t), name


def test_train_selector_settings_are_checked(data, dflash_dir, tmp_path):
    with pytest.raises(ConfigError, match="--train selector trains a DFlash 2.*--arch dflash2"):
        _config(tmp_path / "a", init=str(dflash_dir), arch="dflash", conv_group_size=None, selector_rank=None,
                selector_top_k=None, train="selector")
    with pytest.raises(ConfigError, match="give --init DIR"):
        _config(tmp_path / "b", train="selector")
    with pytest.raises(ConfigError, match="--selector-loss-alpha must be > 0"):
        _config(tmp_path / "c", init=str(dflash_dir), train="selector", selector_loss_alpha=0.0)
    with pytest.raises(ConfigError, match="--train must be 'all' or 'selector'"):
        _config(tmp_path / "d", train="backbone")
