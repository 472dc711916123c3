"""Distillation (`blockspec train --distill`): the soft-label loss and its gradient, the target's
distributions read from a captured late-layer feature, and a training step that lowers it."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import CharTokenizer, predictable_target, prompts
from torch import nn

from blockspec.errors import ConfigError
from blockspec.targets.native import load_native_target
from blockspec.targets.hf import HFTarget
from blockspec.train import teacher as T
from blockspec.train.data import read_examples
from blockspec.train.datagen import regenerate
from blockspec.train.features import target_features
from blockspec.train.loss import fused_head_ce, position_weights, soft_block_ce
from blockspec.train.trainer import Trainer
from blockspec.train.train_config import TrainConfig
from blockspec.train.sequence import derived_seed, prepare_sequence, sequence_forward


def _case(m: int = 37, vocab: int = 50, rows: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(8, vocab, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, 8, generator=g))
        head.bias.copy_(torch.randn(vocab, generator=g))
    h = torch.randn(m, 8, generator=g)
    labels = torch.randint(0, vocab, (m,), generator=g)
    w = torch.rand(m, generator=g)
    table = torch.softmax(3 * torch.randn(rows, vocab, generator=g), -1)  # [U, V] teacher probabilities
    at = torch.randint(0, rows, (m,), generator=g)
    return head, h, labels, w, table, at


@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_fused_loss_with_a_teacher_matches_the_reference_and_its_gradient(alpha: float) -> None:
    head, h, labels, w, table, at = _case()
    mult = 0.7
    x = h.clone().requires_grad_(True)
    total, correct = fused_head_ce(x, head, labels, w, output_multiplier=mult, chunk=10, teacher=table,
                                   teacher_rows=at, alpha=alpha)
    total.backward()
    y = h.clone().requires_grad_(True)
    logits = head(y) * mult
    ref = soft_block_ce(logits, labels, w, table[at], alpha)
    ref.backward()
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, logits.argmax(-1) == labels)
    # the reference itself: cross-entropy of the mixed label distribution
    t = alpha * table[at]
    t[torch.arange(labels.numel()), labels] += 1 - alpha
    manual = -(t * torch.log_softmax(logits.detach(), -1)).sum(-1) @ w
    torch.testing.assert_close(ref.detach(), manual, rtol=1e-5, atol=1e-5)


def test_distillation_reduces_to_the_published_loss() -> None:
    head, h, labels, w, table, at = _case(seed=1)
    plain, _ = fused_head_ce(h, head, labels, w)
    off, _ = fused_head_ce(h, head, labels, w, teacher=table, teacher_rows=at, alpha=0.0)
    assert torch.equal(off, plain)
    # a teacher sure of the label is the hard label, whatever its weight
    onehot = torch.zeros(labels.numel(), head.weight.shape[0])
    onehot[torch.arange(labels.numel()), labels] = 1.0
    sure, _ = fused_head_ce(h, head, labels, w, teacher=onehot, teacher_rows=torch.arange(labels.numel()), alpha=0.6)
    torch.testing.assert_close(sure, plain, rtol=1e-5, atol=1e-5)
    # and a different teacher changes it
    soft, _ = fused_head_ce(h, head, labels, w, teacher=table, teacher_rows=at, alpha=0.6)
    assert abs(float(soft - plain)) > 1e-3
    with pytest.raises(ValueError, match="alpha"):
        fused_head_ce(h, head, labels, w, teacher=table, teacher_rows=at, alpha=1.5)
    with pytest.raises(ValueError, match="teacher"):
        fused_head_ce(h, head, labels, w, teacher=table[:, :7], teacher_rows=at, alpha=0.5)


def test_teacher_from_a_late_feature_equals_the_full_forward() -> None:
    model = make_tiny_target("llama", seed=5, dtype=torch.float32, num_hidden_layers=6)
    hf = HFTarget(model, eos_token_ids=())
    ids = torch.randint(0, 48, (23,), generator=torch.Generator().manual_seed(6))
    full = target_features(hf, [ids.tolist()], (1, 4, 5))[0]  # [S, 3H]; 5 = last, after the final norm
    final = full[:, 2 * 32 :]
    layers = (1, 4)
    feats = full[:, : 2 * 32]
    native = T.teacher_target(hf)
    assert native is not hf and hasattr(native, "final_hidden")  # a native copy of the HF target
    tail = T.teacher_hidden(native, ids, feats, layers)  # layer 5 only, from layer 4's output
    torch.testing.assert_close(tail, final, rtol=1e-5, atol=1e-5)
    whole = T.teacher_hidden(hf, ids, feats, layers)  # no native copy: a full forward
    torch.testing.assert_close(whole, final, rtol=1e-5, atol=1e-5)
    assert torch.equal(T.teacher_hidden(native, ids, full, (1, 4, 5)), final)  # the last layer is captured
    # the layers below the resumed one really are skipped: other features, another result
    moved = T.teacher_hidden(native, ids, feats + 0.5, layers)
    assert not torch.allclose(moved, final, atol=1e-3)
    probs = T.teacher_probs(tail, native.head())
    torch.testing.assert_close(probs.sum(-1), torch.ones(ids.numel()))
    assert torch.equal(probs.argmax(-1), native.head()(final).argmax(-1))


def test_a_native_target_resumes_at_any_layer() -> None:
    model = make_tiny_target("qwen3", seed=7, dtype=torch.float32)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(8))
    every = target_features(target, ids.tolist(), (0, 1, 2, 3))
    for start in (1, 2, 3):
        x = torch.stack([f[:, (start - 1) * 32 : start * 32] for f in every])
        got = target.final_hidden(ids, start, x)
        torch.testing.assert_close(got, torch.stack([f[:, 3 * 32 :] for f in every]))
    with pytest.raises(ValueError, match="start"):
        target.final_hidden(ids, 0, x)


def test_a_distillation_step_lowers_its_loss(tmp_path) -> None:
    target = predictable_target()
    regenerate(target, CharTokenizer(), prompts(4), tmp_path / "d", max_new_tokens=24, progress=False, backend="hf")
    examples = read_examples(tmp_path / "d")
    cfg = TrainConfig(out=str(tmp_path / "o"), num_layers=1, block_size=4, mask_token_id=63, anchors=16,
                      batch_seqs=4, max_steps=1, lr=1e-2, warmup=0.0, init="random", target_layer_ids=(1, 2),
                      distill=0.5)
    torch.set_num_threads(1)
    tr = Trainer(cfg, target, examples, log_fn=lambda *a: None)
    assert hasattr(tr.teacher, "final_hidden")
    w = position_weights(4)

    def batch_loss(distill: float) -> float:
        tot, wsum = 0.0, 0.0
        with torch.no_grad():
            for i, ex in enumerate(examples):
                s = prepare_sequence(ex, 4, 16, 512, w, seed=derived_seed(cfg.seed, "anchors", 0, i))
                feats = tr._features(ex, s.ids.numel())
                teacher = T.teacher_hidden(tr.teacher, s.ids, feats, (1, 2))
                total, _ = sequence_forward(tr.drafter, target, s, feats, teacher=teacher, distill=distill)
                tot, wsum = tot + float(total), wsum + s.weight_sum
        return tot / wsum

    before, before_hard = batch_loss(0.5), batch_loss(0.0)
    assert abs(before - before_hard) > 1e-4  # the teacher's distribution is in the loss
    rec = tr.train_step(0)
    assert rec["distill"] == 0.5
    assert rec["loss"] == pytest.approx(before, rel=1e-4)  # the logged loss is this batch's loss
    after = batch_loss(0.5)
    assert after < before - 0.01 * before, (before, after)


def test_distill_weight_is_validated(tmp_path) -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="--distill"):
            TrainConfig(out=str(tmp_path), distill=bad)
