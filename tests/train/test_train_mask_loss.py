"""Anchor sampling, the block attention mask and the loss alignment of the DFlash trainer."""

from __future__ import annotations

import math

import torch
from torch import nn

from blockspec.train.anchors import (
    anchor_candidates,
    block_attention_mask,
    block_labels,
    block_positions,
    sample_anchors,
)
from blockspec.train.loss import block_loss, default_gamma, fused_head_ce, position_weights


def brute_force_mask(anchors: list[int], B: int, S: int, window: int | None = None) -> torch.Tensor:
    n = len(anchors)
    m = torch.zeros(n * B, S + n * B, dtype=torch.bool)
    for qi in range(n * B):
        a = qi // B
        position = anchors[a] + qi % B
        for j in range(S):
            m[qi, j] = j < anchors[a]  # strictly before the anchor
            if window is not None:
                m[qi, j] &= position - j < window  # a sliding window reaches this far back
        for kj in range(n * B):
            m[qi, S + kj] = kj // B == a  # own block only, both directions
    return m


def test_mask_matches_brute_force():
    for anchors, B, S in (([0, 3, 7], 4, 12), ([5], 16, 40), ([2, 9, 10, 20], 3, 23)):
        got = block_attention_mask(torch.tensor(anchors), B, S)
        assert torch.equal(got, brute_force_mask(anchors, B, S))
        for window in (5, 8):
            got = block_attention_mask(torch.tensor(anchors), B, S, window)
            assert torch.equal(got, brute_force_mask(anchors, B, S, window))
    narrow = block_attention_mask(torch.tensor([10]), 4, 12, 5)
    assert narrow[0, 6] and not narrow[0, 5] and narrow[3, 9] and not narrow[3, 8]  # each query its own reach
    assert narrow[0, 12:].all()  # the block itself stays whole


def test_trainer_takes_one_bidirectional_attention_kind():
    import pytest
    from conftest import make_tiny_target

    from blockspec.errors import ConfigError
    from blockspec.dflash.drafter import new_drafter_for_target
    from blockspec.train.trainer import attention_window

    drafter = new_drafter_for_target(make_tiny_target("llama").config, mask_token_id=47, num_layers=2)
    assert attention_window(drafter) is None
    for layer in drafter.layers:
        layer.self_attn.sliding_window = 64
    assert attention_window(drafter) == 64
    drafter.layers[0].self_attn.sliding_window = 32
    with pytest.raises(ConfigError, match="attend alike"):
        attention_window(drafter)
    drafter.layers[0].self_attn.sliding_window = 64
    drafter.layers[1].self_attn.causal = True
    with pytest.raises(ConfigError, match="is_causal to false"):
        attention_window(drafter)


def test_mask_context_is_strict_and_blocks_are_isolated():
    m = block_attention_mask(torch.tensor([4, 8]), 4, 12)
    assert not m[0, 4] and m[0, 3]  # the anchor's own feature is NOT visible
    assert m[0, 12 + 3] and m[3, 12 + 0]  # bidirectional inside the block
    assert not m[0, 12 + 4] and not m[4, 12 + 0]  # blocks never see each other


def test_anchor_candidates_and_sampling():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    # p <= S - B = 6 and token[p] is an assistant token
    assert anchor_candidates(mask, 4).tolist() == [3, 4, 5, 6]
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(mask, 4, 2, g)
    assert a.numel() == 2 and len(set(a.tolist())) == 2 and set(a.tolist()) <= {3, 4, 5, 6}
    assert sample_anchors(mask, 4, 100).tolist() == [3, 4, 5, 6]
    assert block_positions(torch.tensor([3, 6]), 4).tolist() == [3, 4, 5, 6, 6, 7, 8, 9]


def test_labels_are_token_at_anchor_plus_k():
    ids = torch.arange(100, 120)
    mask = torch.tensor([0] * 5 + [1] * 15)
    labels, valid = block_labels(ids, mask, torch.tensor([5, 10]), 4)
    assert labels.tolist() == [[106, 107, 108], [111, 112, 113]]
    assert valid.all()
    labels, valid = block_labels(ids, torch.tensor([0] * 7 + [1] * 13), torch.tensor([4]), 4)
    assert valid.tolist() == [[False, False, True]]  # prompt tokens never count as labels


def test_weights_and_gamma():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    w = position_weights(16)
    assert w.shape == (15,) and w[0] == 1.0
    assert math.isclose(float(w[7]), math.exp(-7 / 7), rel_tol=1e-6)


def test_loss_on_constructed_case_and_shift_detection():
    # Logits put all mass on the correct labels for the CORRECT alignment: loss ~ 0; a label
    # shift by one makes it large. Labels are token[p + k].
    V, B = 11, 4
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    mask = torch.ones(10, dtype=torch.long)
    anchors = torch.tensor([0, 2, 5])
    labels, valid = block_labels(ids, mask, anchors, B)
    logits = torch.full((3, B - 1, V), -30.0)
    for a, p in enumerate(anchors.tolist()):
        for k in range(1, B):
            logits[a, k - 1, ids[p + k]] = 30.0
    assert float(block_loss(logits, labels, valid)) < 1e-6
    shifted = ids[(anchors[:, None] + torch.arange(0, B - 1)[None, :])]  # token[p + k - 1]: wrong
    assert float(block_loss(logits, shifted, valid)) > 10.0
    # known value: uniform logits give ln V whatever the weights
    assert math.isclose(float(block_loss(torch.zeros(3, B - 1, V), labels, valid)), math.log(V), rel_tol=1e-6)
    # the weighting: a single wrong position k=2 of weight exp(-1/gamma)
    lg = logits.clone()
    lg[0, 1] = 0.0  # uniform at k = 2 of the first block
    w = position_weights(B)
    want = float(w[1] * math.log(V) / (w.sum() * 3))
    assert math.isclose(float(block_loss(lg, labels, valid)), want, rel_tol=1e-4)


def test_fused_head_ce_matches_plain_cross_entropy():
    torch.manual_seed(0)
    head = nn.Linear(8, 50, bias=False)
    h = torch.randn(37, 8, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    w = torch.rand(37)
    total, correct = fused_head_ce(h, head, labels, w, chunk=10)
    total.backward()
    g_fused = h.grad.clone()
    h.grad = None
    logits = head(h)
    ref = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * w).sum()
    ref.backward()
    assert torch.allclose(total, ref, atol=1e-5)
    assert torch.allclose(g_fused, h.grad, atol=1e-5)
    assert torch.equal(correct, logits.argmax(-1) == labels)
