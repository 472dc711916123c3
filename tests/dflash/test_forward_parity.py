"""The drafter's one forward (`DFlashDrafter.forward`) over its three backends gives the same
drafts: `DraftCache`'s module pass (the reference), the static cache's pass through the PyTorch
layer loop, and the same with the C layer program (cpu/program.py) where it takes the pass.

Random drafters of every attention kind (bidirectional, causal, a sliding window that cuts the
context, sliding and full layers mixed, DFlash 2 with its convolutions), two passes over a
ragged batch with a padded context: the hidden states agree to fp32 rounding and the greedy
proposals are the same tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from blockspec.cpu import kernels
from blockspec.cpu.program import LayerProgram
from blockspec.cpu.qkv import block_places
from blockspec.dflash.drafter import DFLASH2, DFlashDrafter, init_drafter_weights, new_drafter_for_target
from blockspec.dflash.static_drafter import StaticDrafter, StaticPass, StaticWeights
from blockspec.targets.native.attention import visible_keys, visible_keys_fit
from blockspec.targets.slots import EMPTY

KINDS = ["bidirectional", "causal", "window-cuts", "window-wide", "sliding-and-full", "dflash2"]


def _drafter(kind: str) -> DFlashDrafter:
    model = make_tiny_target("llama", seed=9, dtype=torch.float32)
    if kind == "dflash2":
        drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, architecture=DFLASH2,
                                         dflash2=dict(conv_group_size=8, selector_rank=8, selector_top_k=6))
    else:
        drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2)
    init_drafter_weights(drafter, std=0.3, seed=1)  # large weights: attention really mixes
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=g)
        if kind == "dflash2":  # convolutions off the identity
            for layer in drafter.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.add_(0.3 * torch.randn(conv.base_kernel.shape, generator=g))
                    conv.kernel_projection.weight.normal_(0.0, 0.2, generator=g)
    windows = {"window-cuts": (3, 3), "window-wide": (6, 6), "sliding-and-full": (5, None)}.get(kind, (None, None))
    for layer, window in zip(drafter.layers, windows):
        layer.self_attn.sliding_window = window
        layer.self_attn.causal = kind == "causal"
    return drafter.eval()


def _passes(drafter: DFlashDrafter, run, cache, rows: slice = slice(None)) -> list[torch.Tensor]:
    """Two passes (blocks of 4, then 8) for 2 rows, row 0's context left-padded, the second
    pass's context the first block's accepted prefix (the rest EMPTY), or for `rows` of them:
    each pass's hidden states."""
    g = torch.Generator().manual_seed(3)
    width = len(drafter.target_layer_ids) * 32
    feats = torch.randn(2, 7, width, generator=g)
    ctx_pos = torch.tensor([[EMPTY, EMPTY, 0, 1, 2, 3, 4], list(range(7))])
    start = torch.tensor([5, 7])
    outs = []
    for q, keep_n in ((4, [2, 3]), (8, [1, 4])):
        block_pos = start[:, None] + torch.arange(q)
        embeds = torch.randn(2, q, 32, generator=g)
        cache.reserve(int(block_pos[rows].max()) + 1, 64)
        outs.append(run(feats[rows], ctx_pos[rows], embeds[rows], block_pos[rows], cache))
        keep = torch.arange(q)[None] < torch.tensor(keep_n)[:, None]
        feats = torch.randn(2, q, width, generator=g)
        ctx_pos = torch.where(keep, block_pos, torch.full_like(block_pos, EMPTY))
        start = start + torch.tensor(keep_n)
    return outs


@torch.inference_mode()
def _proposals(drafter: DFlashDrafter, hidden: torch.Tensor) -> torch.Tensor:
    head = torch.nn.Linear(32, drafter.cfg.vocab_size, bias=False)
    torch.nn.init.normal_(head.weight, 0.0, 1.0, generator=torch.Generator().manual_seed(4))
    anchor = torch.tensor([5, 9])[: hidden.shape[0]]  # DFlash 2's walk starts from the last verified token
    return drafter.greedy_tokens(hidden[:, 1:], head, anchor if drafter.cfg.dflash2 else None)


