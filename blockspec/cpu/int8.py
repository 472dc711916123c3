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
only what its user asked for).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.cpu import kernels
from blockspec.cpu.packed_weights import BLOCK, PackedWeight, QuantisedRows, identity

LANES = 16  # fp32 lanes of the kernel's sums: 8 per block, blocks in pairs
_CHUNK = 4096  # weight rows per step of the PyTorch emulation (bounds its scratch memory)


@dataclass(frozen=True)
class Int8Weight(QuantisedRows):
    """A [out, in] matrix as the integer kernels read it. bits 4: qs [out, in / 2] uint8 (GGUF
    Q4_1's nibbles, cpu/packed_weights.py's layout), weight m + d q; bits 8: qs [out, in] int8,
    weight d q. d [out, in / 32] fp32; m [out, nbp] fp32 (bits 4; nbp = in / 32 rounded up to 16,
    zero padded), else None. `source`: the model weight's identity when made (packed_weights.identity)."""

    bits: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    source: tuple[int, int]
    exact: bool = field(default=True)  # whether the weights are the model's own values (from a GGUF's form)

    def __post_init__(self) -> None:
        out, width = self.qs.shape
        n_in = width * 2 if self.bits == 4 else width
        nb = n_in // BLOCK
        ok = (self.bits in (4, 8) and self.qs.dtype == (torch.uint8 if self.bits == 4 else torch.int8)
              and self.qs.is_contiguous() and self.d.dtype == torch.float32 and self.d.shape == (out, nb)
              and self.d.is_contiguous() and n_in % BLOCK == 0)
        if self.bits == 4:
            ok = ok and self.m is not None and self.m.shape == (out, _padded(nb)) and self.m.is_contiguous()
        if not ok:
            raise ValueError(f"an Int8Weight needs bits 4 (qs uint8 [out, in / 2], m [out, nbp]) or 8 (qs int8 "
                             f"[out, in]) with d fp32 [out, in / 32], in a multiple of {BLOCK}; got bits={self.bits}, "
                             f"qs {self.qs.dtype} {tuple(self.qs.shape)}, d {tuple(self.d.shape)}")

    def levels(self) -> torch.Tensor:
        """The integer weights [out, in] (4-bit levels 0..15, or the signed 8-bit values), int16."""
        out, n_in = self.shape
        if self.bits == 8:
            return self.qs.to(torch.int16)
        q = self.qs.view(out, -1, 16)
        return torch.cat([q & 15, q >> 4], dim=-1).reshape(out, n_in).to(torch.int16)


def _padded(nb: int) -> int:
    return (nb + LANES - 1) // LANES * LANES


def from_packed(packed: PackedWeight) -> Int8Weight | None:
    """The integer form of an fp32 matrix packed from a GGUF's Q4_1 / Q8_0 values (the same
    levels and scales), or None for a bf16 model's packed copy."""
    if packed.dtype != torch.float32:
        return None
    out, n_in = packed.shape
    nb = n_in // BLOCK
    d = packed.sc[..., 0].contiguous()
    m = None
    if packed.bits == 4:
        m = torch.zeros(out, _padded(nb))
        m[:, :nb] = packed.sc[..., 1]
    return Int8Weight(packed.bits, packed.qs, d, m, packed.source)


def quantize_weight(weight: torch.Tensor) -> Int8Weight | None:
    """An fp32 [out, in] CPU matrix in Q8_0's form (per block of 32: d = max |w| / 127, q = w / d
    rounded), for a model without GGUF values asked to run in int8; None where `in` is not a
    multiple of 32 or the weight is not fp32 on the CPU."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu" or weight.shape[1] % BLOCK:
        return None
    q, d, _ = quantize_rows(weight.detach())
    return Int8Weight(8, q.to(torch.int8).contiguous(), d.contiguous(), None, identity(weight), exact=False)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, in] fp32 -> (q [n, in] fp32 integers in [-127, 127], d [n, in / 32], s [n, in / 32]):
    int8.c's quantisation (d = max |x| / 127 per block, q = x / d rounded half to even, s = d * sum q)."""
    n, k = x.shape
    xb = x.reshape(n, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, (xb / d[..., None]).round().clamp(-127, 127), torch.zeros(()))
    return q.reshape(n, k), d, d * q.sum(-1)


def _reduce16(acc: torch.Tensor) -> torch.Tensor:
    """vec.h's reduce16 over the last dimension (16): (a + a[8:]) folded to 4, (c0 + c2) + (c1 + c3)."""
    b = acc[..., :8] + acc[..., 8:]
    c = b[..., :4] + b[..., 4:]
    return (c[..., 0] + c[..., 2]) + (c[..., 1] + c[..., 3])


def reference_product(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """int8.c's product in PyTorch, bit for bit: x [..., in] fp32 -> [..., out] (+ bias, then
    residual + that)."""
    out_dim, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float()
    n, nb = x2.shape[0], k // BLOCK
    q, dx, sx = quantize_rows(x2)
    steps = (nb + 1) // 2
    qg = q.double().view(n, k // 4, 4)
    y = torch.empty(n, out_dim)
    for lo in range(0, out_dim, _CHUNK):
        hi = min(out_dim, lo + _CHUNK)
        wl = w.levels()[lo:hi].double().view(hi - lo, k // 4, 4)
        lanes = torch.einsum("ngt,ogt->nog", qg, wl).float()  # [n, o, in / 4]: exact integer sums of 4
        scale = w.d[None, lo:hi] * dx[:, None]  # [n, o, nb]
        t = scale.repeat_interleave(8, dim=-1) * lanes  # [n, o, nb * 8]
        if nb % 2:
            t = torch.cat([t, t.new_zeros(n, hi - lo, 8)], dim=-1)
        t = t.view(n, hi - lo, steps, LANES)
        acc = torch.zeros(n, hi - lo, LANES)
        for p in range(steps):
            acc = acc + t[:, :, p]
        dot = _reduce16(acc)
        if w.bits == 4:
            nbp = w.m.shape[1]
            s = torch.zeros(n, nbp)
            s[:, :nb] = sx
            prods = (w.m[None, lo:hi] * s[:, None]).view(n, hi - lo, nbp // LANES, LANES)
            ms = torch.zeros(n, hi - lo, LANES)
            for i in range(nbp // LANES):
                ms = ms + prods[:, :, i]
            dot = dot + _reduce16(ms)
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
