"""A layer's attention inputs from its fused q/k/v projection in one kernel call (`cpu/csrc/rope.c`).

The per-layer work between the q/k/v projection and attention (query/key head norms where the
model has them, the rotary embedding, the query layout attention reads, the K/V cache writes)
is the same for every layer of a forward; only the weights and the cache tensors change. So
`QKVPlacement` is built once per forward from where each token goes, and each layer is one call.
It gives the same bits as the PyTorch operators it replaces (targets/native/llama.py keeps them
for GPUs, autograd and other dtypes).
"""

from __future__ import annotations

import functools

import torch

from blockspec.cpu import kernels


def _kernel(dtype: torch.dtype, device: torch.device) -> object | None:
    k = kernels.kernel() if device.type == "cpu" else None
    return None if k is None or torch.is_grad_enabled() else k.rope_kv.get(dtype)


@functools.lru_cache(maxsize=256)
def block_places(batch: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) [batch * q_len] of a [batch, q_len] block's tokens in row-major order (CPU;
    cached: a forward of the same shape reuses them, never writes them)."""
    return torch.arange(batch).repeat_interleave(q_len), torch.arange(q_len).repeat(batch)


class QKVPlacement:
    """Where one forward's T tokens put their queries, keys and values.

    cos, sin [T, d]: each token's rotary tables in the model's dtype. kv_rows, kv_slots [T]: the
    cache row and slot of each token's K/V. Tokens q_from.. also have queries, placed at
    (q_rows, q_cols) [T - q_from] of a [batch, q_len] block in the attention's [batch, kv_heads,
    groups * q_len, d] layout; the other entries of that layout are zero. The kernel checks every
    place against its tensor before writing anything.
    """

    def __init__(self, fn: object, *, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                 sin: torch.Tensor, kv_rows: torch.Tensor, kv_slots: torch.Tensor, q_from: int,
                 q_rows: torch.Tensor, q_cols: torch.Tensor, batch: int, q_len: int) -> None:
        self.fn = fn
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.groups = heads // kv_heads
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.tokens = cos.shape[0]
        index = [t.reshape(-1).to(torch.int64).contiguous() for t in (kv_rows, kv_slots, q_rows, q_cols)]
        self.kv_rows, self.kv_slots, self.q_rows, self.q_cols = index
        if not (self.kv_rows.numel() == self.kv_slots.numel() == self.tokens
                and self.q_rows.numel() == self.q_cols.numel() == self.tokens - q_from):
            raise ValueError(f"need a row and slot for each of the {self.tokens} tokens and a query place for "
                             f"each of tokens {q_from}..: got {self.kv_rows.numel()}, {self.kv_slots.numel()}, "
                             f"{self.q_rows.numel()} and {self.q_cols.numel()}")
        self.q_from, self.batch, self.q_len = q_from, batch, q_len
        self.full = self.q_rows.numel() == batch * q_len  # every entry of the query layout is written

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `build` can return a placement here (the caller may skip building indices)."""
        return _kernel(dtype, torch.device(device)) is not None

    @classmethod
    def build(cls, dtype: torch.dtype, device: torch.device, **kwargs: object) -> QKVPlacement | None:
        """A placement where the kernel takes `dtype` on `device` (CPU, fp32 or bf16, no
        autograd, an even head_dim), else None: the caller keeps PyTorch's operators."""
        fn = _kernel(dtype, torch.device(device))
        if fn is None or kwargs["head_dim"] % 2:
            return None
        return cls(fn, **kwargs)

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_norm: tuple[torch.Tensor, float] | None = None,
                 k_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """qkv [T, (h + 2 kvh) d] -> queries [batch, kv_heads, groups * q_len, d]; writes the keys
        and values into k_cache, v_cache [rows, kv_heads, slots, d]. q_norm, k_norm: (weight [d],
        eps) of per-head RMSNorms. None where these tensors do not fit the kernel (the caller
        then runs PyTorch's operators; nothing was written)."""
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        width = (h + 2 * kvh) * d
        dtype = qkv.dtype
        norms = [n for n in (q_norm, k_norm) if n is not None]
        if (qkv.shape != (self.tokens, width) or self.cos.dtype != dtype
                or any(w.dtype != dtype or w.shape != (d,) for w, _ in norms)
                or k_cache.dtype != dtype or v_cache.dtype != dtype or k_cache.shape != v_cache.shape
                or k_cache.stride() != v_cache.stride() or k_cache.dim() != 4 or k_cache.stride(-1) != 1
                or k_cache.shape[1] != kvh or k_cache.shape[-1] != d):
            return None
        qkv = qkv.contiguous()
        q = (torch.empty if self.full else torch.zeros)(self.batch, kvh, self.groups * self.q_len, d, dtype=dtype)
        qw, q_eps = q_norm if q_norm is not None else (None, 0.0)
        kw, k_eps = k_norm if k_norm is not None else (None, 0.0)
        qw = None if qw is None else qw.contiguous()
        kw = None if kw is None else kw.contiguous()
        rows, _, slots, _ = k_cache.shape
        s_row, s_head, s_slot, _ = k_cache.stride()
        rc = self.fn(qkv.data_ptr(), self.tokens, width, h, kvh, self.groups, d,
                     None if qw is None else qw.data_ptr(), None if kw is None else kw.data_ptr(), q_eps, k_eps,
                     self.cos.data_ptr(), self.sin.data_ptr(), self.q_from, self.q_rows.data_ptr(),
                     self.q_cols.data_ptr(), self.batch, self.q_len, q.data_ptr(), self.kv_rows.data_ptr(),
                     self.kv_slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows, slots, s_row, s_head,
                     s_slot, torch.get_num_threads())
        if rc == 2:
            raise ValueError(f"a token's K/V row or slot lies outside a cache of {tuple(k_cache.shape)}, or its "
                             f"query outside a [{self.batch}, {self.q_len}] block; reserve the cache first")
        return q if rc == 0 else None
