"""Gated DeltaNet layers (the linear attention of Qwen3-Next, Qwen3.5 and Qwen3.6) with a state
that can be rolled back to any token of the last forward.

A Gated DeltaNet layer carries two states per row instead of K/V: the last K-1 inputs of its
causal convolution, and a recurrent matrix S [h, dk, dv] updated once per token:
    S_t = e^{g_t} S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = S_t^T q_t.
Verification feeds a block of q tokens and may keep only the first n of them; the state must then
be the one after token n, which a recurrence cannot undo. Unrolled over a block that starts from
S_0 (G_t the cumulative sum of g):
    S_t = e^{G_t} S_0 + sum_{i<=t} e^{G_t - G_i} k_i d_i^T,
and the updates d solve one unit lower-triangular system (the chunked form of the delta rule). So
a forward computes the block's outputs from S_0, keeps (k, d, G) of the block as `Pending`, and the
commit builds S_n for each row's own n from them: one [dk, n] x [n, dv] product, the cost of
computing the final state anyway. Nothing is snapshotted per position and nothing is re-run.

The projections, gated norm and output projection are the Hugging Face module's own; the
convolution and the delta rule are computed here, in float32 at least (as the Hugging Face
kernels do; float64 models keep float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# Tokens per chunk of a long forward (a prefill): the triangular systems stay [64, 64]. Only the
# last chunk stays pending, so a rollback reaches back at most this far (a verify block is shorter).
CHUNK = 64


def is_gated_delta(module: nn.Module) -> bool:
    """Whether `module` is a Gated DeltaNet layer of a layout this file knows."""
    fused = all(hasattr(module, n) for n in ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"))
    split = all(hasattr(module, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    common = all(hasattr(module, n) for n in ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "conv_kernel_size",
                                               "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim"))
    return (fused or split) and common and getattr(module, "activation", "silu") == "silu"


@dataclass
class Pending:
    """The last forward's block, until the commit says how much of it stays."""

    conv_in: torch.Tensor  # [b, C, K-1+t]: the convolution inputs before the pending chunk, then its own
    start: int  # column of the block where the pending chunk starts (0 unless longer than CHUNK)
    keys: torch.Tensor  # [b, h, t, dk] normalised keys of the pending chunk
    deltas: torch.Tensor  # [b, h, t, dv] the chunk's updates d
    decay: torch.Tensor  # [b, h, t] cumulative log decay G within the chunk
    valid: torch.Tensor  # [b, T] False at padding


