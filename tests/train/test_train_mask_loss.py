"""Anchor sampling, the block attention mask and the loss alignment of the DFlash trainer."""

from __future__ import annotations

import math

import pytest
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


def test_trainer_takes_each_layers_window_and_refuses_causal_layers():
    import pytest
    from conftest import make_tiny_target

    from blockspec.dflash.drafter import new_drafter_for_target
    from blockspec.errors import ConfigError
    from blockspec.train.sequence import attention_windows

    drafter = new_drafter_for_target(make_tiny_target("llama").config, mask_token_id=47, num_layers=3)
    assert attention_windows(drafter) == [None]
    for layer in drafter.layers:
        layer.self_attn.sliding_window = 64
    assert attention_windows(drafter) == [64]
    drafter.layers[0].self_attn.sliding_window = 32
    drafter.layers[2].self_attn.sliding_window = None
    assert attention_windows(drafter) == [None, 32, 64]  # a mask per window: mixed layers train
    drafter.layers[1].self_attn.causal = True
    with pytest.raises(ConfigError, match=r"layers \[1\] are causal: set is_causal to false"):
        attention_windows(drafter)


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_packed_training_pass_equals_inference_for_mixed_sliding_and_full_layers(architecture):
    """A drafter shaped like Z Lab's Qwen3.6 drafters (sliding and full layers mixed, no
    is_causal): each block of training's packed pass (one mask per layer window, DFlash 2's
    convolutions stopping at block starts) has the hidden states of its inference pass, which
    sees the context before its anchor within each layer's window and the block bidirectionally."""
    from conftest import make_tiny_target

    from blockspec.dflash.drafter import DrafterConfig, DFlashDrafter, init_drafter_weights, new_drafter_for_target
    from blockspec.train.sequence import attention_windows

    base = new_drafter_for_target(make_tiny_target("qwen3").config, mask_token_id=47, num_layers=3, block_size=4,
                                  architecture=architecture,
                                  dflash2=dict(conv_group_size=8) if architecture != "DFlashDraftModel" else None)
    raw = base.cfg.to_dict()
    raw.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6)
    raw.pop("is_causal", None)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw))
    init_drafter_weights(drafter, std=0.3, seed=2)
    if drafter.cfg.dflash2:
        with torch.no_grad():
            for layer in drafter.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.kernel_projection.weight.normal_(0.0, 0.3)
                    conv.base_kernel[:, 1] = 0.5
    drafter = drafter.double().eval()
    assert [(layer.self_attn.causal, layer.self_attn.sliding_window) for layer in drafter.layers] == [
        (False, 6), (False, None), (False, 6)]
    B, S = 4, 20
    anchors = torch.tensor([3, 9, 15, 16])
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, S, 3 * 32, generator=g, dtype=torch.float64)
    embeds = torch.randn(1, 4 * B, 32, generator=g, dtype=torch.float64)
    masks = {w: block_attention_mask(anchors, B, S, w)[None, None] for w in attention_windows(drafter)}
    with torch.no_grad():
        packed = drafter(feats, torch.arange(S)[None], embeds, block_positions(anchors, B)[None], attn_mask=masks,
                         block_len=B).view(4, B, -1)
        for j, a in enumerate(anchors.tolist()):
            alone = drafter(feats[:, :a], torch.arange(a)[None], embeds[:, j * B:(j + 1) * B],
                            torch.arange(a, a + B)[None])
            torch.testing.assert_close(packed[j], alone[0], rtol=1e-9, atol=1e-9)
        one_mask = drafter(feats, torch.arange(S)[None], embeds, block_positions(anchors, B)[None],
                           attn_mask=masks[None], block_len=B).view(4, B, -1)
    assert not torch.allclose(one_mask[2:], packed[2:])  # the windows matter for late anchors


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
