"""A layer's attention inputs from its fused q/k/v projection in one kernel call (`kernels/rope.c`).

The per-layer work between the q/k/v projection and attention (query/key head norms where the
model has them, the rotary embedding, the query layout attention reads, the K/V cache writes)
is the same for every layer of a forward; only the weights and the cache tensors change. So
`QKVPlacement` is built once per forward from where each token goes, and each layer is one call.
It gives the same bits as the PyTorch operators it replaces (models/native/llama.py keeps them
for GPUs, autograd and other dtypes).
"""

from __future__ import annotations

import torch

from blockspec.models import rowmatmul


def _kernel(dtype: torch.dtype, device: torch.device) -> object | None:
    k = rowmatmul.kernel() if device.type == "cpu" else None
    return None if k is None or torch.is_grad_enabled() else k.rope_kv.get(dtype)


class QKVPlacement:
    """Where one forward's T tokens put their queries, keys and values.

    cos, sin [T, d]: each token's rotary tables in the model's dtype. kv_rows, kv_slots [T]: the
    cache row and slot of each token's K/V. Tokens q_from.. also have queries, placed at
    (q_rows, q_cols) [T - q_from] of the attention's [batch, kv_heads, groups * q_len, d] layout
    (row, column of a [batch, q_len] block); the other entries of that layout are zero.
    """

    def __init__(self, fn: object, *, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                 sin: torch.Tensor, kv_rows: torch.Tensor, kv_slots: torch.Tensor, q_from: int,
                 q_rows: torch.Tensor, q_cols: torch.Tensor, batch: int, q_len: int) -> None:
        self.fn = fn
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.groups = heads // kv_heads
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.tokens = cos.shape[0]
        self.kv_rows, self.kv_slots = kv_rows.reshape(-1).to(torch.int64), kv_slots.reshape(-1).to(torch.int64)
        self.q_from, self.batch, self.q_len = q_from, batch, q_len
        self.q_kv_stride = self.groups * q_len * head_dim
        self.q_base = (q_rows.reshape(-1).to(torch.int64) * (kv_heads * self.q_kv_stride)
                       + q_cols.reshape(-1).to(torch.int64) * head_dim).contiguous()
        self.full = self.q_base.numel() == batch * q_len  # every entry of the query layout is written
        # the kernel writes where these say: out-of-range entries would corrupt memory, not raise
        if self.kv_rows.numel() != self.tokens or self.kv_slots.numel() != self.tokens \
                or self.q_base.numel() != self.tokens - q_from:
            raise ValueError(f"need a row and slot for each of the {self.tokens} tokens and a query place for "
                             f"tokens {q_from}..: got {self.kv_rows.numel()}, {self.kv_slots.numel()} and "
                             f"{self.q_base.numel()}")
        if q_rows.numel() and not (0 <= int(q_rows.min()) and int(q_rows.max()) < batch
                                   and 0 <= int(q_cols.min()) and int(q_cols.max()) < q_len):
            raise ValueError(f"query places must lie in [{batch}, {q_len}]")
        self.kv_extent = (int(self.kv_rows.min()), int(self.kv_rows.max()), int(self.kv_slots.min()),
                          int(self.kv_slots.max())) if self.tokens else (0, -1, 0, -1)
        self._kv: tuple[tuple[int, ...], torch.Tensor] | None = None  # (cache strides, offsets [T])

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
        r0, r1, s0, s1 = self.kv_extent
        if r0 < 0 or s0 < 0 or r1 >= k_cache.shape[0] or s1 >= k_cache.shape[2]:
            raise ValueError(f"K/V rows {r0}..{r1} and slots {s0}..{s1} do not fit a cache of "
                             f"{tuple(k_cache.shape)}; reserve the cache first")
        qkv = qkv.contiguous()
        strides = k_cache.stride()
        if self._kv is None or self._kv[0] != strides:
            self._kv = (strides, (self.kv_rows * strides[0] + self.kv_slots * strides[2]).contiguous())
        alloc = torch.empty if self.full else torch.zeros
        q = alloc(self.batch, kvh, self.groups * self.q_len, d, dtype=dtype)
        qw, q_eps = q_norm if q_norm is not None else (None, 0.0)
        kw, k_eps = k_norm if k_norm is not None else (None, 0.0)
        qw = None if qw is None else qw.contiguous()
        kw = None if kw is None else kw.contiguous()
        rc = self.fn(qkv.data_ptr(), self.tokens, width, h, kvh, self.groups, d,
                     None if qw is None else qw.data_ptr(), None if kw is None else kw.data_ptr(), q_eps, k_eps,
                     self.cos.data_ptr(), self.sin.data_ptr(), self.q_from, self.q_base.data_ptr(), q.data_ptr(),
                     self.q_kv_stride, self.q_len * d, self._kv[1].data_ptr(), k_cache.data_ptr(),
                     v_cache.data_ptr(), strides[1], torch.get_num_threads())
        if rc != 0:
            return None
        return q