@pytest.mark.parametrize("batch", [2, 1], ids=["ragged", "one-row"])  # one row: no padding, no mask needed
@pytest.mark.parametrize("kind", KINDS)
def test_module_static_loop_and_layer_program_agree(kind: str, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = _drafter(kind)
    rows = slice(2 - batch, 2)
    with torch.inference_mode():
        want = _passes(drafter, drafter, drafter.new_cache(batch), rows)
    runs = {}
    for program in (False, True):
        with monkeypatch.context() as patch:
            if not program:
                patch.setattr(StaticWeights, "program", lambda *args: None)
            calls: list[int] = []
            real = LayerProgram.run
            patch.setattr(LayerProgram, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
            static = StaticDrafter(drafter)
            runs[program] = _passes(drafter, static, static.new_cache(batch), rows)
        # the program takes bidirectional DFlash passes with one window no shorter than the block
        # (window-wide: the first pass only) whose rows fit its products (AVX-512 builds: up to
        # 21 rows here); never causal layers or DFlash 2's convolutions
        fits = program and kernels.kernel() is not None and kernels.max_rows(torch.float32, exact=False) >= 24
        assert len(calls) == ({"bidirectional": 2, "window-wide": 1}.get(kind, 0) if fits else 0)
    for got_loop, got_program, ref in zip(runs[False], runs[True], want):
        torch.testing.assert_close(got_loop, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_program, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_program, got_loop)  # the program has the loop's bits
        tokens = _proposals(drafter, ref)
        assert torch.equal(_proposals(drafter, got_loop), tokens)
        assert torch.equal(_proposals(drafter, got_program), tokens)


def test_the_module_forward_with_a_static_cache_is_the_static_drafter() -> None:
    """`StaticDrafter` is the module's forward over its cache: calling the module directly with
    that cache gives the same bits; a cache of another drafter, or a training mask, is refused."""
    drafter, other = _drafter("bidirectional"), _drafter("causal")
    static = StaticDrafter(drafter)
    with torch.inference_mode():
        via_wrapper = _passes(drafter, static, static.new_cache(2))
        direct = _passes(drafter, drafter, static.new_cache(2))
    for a, b in zip(via_wrapper, direct):
        assert torch.equal(a, b)
    cache = StaticDrafter(other).new_cache(1)
    cache.reserve(4, 8)
    width = len(drafter.target_layer_ids) * 32
    args = (torch.randn(1, 2, width), torch.arange(2)[None], torch.randn(1, 2, 32), torch.arange(2, 4)[None])
    with torch.inference_mode(), pytest.raises(ValueError, match="another drafter"):
        drafter(*args, cache)
    with torch.inference_mode(), pytest.raises(ValueError, match="no attn_mask"):
        other(*args, cache, attn_mask=torch.ones(1, 1, 2, 4, dtype=torch.bool))


def test_a_pass_geometry_from_host_lists_is_the_tensor_ones() -> None:
    # StaticPass works a small pass's geometry out on the host: the same tensors as the tensor
    # operations give, with padding, context slots the block overwrites (the scratch slot), a lone
    # EMPTY position (kept, as padding_index keeps it) and no context at all
    static = StaticDrafter(_drafter("bidirectional"))
    cache = static.new_cache(3)
    cache.reserve(40, 64)
    g = torch.Generator().manual_seed(5)
    cases = [(torch.tensor([[EMPTY]]), torch.tensor([[3, 4]])), (torch.empty(2, 0, dtype=torch.long),
                                                                 torch.tensor([[4, 5], [9, 10]]))]
    for _ in range(30):
        b, c, q = (int(torch.randint(1, 4, (), generator=g)), int(torch.randint(1, 9, (), generator=g)),
                   int(torch.randint(1, 6, (), generator=g)))
        ctx = torch.randint(0, 30, (b, c), generator=g)
        ctx[torch.rand(b, c, generator=g) < 0.3] = EMPTY
        start = torch.randint(0, 30, (b, 1), generator=g)
        cases.append((ctx, start + torch.arange(q)))
    overlaps = 0
    for ctx, block in cases:
        want = StaticPass._geometry(cache, ctx, block)
        got = StaticPass._host_geometry(cache, ctx, block)
        assert (got[0] is None) == (want[0] is None)
        assert want[0] is None or torch.equal(got[0], want[0])
        assert all(torch.equal(a, w) and a.dtype == w.dtype for a, w in zip(got[1:4], want[1:]))
        b, q = block.shape  # the block's query columns and the keys its queries see, as worked out apart
        assert torch.equal(got[4], block_places(b, q)[1])
        assert torch.equal(got[5], (block[:, :1] + q).expand(b, q))
        if visible_keys_fit(torch.float32, block.device, q):
            assert torch.equal(got[5], visible_keys((block[:, :1] + q - 1).expand(b, q), torch.float32))
        overlaps += int((want[3] == cache.scratch).sum())
    assert overlaps > 0  # some context slots went to the scratch slot
