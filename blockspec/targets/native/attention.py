"""The native target's attention for a few query tokens on a CPU, batch invariant.

PyTorch's CPU attention splits its work by the number of queries, so a token verified in a block
got other bits than the same token decoded alone: ~1e-5 in fp32 logits, up to 0.4 in bf16,
where speculative output then drifted from plain decoding within a few dozen tokens.
`cpu/csrc/attention.c` (built with the projections' kernel, cpu/kernels.py)
computes each query the same way whatever else is in the pass, so verification sees exactly
what one-token decoding sees. Where it is unavailable (no compiler, a GPU, a prompt of more than
MAX_TOKENS), the caller keeps `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

import torch

from blockspec.cpu import kernels

# Query tokens per row that the kernel takes: decoding, verification, and prompts of up to this
# many tokens. Its prefills were faster than PyTorch's flash attention under the causal rule
# (docs/DESIGN.md section 12), and a prompt then attends alike alone or joined. Longer prompts
# keep PyTorch's kernel: this one keeps each query's partial sums per chunk of keys, scratch that
# grows with the square of the prompt.
MAX_TOKENS = 512


def visible_keys(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Keys (a prefix of the position-indexed cache) each query token sees [b, q] (int64), or
    None where the kernel does not take this pass (decided once per forward, not per layer).
    Slot j is visible to position p when j <= p; padding (EMPTY) sees nothing, so the kernel
    skips it (its output is zeros; a forward that skips padding never reads it)."""
    if not visible_keys_fit(dtype, positions.device, positions.shape[1]):
        return None
    return (positions + 1).clamp_min(0).to(torch.int64).contiguous()


def visible_keys_fit(dtype: torch.dtype, device: torch.device, tokens: int) -> bool:
    """Whether the kernel takes a pass of `tokens` query tokens per row in `dtype` on `device`
    (`visible_keys` gives its table then, else None)."""
    k = kernels.kernel()
    return k is not None and dtype in k.attention and device.type == "cpu" and tokens <= MAX_TOKENS


def cached_attention(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                     horizon: int, scale: float, start: torch.Tensor | None = None,
                     tree: torch.Tensor | None = None) -> torch.Tensor | None:
    """softmax(q k^T scale) v per query over its visible keys -> [b, kvh, g * q, d] in qg's dtype.

    qg [b, kvh, g * q, d]; k_cache, v_cache [b, kvh, cap, d] (only the first `horizon` slots are
    read); visible from `visible_keys` (each query's number of keys); start [b, q] (int64,
    optional): each query's first key (a sliding window's), else 0. tree [b, q, 1 + w] (int64,
    optional; targets/native/tree_slots.py): a token tree's keys, where key j of a query is slot
    j below its base tree[.., 0] and slot tree[.., 1 + j - base] from there (its ancestors by
    depth, then itself), summed in that order as plain decoding sums the same keys. None where
    the kernel does not handle these tensors (a dtype other than fp32/bf16, a cache that is not a
    plain contiguous tensor).
    """
    k = kernels.kernel()
    fn = None if k is None else k.attention.get(qg.dtype)
    if fn is None or k_cache.dtype != qg.dtype or v_cache.dtype != qg.dtype:
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()):
        return None
    b, kvh, m, d = qg.shape
    n = visible.shape[1]
    q = qg.contiguous()
    out = torch.empty(b, kvh, m, d, dtype=torch.float32)
    if tree is not None and (tree.dtype != torch.int64 or tree.shape[:2] != (b, n) or not tree.is_contiguous()):
        raise ValueError(f"a tree's keys must be a contiguous int64 [{b}, {n}, 1 + w] table, got "
                         f"{tree.dtype} {tuple(tree.shape)}")
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), visible.data_ptr(),
            None if start is None else start.data_ptr(), None if tree is None else tree.data_ptr(), b, kvh, m // n, n,
            d, k_cache.stride(0), k_cache.stride(1), horizon, 0 if tree is None else tree.shape[2] - 1, scale,
            torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"a tree node's key lies outside the cache's first {horizon} slots; reserve the cache first")
    if rc != 0:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out if qg.dtype == torch.float32 else out.to(qg.dtype)
