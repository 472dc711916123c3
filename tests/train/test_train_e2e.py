"""End to end on a tiny target: datagen -> train -> speculative decoding beats tau 1; one step
lowers the loss; the output loads in the reference package `dflash==0.1.0` and matches."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.dflash.drafter import DFlashDrafter, load_drafter
from blockspec.train.data import Example, read_examples
from blockspec.train.datagen import regenerate
from blockspec.train.evaluate import quick_tau
from blockspec.errors import ConfigError
from blockspec.train.trainer import Trainer
from blockspec.train.train_config import TrainConfig
from blockspec.train.sequence import derived_seed, prepare_sequence, sequence_forward
from blockspec.train.loss import position_weights

from support import CharTokenizer, one_thread, predictable_target, prompts  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")



def test_one_step_lowers_loss_on_fixed_batch(tmp_path):
    target = predictable_target()
    regenerate(target, CharTokenizer(), prompts(4), tmp_path / "d", max_new_tokens=24, progress=False, backend="hf")
    examples = read_examples(tmp_path / "d")
    cfg = TrainConfig(out=str(tmp_path / "o"), num_layers=1, block_size=4, mask_token_id=63, anchors=16,
                      batch_seqs=4, max_steps=1, lr=1e-2, warmup=0.0, init="random")
    tr = Trainer(cfg, target, examples, log_fn=lambda *a: None)
    w = position_weights(4)

    def batch_loss() -> float:
        tot, wsum = 0.0, 0.0
        with torch.no_grad():
            for i, ex in enumerate(examples):
                s = prepare_sequence(ex, 4, 16, 512, w, seed=derived_seed(cfg.seed, "anchors", 0, i))
                total, _ = sequence_forward(tr.drafter, target, s, tr._features(ex, s.ids.numel()))
                tot, wsum = tot + float(total), wsum + s.weight_sum
        return tot / wsum

    before = batch_loss()
    rec = tr.train_step(0)
    assert rec["loss"] == pytest.approx(before, rel=1e-4)  # the logged loss is this batch's loss
    after = batch_loss()
    assert after < before - 0.01 * before, (before, after)
    after = batch_loss()
    assert after < before - 1e-3


def test_datagen_resumes_and_skips_done(tmp_path):
    target = predictable_target()
    tok = CharTokenizer()
    s1 = regenerate(target, tok, prompts(3), tmp_path, max_new_tokens=8, progress=False, backend="hf")
    assert s1["written"] == 3
    with (tmp_path / "shard-00000.jsonl").open("a") as f:
        f.write('{"id": "broken", "input_ids": [1, 2')  # an interrupted write
    s2 = regenerate(target, tok, prompts(5), tmp_path, max_new_tokens=8, progress=False, backend="hf")
    assert s2["already_done"] == 3 and s2["written"] == 2
    ex = read_examples(tmp_path)
    assert [e.id for e in ex] == ["p0", "p1", "p2", "p3", "p4"] or sorted(e.id for e in ex) == [f"p{i}" for i in range(5)]
    for e in ex:
        first = e.loss_mask.index(1)
        assert all(m == 0 for m in e.loss_mask[:first]) and all(m == 1 for m in e.loss_mask[first:])
        assert len(e.input_ids) - first == 8  # no EOS in this target: max_new_tokens each


def test_spec_backend_datagen_matches_plain_generation(tmp_path):
    target = predictable_target()
    tok = CharTokenizer()
    regenerate(target, tok, prompts(3), tmp_path / "a", max_new_tokens=10, progress=False, backend="spec")
    regenerate(target, tok, prompts(3), tmp_path / "b", max_new_tokens=10, progress=False, backend="hf")
    a = {e.id: e.input_ids for e in read_examples(tmp_path / "a")}
    b = {e.id: e.input_ids for e in read_examples(tmp_path / "b")}
    assert a == b


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """datagen -> train on the predictable tiny target; returns (target, run dir, eval prompts)."""
    root = tmp_path_factory.mktemp("e2e")
    target = predictable_target()
    tok = CharTokenizer()
    regenerate(target, tok, prompts(16), root / "data", max_new_tokens=40, batch_size=16, progress=False)
    examples = read_examples(root / "data")
    cfg = TrainConfig(out=str(root / "run"), num_layers=1, block_size=4, mask_token_id=63, anchors=32,
                      batch_seqs=4, epochs=6, lr=2e-2, warmup=0.05, init="random", save_dtype="float32")
    evalp = [tok.__call__(tok.apply_chat_template(list(p.messages)))["input_ids"] for p in prompts(6, start=100)]
    Trainer(cfg, target, examples, eval_prompts=evalp, log_fn=lambda *a: None).train()
    return target, root / "run", evalp


def test_end_to_end_beats_tau_one(trained):
    target, run, evalp = trained
    drafter = load_drafter(run / "drafter", dtype=torch.float32)
    res = quick_tau(target, drafter, evalp, max_new_tokens=32)
    assert res["tau"] > 1.5, res
    logs = [json.loads(l) for l in (run / "log.jsonl").read_text().splitlines()]
    train = [r for r in logs if r["type"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    assert len(train[0]["acc"]) == 3
    assert (run / "checkpoint" / "trainer_state.pt").exists()
    png = (run / "curves.png").read_bytes()  # the run's curves, drawn from its log
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_resume_continues_from_checkpoint(trained, tmp_path):
    target, run, _ = trained
    examples = read_examples(run.parent / "data")
    cfg = TrainConfig(out=str(run), num_layers=1, block_size=4, mask_token_id=63, anchors=32,
                      batch_seqs=4, epochs=6, max_steps=26, lr=2e-2, init="random", save_dtype="float32")
    tr = Trainer(cfg, target, examples, resume=True, log_fn=lambda *a: None)
    assert tr.step == 24  # 16 sequences * 6 epochs / 4 per step
    ref = load_drafter(run / "checkpoint", dtype=torch.float32)
    for (n, a), (_, b) in zip(tr.drafter.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n
    tr.train()
    assert tr.step == 26


def _trainer_from_drafter(trained, out, *, num_layers: int, max_steps: int) -> tuple[DFlashDrafter, Trainer]:
    """The trained run's drafter, and a Trainer started from it (`--init`) writing to `out`."""
    target, run, _ = trained
    start = load_drafter(run / "drafter", dtype=torch.float32)
    cfg = TrainConfig(out=str(out), num_layers=num_layers, block_size=4, mask_token_id=63, anchors=8,
                      batch_seqs=2, max_steps=max_steps, lr=1e-3, warmup=0.0, init=str(run / "drafter"),
                      save_dtype="float32")
    return start, Trainer(cfg, target, read_examples(run.parent / "data"), log_fn=lambda *a: None)


