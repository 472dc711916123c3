"""The native target's batch-invariant CPU attention (targets/native/attention.py, cpu/csrc/attention.c)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import ragged_prompts

from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu import kernels
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.native import attention as native_attention
from blockspec.targets.native import load_native_target
from blockspec.targets.native.cache import attention_mask
from blockspec.targets.slots import EMPTY
from blockspec.engine.decoder import SpecDecoder


def _case(b: int, kvh: int, g: int, n: int, d: int, cap: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(b, kvh, cap, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(b, kvh, g * n, d, generator=gen).to(dtype)
    return q, k, v


SPANS = {  # positions of 3 rows verifying 5 tokens each; cache capacity
    "short": ([[20, 21, 22, 23, 24], [7, 8, 9, 10, 11], [EMPTY, EMPTY, 30, 31, 32]], 40),
    # across the kernel's key chunks (256): its partial results joined
    "long": ([[253, 254, 255, 256, 257], [600, 601, 602, 603, 604], [EMPTY, EMPTY, 510, 511, 512]], 620),
}


@pytest.mark.parametrize("span", sorted(SPANS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [8, 64, 72])
def test_matches_sdpa_and_each_query_gets_its_bits_alone(dtype: torch.dtype, d: int, span: str) -> None:
    """Numbers as PyTorch's attention under the target's causal mask, zeros for padding (a
    forward that skips padding never reads them), and a query's output bits are the same in a block of 5, in
    a batch of 3 rows or alone, on one thread or two."""
    assert kernels.kernel() is not None
    b, kvh, g, n = 3, 2, 3, 5
    layout, cap = SPANS[span]
    q, k, v = _case(b, kvh, g, n, d, cap, dtype, seed=d)
    positions = torch.tensor(layout)
    horizon = int(positions.max()) + 1
    visible = native_attention.visible_keys(positions, dtype=dtype)
    got = native_attention.cached_attention(q, k, v, visible, horizon, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    mask = attention_mask(positions, horizon, g)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k[:, :, :horizon].double(), v[:, :, :horizon].double(), attn_mask=mask, scale=0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    padding = (positions == EMPTY)[:, None, None, :, None].expand(b, kvh, g, n, d).reshape(b, kvh, g * n, d)
    torch.testing.assert_close(got.double()[~padding], want[~padding], atol=tol, rtol=tol)
    assert torch.equal(got[padding], torch.zeros_like(got[padding])) and padding.sum() == kvh * g * 2 * d
    rows = q.view(b, kvh, g, n, d)
    for bi in range(b):
        for t in range(n):
            alone_q = rows[bi : bi + 1, :, :, t : t + 1].reshape(1, kvh, g, d).contiguous()
            seen = visible[bi : bi + 1, t : t + 1].clone()
            threads = torch.get_num_threads()
            torch.set_num_threads(1 + (bi + t) % 2)
            try:  # its own horizon
                alone = native_attention.cached_attention(alone_q, k[bi : bi + 1].contiguous(),
                                                          v[bi : bi + 1].contiguous(), seen, max(1, int(seen)), 0.3)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(alone.view(kvh, g, d), got.view(b, kvh, g, n, d)[bi, :, :, t])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_first_key_per_query_is_a_sliding_window(dtype: torch.dtype) -> None:
    """start [b, n]: each query sees keys start .. visible - 1 (a drafter's sliding window), in
    and across the kernel's key chunks; a query's bits alone equal its bits in the batch."""
    b, kvh, g, n, d, cap = 2, 2, 3, 4, 64, 700
    q, k, v = _case(b, kvh, g, n, d, cap, dtype, seed=7)
    visible = torch.tensor([[600, 600, 600, 600], [40, 41, 42, 43]])
    start = torch.tensor([[89, 90, 300, 599], [0, 30, 41, 0]])
    got = native_attention.cached_attention(q, k, v, visible, 600, 0.3, start)
    keys = torch.arange(600)
    see = (keys >= start[:, :, None]) & (keys < visible[:, :, None])  # [b, n, S]
    mask = see[:, None].expand(b, g, n, 600).reshape(b, 1, g * n, 600)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k[:, :, :600].double(), v[:, :, :600].double(), attn_mask=mask, scale=0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    rows = q.view(b, kvh, g, n, d)
    for bi in range(b):
        for t in range(n):
            alone = native_attention.cached_attention(
                rows[bi : bi + 1, :, :, t : t + 1].reshape(1, kvh, g, d).contiguous(), k[bi : bi + 1].contiguous(),
                v[bi : bi + 1].contiguous(), visible[bi : bi + 1, t : t + 1].clone(), 600, 0.3,
                start[bi : bi + 1, t : t + 1].clone())
            assert torch.equal(alone.view(kvh, g, d), got.view(b, kvh, g, n, d)[bi, :, :, t])
    # no start is start 0
    zero = native_attention.cached_attention(q, k, v, visible, 600, 0.3, torch.zeros_like(start))
    assert torch.equal(zero, native_attention.cached_attention(q, k, v, visible, 600, 0.3))


def test_only_cpu_passes_of_a_few_tokens_take_the_kernel() -> None:
    few, fp32 = torch.arange(4)[None], torch.float32
    assert native_attention.visible_keys(few, dtype=fp32).tolist() == [[1, 2, 3, 4]]
    long = torch.arange(native_attention.MAX_TOKENS + 1)[None]
    assert native_attention.visible_keys(long, dtype=fp32) is None
    assert native_attention.visible_keys(few, dtype=torch.float64) is None
    q, k, v = _case(1, 1, 1, 1, 8, 4, torch.float64, seed=0)
    assert native_attention.cached_attention(q, k, v, torch.ones(1, 1, dtype=torch.int64), 4, 1.0) is None


def _bf16_target():
    model = make_tiny_target("llama", seed=31, hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                             intermediate_size=128, num_hidden_layers=3)
    return model, load_native_target(model, dtype=torch.bfloat16, eos_token_ids=())


def test_a_bf16_block_forward_equals_one_token_forwards_bit_for_bit() -> None:
    """300 tokens of context (past PyTorch attention's small-size paths), then a block of 6."""
    _, target = _bf16_target()
    ids = torch.randint(0, 48, (1, 306), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        block_cache, step_cache = target.new_cache(1), target.new_cache(1)
        for cache in (block_cache, step_cache):
            cache.reserve(306)
            target.forward(ids[:, :300], torch.arange(300)[None], cache)
        block, _ = target.forward(ids[:, 300:], torch.arange(300, 306)[None], block_cache)  # [1, 6, V]
        steps = [target.forward(ids[:, p : p + 1], torch.tensor([[p]]), step_cache)[0] for p in range(300, 306)]
    assert block.dtype == torch.bfloat16
    assert torch.equal(block, torch.cat(steps, dim=1))


def test_bf16_speculative_greedy_equals_plain_greedy() -> None:
    """bf16 rounds every layer's output: verification must compute each token exactly as plain
    decoding does (on SmolLM2-135M in bf16, PyTorch's attention made 7 of 8 outputs drift)."""
    model, target = _bf16_target()
    prompts = ragged_prompts(4, seed=32, vocab=48)
    params = SamplingParams(max_new_tokens=40)
    plain = [r.token_ids for r in SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)]
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.bfloat16)
    spec = [r.token_ids for r in SpecDecoder(target, drafter, SpecConfig(block_size=8)).generate(prompts, params)]
    assert spec == plain


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_long_prefills_of_whole_prompts_attend_under_the_causal_rule(monkeypatch: pytest.MonkeyPatch,
                                                                     family: str) -> None:
    """Passes of more than MAX_TOKENS tokens keep PyTorch's attention (64 here, so tiny prompts
    take that path). Whole prompts from position 0 (padding after them) go through it with
    is_causal (the keys above the diagonal skipped, no mask read), with the logits of each prompt
    alone in Hugging Face's model, right-padded in one call, left-padded (as the engine joins
    prompts) in one call per row; a pass that starts after some context keeps the mask, and so
    does a row with a gap."""
    import torch.nn.functional as F

    monkeypatch.setattr(native_attention, "MAX_TOKENS", 64)
    model = make_tiny_target(family, seed=12, dtype=torch.float32)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    assert target.net.cfg.groups > 1
    kernels.kernel()  # built (and checked against PyTorch's attention) before the spy counts calls
    calls: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, is_causal=False, **kw):
        calls.append(is_causal)
        return sdpa(*args, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(5)
    lengths = [100, 70, 83]
    ids = torch.randint(0, 48, (3, 100), generator=gen)
    positions = torch.arange(100).repeat(3, 1)
    positions[torch.arange(100)[None] >= torch.tensor(lengths)[:, None]] = EMPTY
    logits, _ = target.forward(ids, positions, target.new_cache(3))
    assert calls and all(calls)  # every layer, causal
    for row, n in enumerate(lengths):
        with torch.no_grad():
            ref = model(ids[row : row + 1, :n]).logits[0]
        torch.testing.assert_close(logits[row, :n], ref, atol=2e-5, rtol=2e-5)
    # alone (batch 1: no host check needed) as in the batch
    calls.clear()
    alone, _ = target.forward(ids[1:2, :70], positions[1:2, :70], target.new_cache(1))
    assert calls and all(calls)
    torch.testing.assert_close(alone[0], logits[1, :70], atol=2e-5, rtol=2e-5)
    # 70 tokens after 30 of context: the mask
    calls.clear()
    cache = target.new_cache(1)
    target.forward(ids[:1, :30], positions[:1, :30], cache)
    later, _ = target.forward(ids[:1, 30:], positions[:1, 30:], cache)
    assert calls and not any(calls)
    torch.testing.assert_close(later[0], logits[0, 30:], atol=2e-5, rtol=2e-5)
    # left padding (the engine's joins): one causal call per row, over its own tokens
    calls.clear()
    left = torch.full((2, 100), EMPTY)
    left[0] = torch.arange(100)
    left[1, 30:] = torch.arange(70)
    shifted = torch.cat([ids[1:2, 70:], ids[1:2, :70]], dim=1)  # row 1's prompt at the end
    got, _ = target.forward(torch.cat([ids[:1], shifted]), left, target.new_cache(2))
    assert len(calls) == 2 * target.net.cfg.num_layers and all(calls)
    torch.testing.assert_close(got[1, 30:], logits[1, :70], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[0], logits[0], atol=2e-5, rtol=2e-5)
    # a gap inside a row's tokens: the mask
    calls.clear()
    gap = left.clone()
    gap[1, 40] = EMPTY
    target.forward(torch.cat([ids[:1], shifted]), gap, target.new_cache(2))
    assert calls and not any(calls)


def test_prompts_up_to_max_tokens_prefill_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of more than 64 and at most MAX_TOKENS tokens attend in the kernel, not PyTorch's
    attention: Hugging Face's logits for each prompt, and a prompt's attention alike alone and
    left-padded beside a longer one (the engine's joins)."""
    import torch.nn.functional as F

    assert native_attention.MAX_TOKENS >= 100
    model = make_tiny_target("llama", seed=13, dtype=torch.float32)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    if kernels.kernel() is None:
        pytest.skip("no C compiler: the kernel is not built here")
    sdpa_calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kw):
        sdpa_calls.append(1)
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 48, (2, 100), generator=gen)
    alone, _ = target.forward(ids[1:2, :70], torch.arange(70)[None], target.new_cache(1))
    left = torch.full((2, 100), EMPTY)
    left[0] = torch.arange(100)
    left[1, 30:] = torch.arange(70)
    joined = torch.cat([ids[:1], torch.cat([ids[1:2, 70:], ids[1:2, :70]], dim=1)])
    both, _ = target.forward(joined, left, target.new_cache(2))
    assert not sdpa_calls
    monkeypatch.undo()  # Hugging Face's model attends through PyTorch's kernel
    with torch.no_grad():
        for got, ref in ((both[0], model(ids[:1]).logits[0]), (alone[0], model(ids[1:2, :70]).logits[0])):
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(both[1, 30:], alone[0], atol=2e-5, rtol=2e-5)