class DeltaState:
    """One Gated DeltaNet layer's state for a batch: conv [b, C, K-1], rec [b, h, dk, dv]
    (the state before the pending block while one is pending)."""

    def __init__(self, conv: torch.Tensor, rec: torch.Tensor) -> None:
        self.conv = conv
        self.rec = rec
        self.pending: Pending | None = None

    @classmethod
    def zeros(cls, module: nn.Module, batch: int, dtype: torch.dtype, device: torch.device | str) -> DeltaState:
        """The state before any token, shaped from the layer (its config's linear_* sizes)."""
        channels = module.conv1d.weight.shape[0]
        conv = torch.zeros(batch, channels, module.conv_kernel_size - 1, dtype=dtype, device=device)
        rec = torch.zeros(batch, module.num_v_heads, module.head_k_dim, module.head_v_dim,
                          dtype=compute_dtype(dtype), device=device)
        return cls(conv, rec)

    def commit(self, keep: torch.Tensor | None = None) -> None:
        """Makes the state the one after the last kept token of the pending block; keep [b, T]
        (None: every token). Kept tokens must be a prefix of each row's valid tokens."""
        p = self.pending
        if p is None:
            if keep is not None:  # the tokens are already in the state: they cannot be taken out
                raise RuntimeError("a rejection must follow the forward that fed its tokens")
            return
        if keep is not None and keep.shape != p.valid.shape:
            raise ValueError(f"keep {tuple(keep.shape)} must cover the last forward's tokens {tuple(p.valid.shape)}")
        self.pending = None
        n = _ends(p.valid if keep is None else p.valid & keep)  # [b] columns of the block that stay
        if bool((n < p.start).any()):
            raise RuntimeError(f"a Gated DeltaNet state rolls back at most {CHUNK} tokens")
        width = self.conv.shape[-1]
        index = (n - p.start)[:, None] + torch.arange(width, device=n.device)  # [b, K-1]
        self.conv = torch.gather(p.conv_in, 2, index[:, None, :].expand(-1, p.conv_in.shape[1], -1))
        self.rec = advance(self.rec, p.keys, p.deltas, p.decay, n - p.start)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.commit()
        self.conv, self.rec = self.conv[rows], self.rec[rows]

    def spawn(self, batch: int) -> DeltaState:
        """The state before any token for `batch` new rows, shaped like this one."""
        return DeltaState(self.conv.new_zeros((batch, *self.conv.shape[1:])),
                          self.rec.new_zeros((batch, *self.rec.shape[1:])))

    def merge(self, other: DeltaState) -> None:
        """Appends other's rows."""
        self.commit()
        other.commit()
        self.conv = torch.cat([self.conv, other.conv])
        self.rec = torch.cat([self.rec, other.rec])


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The delta rule runs in float32 at least (its state accumulates over the whole sequence)."""
    return torch.promote_types(dtype, torch.float32)


def _ends(kept: torch.Tensor) -> torch.Tensor:
    """Per row, one past the last True column of kept [b, T] (0 if none)."""
    cols = torch.arange(1, kept.shape[1] + 1, device=kept.device)
    return (cols * kept).amax(dim=1)


def advance(s0: torch.Tensor, keys: torch.Tensor, deltas: torch.Tensor, decay: torch.Tensor,
            n: torch.Tensor) -> torch.Tensor:
    """The state after the first n[b] tokens of a chunk that started from s0 [b, h, dk, dv]."""
    b, h, t, _ = keys.shape
    total = F.pad(decay, (1, 0)).gather(-1, n[:, None, None].expand(b, h, 1))[..., 0]  # [b, h] G_n
    later = torch.arange(t, device=keys.device) >= n[:, None, None]  # [b, 1, t]
    weight = torch.exp((total[..., None] - decay).masked_fill(later, float("-inf")))  # [b, h, t]
    return torch.exp(total)[..., None, None] * s0 + (keys * weight[..., None]).transpose(-1, -2) @ deltas


def _projections(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The module's input projections: mixed q|k|v [b, q, C], z [b, q, h, dv], b and a [b, q, h]."""
    b, q, _ = hidden.shape
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: fused, grouped by key head
        query, key, value, z, beta, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
        mixed = torch.cat([x.reshape(b, q, -1) for x in (query, key, value)], dim=-1)
        return mixed, z, beta, a
    z = module.in_proj_z(hidden).reshape(b, q, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_forward(module: nn.Module, hidden: torch.Tensor, state: DeltaState, valid: torch.Tensor) -> torch.Tensor:
    """The layer's output [b, q, H] for its normed input hidden [b, q, H]; valid [b, q] is False
    at padding, which leaves the state as it is (leading padding only on a fresh row, trailing
    anywhere). The block stays pending in `state` until `state.commit`."""
    state.commit()
    b, q, _ = hidden.shape
    dtype = hidden.dtype
    mixed, z, beta_in, a = _projections(module, hidden)
    mixed = mixed * valid[..., None].to(mixed.dtype)
    weight = module.conv1d.weight[:, 0]  # [C, K]
    conv_in = torch.cat([state.conv, mixed.transpose(1, 2).to(weight.dtype)], dim=-1)  # [b, C, K-1+q]
    x = F.silu(_causal_conv(conv_in, weight, module.conv1d.bias)).to(dtype)  # [b, C, q]
    query, key, value = torch.split(x.transpose(1, 2), [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    h, dk, dv = module.num_v_heads, module.head_k_dim, module.head_v_dim
    query, key = query.reshape(b, q, -1, dk), key.reshape(b, q, -1, dk)
    if h // module.num_k_heads > 1:
        query = query.repeat_interleave(h // module.num_k_heads, dim=2)
        key = key.repeat_interleave(h // module.num_k_heads, dim=2)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # [b, q, h]
    padding = ~valid[:, None, :]  # [b, 1, q]: no update, no decay
    cdt = state.rec.dtype
    query, key = (_l2norm(t).transpose(1, 2).to(cdt) for t in (query, key))  # [b, h, q, dk]
    value = value.reshape(b, q, h, dv).transpose(1, 2).to(cdt)
    beta = beta_in.sigmoid().transpose(1, 2).to(cdt).masked_fill(padding, 0.0)  # [b, h, q]
    g = g.transpose(1, 2).to(cdt).masked_fill(padding, 0.0)
    query = query * dk**-0.5
    s = state.rec
    outs = []
    for start in range(0, q, CHUNK):
        if start:  # an earlier chunk of a long forward: commit it whole
            s = advance(s, keys, deltas, decay, torch.full((b,), keys.shape[2], device=s.device))
        part = slice(start, start + CHUNK)
        out, keys, deltas, decay = _chunk(s, query[:, :, part], key[:, :, part], value[:, :, part],
                                          beta[:, :, part], g[:, :, part])
        outs.append(out)
    state.rec = s
    state.pending = Pending(conv_in[:, :, start:], start, keys, deltas, decay, valid)
    core = torch.cat(outs, dim=2).transpose(1, 2).to(dtype)  # [b, q, h, dv]
    core = module.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, q, -1)
    return module.out_proj(core)


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise convolution of x [b, C, K-1+q] with weight [C, K], no padding -> [b, C, q]: K
    multiply-adds (F.conv1d's grouped path is far slower for these shapes on CPU)."""
    k = weight.shape[1]
    q = x.shape[2] - k + 1
    out = x[:, :, :q] * weight[:, :1]
    for j in range(1, k):
        out = out + x[:, :, j : j + q] * weight[:, j : j + 1]
    return out if bias is None else out + bias[:, None]


def _chunk(s0: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, beta: torch.Tensor,
           g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Outputs [b, h, t, dv] of t tokens from state s0, and their (keys, updates d, cumulative decay)."""
    t = key.shape[2]
    decay = g.cumsum(-1)  # [b, h, t]
    causal = torch.ones(t, t, dtype=torch.bool, device=key.device).tril()
    # e^{G_t - G_i} for i <= t (masked before exp: the upper triangle would overflow)
    within = torch.exp((decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")))
    from_start = torch.exp(decay)[..., None]  # [b, h, t, 1]
    rhs = beta[..., None] * (value - from_start * (key @ s0))  # [b, h, t, dv]
    lower = (beta[..., None] * (key @ key.transpose(-1, -2)) * within).tril(-1)  # [b, h, t, t]
    deltas = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    out = from_start * (query @ s0) + ((query @ key.transpose(-1, -2)) * within) @ deltas
    return out, key, deltas, decay