def test_init_from_a_drafter_directory_continues_its_weights(trained, tmp_path):
    """--init DIR (fine-tuning a published drafter): training starts from its weights, and a run
    asking for another shape is refused with the flag to drop."""
    target, run, _ = trained
    examples = read_examples(run.parent / "data")
    start, tr = _trainer_from_drafter(trained, tmp_path / "ft", num_layers=1, max_steps=1)
    for (n, a), (_, b) in zip(tr.drafter.state_dict().items(), start.state_dict().items()):
        assert torch.equal(a, b), n
    tr.train()
    tuned = load_drafter(tmp_path / "ft" / "drafter", dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), start.state_dict().values()))
    with pytest.raises(ConfigError, match="--block-size"):
        Trainer(TrainConfig(out=str(tmp_path / "bad"), num_layers=1, block_size=8, mask_token_id=63,
                            init=str(run / "drafter")), target, examples, log_fn=lambda *a: None)
    with pytest.raises(ConfigError, match="--init"):
        TrainConfig(out=str(tmp_path / "bad"), init=str(tmp_path / "nowhere"))


def test_init_with_more_layers_grows_the_drafter(trained, tmp_path):
    """--init DIR --num-layers N (N above the drafter's): training continues from the same outputs
    with layers added on top, and the deeper drafter it saves loads in the reference package."""
    start, tr = _trainer_from_drafter(trained, tmp_path / "deep", num_layers=2, max_steps=3)
    torch.manual_seed(2)
    L = len(start.target_layer_ids)
    ctx, block, pos = torch.randn(1, 7, L * 32), torch.randn(1, 4, 32), torch.arange(11)[None]
    with torch.no_grad():
        assert torch.allclose(tr.drafter(ctx, pos[:, :7], block, pos[:, 7:]),
                              start(ctx, pos[:, :7], block, pos[:, 7:]), atol=1e-6)
    tr.train()
    deep = load_drafter(tmp_path / "deep" / "drafter", dtype=torch.float32)
    assert deep.cfg.num_hidden_layers == 2
    assert deep.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # the added layer trained
    assert_matches_reference(tmp_path / "deep" / "drafter")


