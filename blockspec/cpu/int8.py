"""The int8 compute mode's products: activations quantised to 8 bits per row and block of 32
inputs, against 4- or 8-bit weights, the block sums taken in integers (cpu/csrc/int8.c).

The arithmetic is defined in int8.c's header; `reference_product` is the same arithmetic in
PyTorch, bit for bit, which the tests compare the kernel with and which runs in its place where
no kernel is built (BLOCKSPEC_CPU_KERNELS=0: slow, the same numbers). Like the exact mode's
kernels, every output depends on its own row only, in a fixed order: batch invariant, so
speculative decoding in this mode equals this mode's own plain decoding.

Weights: a matrix a Q4_1 / Q8_0 GGUF left (cpu/packed_weights.py's PackedWeight) is multiplied as
its GGUF levels and scales, so its weights are exactly the exact mode's; any other fp32 matrix is
quantised to Q8_0's form here (`quantize_weight`), which changes its values (the mode is then
only what its user asked for). Scales are held as fp16 numbers, as a GGUF holds them: a one-row
product is bound by the memory, and fp32 scales made a 4-bit weight 0.75 bytes against 0.625.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.cpu import kernels
from blockspec.cpu.packed_weights import BLOCK, PackedWeight, QuantisedRows, identity, nibbles

GROUP = 16  # weight rows interleaved per group (int8.c's layout): one fp32 lane of the kernel each
_CHUNK = 4096  # weight rows per step of the PyTorch emulation (bounds its scratch memory)


@dataclass(frozen=True)
class Int8Weight(QuantisedRows):
    """A [out, in] matrix as the integer kernels read it (int8.c's layout): rows in groups of 16
    (G = out / 16 rounded up, zero padded), block by block. bits 4: qs [G, nb, 256] uint8 (GGUF
    Q4_1's nibbles, 4 bytes of each of 16 rows in turn), weight m + d q; bits 8: qs [G, nb, 512]
    int8 (4 values of each of 16 rows in turn), weight d q. d [G, nb, 16] fp16 (nb = in / 32);
    m [G, nb, 16] fp16 (bits 4), else None. `source`: the model weight's identity when made
    (packed_weights.identity)."""

    bits: int
    out: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    source: tuple[int, int]
    exact: bool = field(default=True)  # whether the weights are the model's own values (from a GGUF's form)

    def __post_init__(self) -> None:
        groups = -(-self.out // GROUP)
        nb = self.d.shape[1] if self.d.dim() == 3 else -1
        ok = (self.bits in (4, 8) and self.out > 0 and self.qs.dtype == (torch.uint8 if self.bits == 4 else torch.int8)
              and self.qs.shape == (groups, nb, GROUP * BLOCK * self.bits // 8) and self.qs.is_contiguous()
              and self.d.dtype == torch.float16 and self.d.shape == (groups, nb, GROUP) and self.d.is_contiguous())
        if self.bits == 4:
            ok = ok and self.m is not None and self.m.shape == self.d.shape and self.m.dtype == torch.float16 \
                and self.m.is_contiguous()
        if not ok:
            raise ValueError(f"an Int8Weight needs bits 4 (qs uint8 [G, nb, 256], m fp16 [G, nb, 16]) or 8 (qs int8 "
                             f"[G, nb, 512]) with d fp16 [G, nb, 16], G = out / 16 rounded up; got bits={self.bits}, "
                             f"out={self.out}, qs {self.qs.dtype} {tuple(self.qs.shape)}, d {tuple(self.d.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.out, self.d.shape[1] * BLOCK

    def levels(self) -> torch.Tensor:
        """The integer weights [out, in] (4-bit levels 0..15, or the signed 8-bit values), int16."""
        out, n_in = self.shape
        groups, nb = self.d.shape[:2]
        per = self.qs.shape[2] // GROUP  # bytes of a row's block: 16 (4 bits) or 32
        q = self.qs.view(groups, nb, per // 4, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(groups * GROUP, nb, per)[:out]
        if self.bits == 4:
            q = torch.cat([q & 15, q >> 4], dim=-1)
        return q.reshape(out, n_in).to(torch.int16)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(d [out, nb], m [out, nb] or None) fp32: each block's scale and (4 bits) minimum."""
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(-1, t.shape[1])[: self.out].float()
        return rows(self.d), None if self.m is None else rows(self.m)


def interleave(bits: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, source: tuple[int, int],
               exact: bool = True) -> Int8Weight:
    """An Int8Weight from row-major values: qs [out, in / 2] uint8 (bits 4, GGUF Q4's byte order)
    or [out, in] int8 (bits 8), d and m [out, in / 32] (m for bits 4 only), each an fp16 number
    (`fp16_exact`; ValueError otherwise)."""
    if not all(fp16_exact(t) for t in (d, m) if t is not None):
        raise ValueError("an Int8Weight's scales must be fp16 numbers (int8.c reads them as fp16)")
    out, nb = d.shape
    groups = -(-out // GROUP)
    pad = groups * GROUP - out

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [out, ...] -> [G, 16, ...], zero padded
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return t.view(groups, GROUP, *t.shape[1:])

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [out, nb] -> [G, nb, 16]
        return grouped(t.half()).permute(0, 2, 1).contiguous()

    per = qs.shape[1] // nb  # bytes of a row's block: 16 (4 bits) or 32
    words = qs.contiguous().view(torch.int32).view(out, nb, per // 4)  # 4 bytes of a row moved as one
    q = grouped(words).permute(0, 2, 3, 1).contiguous().view(qs.dtype).view(groups, nb, per * GROUP)
    return Int8Weight(bits, out, q, lanes(d), None if m is None else lanes(m), source, exact)


def fp16_exact(t: torch.Tensor) -> bool:
    """Whether every value of `t` is an fp16 number (so fp16 storage keeps it exactly)."""
    return bool(torch.equal(t.half().to(t.dtype), t))


def from_packed(packed: PackedWeight) -> Int8Weight | None:
    """The integer form of an fp32 matrix packed from a GGUF's Q4_1 / Q8_0 values (the same
    levels and scales), or None for a bf16 model's packed copy or a 4-bit form whose block minima
    are not fp16 numbers (GGUF's are; a matrix packed from other values may not be)."""
    if packed.dtype != torch.float32 or not fp16_exact(packed.sc):
        return None
    return interleave(packed.bits, packed.qs, packed.sc[..., 0], packed.sc[..., 1] if packed.bits == 4 else None,
                      packed.source)


def quantize_weight(weight: torch.Tensor, bits: int = 8) -> Int8Weight | None:
    """An fp32 [out, in] CPU matrix in Q8_0's form (per block of 32: d = max |w| / 127 rounded to
    fp16, as Q8_0 stores it, q = w / d rounded and clamped to [-127, 127]), or with bits 4 in
    Q4_1's (per block: m = min w and d = (max w - m) / 15, each rounded to fp16, q = (w - m) / d
    rounded and clamped to [0, 15]: 0.625 bytes a weight against 1.0625, for weights whose
    products may be lossier, a drafter's), for a model without GGUF values asked to run in int8; None where `in` is not
    a multiple of 32, the weight is not fp32 on the CPU, or a scale is past fp16's range."""
    if bits not in (4, 8):
        raise ValueError(f"a quantised weight has 4 or 8 bits, got {bits}")
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu" or weight.shape[1] % BLOCK:
        return None
    out, n_in = weight.shape
    wb = weight.detach().reshape(out, n_in // BLOCK, BLOCK)
    if bits == 8:
        d = (wb.abs().amax(-1) / 127).half().float()  # [out, nb]
        if not bool(torch.isfinite(d).all()):
            return None
        return interleave(8, _levels(wb, d).reshape(out, n_in).to(torch.int8), d, None, identity(weight), exact=False)
    m = wb.amin(-1).half().float()  # [out, nb]
    d = ((wb.amax(-1) - m) / 15).half().float()
    if not bool(torch.isfinite(d).all() and torch.isfinite(m).all()):
        return None
    return interleave(4, nibbles(_levels(wb - m[..., None], d, 0, 15)), d, m, identity(weight), exact=False)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, in] fp32 -> (q [n, in] fp32 integers in [-127, 127], d [n, in / 32], s [n, in / 32]):
    int8.c's quantisation (d = max |x| / 127 per block, q = x / d rounded half to even, s = d * sum q)."""
    n, k = x.shape
    xb = x.reshape(n, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127
    q = _levels(xb, d)
    return q.reshape(n, k), d, d * q.sum(-1)


def _levels(xb: torch.Tensor, d: torch.Tensor, lowest: int = -127, highest: int = 127) -> torch.Tensor:
    """Blocks xb [.., nb, 32] in steps of d [.., nb]: x / d rounded half to even, clamped to
    [lowest, highest], 0 where d is 0 (fp32 integers)."""
    return torch.where(d[..., None] > 0, (xb / d[..., None]).round().clamp(lowest, highest), torch.zeros(()))


def _in_order(t: torch.Tensor) -> torch.Tensor:
    """((0 + t[..., 0]) + t[..., 1]) + ... over the last dimension, one rounding per addition."""
    acc = torch.zeros(t.shape[:-1])
    for b in range(t.shape[-1]):
        acc = acc + t[..., b]
    return acc


def reference_product(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """int8.c's product in PyTorch, bit for bit: x [..., in] fp32 -> [..., out] (+ bias, then
    residual + that)."""
    out_dim, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float()
    n, nb = x2.shape[0], k // BLOCK
    q, dx, sx = quantize_rows(x2)
    qb = q.double().view(n, nb, BLOCK)
    levels = w.levels()
    wd, wm = w.scales()
    y = torch.empty(n, out_dim)
    for lo in range(0, out_dim, _CHUNK):
        hi = min(out_dim, lo + _CHUNK)
        wl = levels[lo:hi].double().view(hi - lo, nb, BLOCK)
        sums = torch.einsum("nbt,obt->nob", qb, wl).float()  # [n, o, nb]: exact integers (|sum| < 2^20)
        dot = _in_order((wd[None, lo:hi] * dx[:, None]) * sums)
        if wm is not None:
            dot = dot + _in_order(wm[None, lo:hi] * sx[:, None])
        y[:, lo:hi] = dot
    if bias is not None:
        y = y + bias.float()
    y = y.view(*lead, out_dim)
    return y if residual is None else residual + y


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] fp32 (CPU) times `w` (+ bias, + residual) -> [..., out]: the kernel's product, or
    where no kernel is built its PyTorch emulation (the same bits)."""
    fn = kernels.kernel()
    if fn is None:
        return reference_product(x, w, bias, residual)
    out_dim, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {k}")
    x = x if x.is_contiguous() and x.dtype == torch.float32 else x.float().contiguous()
    shape = (*x.shape[:-1], out_dim)
    y = torch.empty(shape)
    fused = residual is not None and residual.dtype == torch.float32 and residual.shape == shape \
        and residual.is_contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    rc = fn.int8[w.bits](x.data_ptr(), w.qs.data_ptr(), w.d.data_ptr(), 0 if w.m is None else w.m.data_ptr(),
                         None if bias is None else bias.data_ptr(), residual.data_ptr() if fused else None,
                         y.data_ptr(), x.numel() // k, k, out_dim, torch.get_num_threads())
    if rc:
        raise MemoryError("the int8 kernel could not allocate its quantised rows")
    return y if residual is None or fused else residual + y


def int8_path() -> str:
    """Which integer dot products run here: "vnni" (AVX-512 VNNI), "avx2", "c" (plain C), or
    "pytorch" (no kernel built: the emulation)."""
    fn = kernels.kernel()
    return "pytorch" if fn is None else fn.int8_path