def assert_matches_reference(path) -> None:
    """The drafter saved at `path` gives the reference package's outputs on random inputs."""
    dflash_model = pytest.importorskip("dflash.model")
    ours = load_drafter(path, dtype=torch.float32)
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32).eval()
    torch.manual_seed(1)
    L = len(ours.target_layer_ids)
    ctx = torch.randn(1, 7, L * 32)
    block = torch.randn(1, 4, 32)
    pos = torch.arange(11)[None]
    with torch.no_grad():
        mine = ours(ctx, pos[:, :7], block, pos[:, 7:])
        theirs = ref(position_ids=pos, noise_embedding=block, target_hidden=ctx)
    assert torch.allclose(mine, theirs, atol=1e-5), (mine - theirs).abs().max()


def test_output_loads_in_reference_package(trained):
    _, run, _ = trained
    assert_matches_reference(run / "drafter")


def test_data_vocabulary_training_ships_a_draft_vocabulary(tmp_path):
    """--loss-vocab data: the saved drafter proposes only from the tokens it was trained to rank,
    and decoding with it stays identical to plain decoding."""
    from blockspec.config import SamplingParams, SpecConfig
    from blockspec.engine.decoder import SpecDecoder

    target = predictable_target()
    regenerate(target, CharTokenizer(), prompts(4), tmp_path / "d", max_new_tokens=16, progress=False)
    examples = read_examples(tmp_path / "d")
    labels = sorted({t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m})
    cfg = TrainConfig(out=str(tmp_path / "o"), num_layers=1, block_size=4, mask_token_id=63, anchors=8,
                      batch_seqs=2, max_steps=2, lr=1e-2, warmup=0.0, init="random", loss_vocab="data",
                      save_dtype="float32")
    Trainer(cfg, target, examples, log_fn=lambda *a: None).train()
    drafter = load_drafter(tmp_path / "o" / "drafter")
    assert drafter.draft_vocab.tolist() == labels and len(labels) < 64
    prompt = [[5, 9, 12, 7]]
    plain = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompt, SamplingParams(max_new_tokens=12))
    spec = SpecDecoder(target, drafter, SpecConfig(block_size=4)).generate(prompt, SamplingParams(max_new_tokens=12))
    assert spec[0].token_ids == plain[0].token_ids
    # continuing on other data keeps every token the first stage could propose; full-vocabulary
    # training from it proposes from the whole vocabulary again
    stage1 = tmp_path / "o" / "drafter"

    def first_labels(e: Example, n: int = 5) -> Example:  # fewer labels: fewer distinct tokens
        first = e.loss_mask.index(1)
        return Example(e.id, e.input_ids[: first + n], e.loss_mask[: first + n])

    later = [first_labels(e) for e in examples]
    later_labels = {t for e in later for t, m in zip(e.input_ids, e.loss_mask) if m}
    cfg2 = TrainConfig(out=str(tmp_path / "o2"), num_layers=1, block_size=4, mask_token_id=63, anchors=8,
                       batch_seqs=2, max_steps=1, lr=1e-2, warmup=0.0, init=str(stage1), loss_vocab="data",
                       save_dtype="float32")
    tr = Trainer(cfg2, target, later, log_fn=lambda *a: None)
    assert tr.candidates.tolist() == sorted(set(labels) | later_labels) and len(later_labels) < len(labels)
    tr.train()
    assert load_drafter(tmp_path / "o2" / "drafter").draft_vocab.tolist() == sorted(set(labels) | later_labels)
    cfg3 = TrainConfig(out=str(tmp_path / "o3"), num_layers=1, block_size=4, mask_token_id=63, anchors=8,
                       batch_seqs=2, max_steps=1, lr=1e-2, warmup=0.0, init=str(stage1), save_dtype="float32")
    tr = Trainer(cfg3, target, later, log_fn=lambda *a: None)
    assert tr.drafter.draft_vocab is None
