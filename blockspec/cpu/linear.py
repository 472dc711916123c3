"""The projections of the native models, with faster CPU kernels than `F.linear`'s.

`linear(x, w, b)` equals `F.linear(x, w, b)` up to float rounding. On a CPU, `F.linear` runs
MKL's GEMM, whose kernels for a handful of rows are poor (figures: docs/DESIGN.md section 12).
Faster paths:

- "native" (the default; where no C compiler builds the kernel it acts as "onednn"): fp32 and
  bf16 products of 1..`kernels.max_rows(dtype)` rows (fp32: 128 with AVX-512, 8 elsewhere;
  bf16: any number, so bf16 targets stay lossless) run cpu/csrc/rows.c
  (cpu/kernels.py), which streams the weights once and is batch invariant, and is faster than
  oneDNN for one-token forwards, for forwards of a few verified tokens (its register tiles) and
  for a bf16 drafter's pass. A drafter's products (`exact=False`: they
  only propose tokens, so they need no batch invariance) go there only up to the row count the
  kernel is faster for (bf16: 96 with AVX512_BF16, 8 without).
  Everything else goes the "onednn" way.
- "onednn": oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the kernel `torch.compile`
  emits for CPU linears) on the dense [out, in] weight: faster than MKL for one row of the LM
  head and for 16-128 rows.
- "small-rows": for 2..SMALL_ROWS rows, `(w @ x^T)^T`, which makes MKL stream the weight past
  the few columns of x; the fallback where oneDNN is missing.

All run only without autograd (inference); training keeps `F.linear`. GPUs keep `F.linear`
(cuBLAS picks its kernel by shape). `python -m blockspec.bench.stepcost --cpu-matmul KIND`
compares them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.cpu import kernels
from blockspec.cpu.onednn_cache import bound_caches
from blockspec.cpu.packed_weights import packed_linear

bound_caches()  # before this module's first oneDNN product (onednn_available below): read once

SMALL_ROWS = 64  # small-rows path: measured equal or faster up to 64 rows; beyond, level with F.linear
MKL_ROWS: frozenset[int] = frozenset({2, 3, 4})  # fp32 only: in bf16, oneDNN wins here too (measured)
CPU_MATMULS = ("native", "onednn", "small-rows", "mkl")
_ONEDNN_KINDS = ("native", "onednn")  # the kinds that send what they do not handle themselves to oneDNN
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """Whether this PyTorch build runs oneDNN's linear on the CPU (and agrees with F.linear)."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # one tiny product proves the op runs and agrees with F.linear on this build
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        return bool(torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-5))
    except RuntimeError:
        return False


CPU_MATMUL = "native" if onednn_available() else "small-rows"  # native falls back to onednn


def cpu_bf16_matmul() -> bool:
    """Whether oneDNN runs bf16 products on this CPU (then a bf16 drafter streams half the bytes
    of an fp32 one, and decodes faster at batch 1)."""
    try:
        return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def set_cpu_matmul(kind: str) -> str:
    """Selects the CPU kernel of `linear` (one of CPU_MATMULS); returns the previous one."""
    global CPU_MATMUL
    if kind not in CPU_MATMULS:
        raise ValueError(f"cpu matmul must be one of {', '.join(CPU_MATMULS)}, got {kind!r}")
    if kind in _ONEDNN_KINDS and not onednn_available():
        raise ValueError(f"this PyTorch build has no usable oneDNN linear (which {kind!r} relies on); "
                         "choose 'small-rows' or 'mkl'")
    previous, CPU_MATMUL = CPU_MATMUL, kind
    return previous


def fast_cpu_single_row() -> bool:
    """Whether `linear` is already the fastest one-row product on this CPU (so the native target
    needs no transposed copies of its weights for one-token forwards)."""
    return CPU_MATMUL in _ONEDNN_KINDS


def onednn_takes(rows: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether `linear` sends a CPU product of `rows` rows to oneDNN (no autograd)."""
    if CPU_MATMUL not in _ONEDNN_KINDS or x_dtype not in _ONEDNN_DTYPES or w_dtype != x_dtype:
        return False
    return x_dtype != torch.float32 or rows not in MKL_ROWS


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, exact: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T + bias -> [..., out] (see the module docstring).

    exact=False: the product need not be batch invariant (a drafter's, whose outputs are only
    proposals); a bf16 product then takes whichever kernel is faster for its row count.
    residual: returns `residual + product` (a residual connection), the same bits as adding it
    afterwards; the native kernel adds it in the same call.
    """
    autograd = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if CPU_MATMUL == "native" and not autograd:  # the decoding path, first and lean
        out = kernels.rows_linear(x, weight, bias, exact, residual)
        if out is not None:
            return out
    out = _linear(x, weight, bias, autograd)
    return out if residual is None else residual + out


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, autograd: bool) -> torch.Tensor:
    """`linear` through PyTorch's kernels (cpu/linear.py's choice among them)."""
    if x.device.type != "cpu" or CPU_MATMUL == "mkl" or autograd:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if onednn_takes(rows, x.dtype, weight.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if not 1 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    # MKL takes the fast path only when x^T is a transposed view of a row-major x (a column-major
    # x, e.g. an earlier output of this function, would make x^T contiguous: the slow path).
    x2d = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, in]
    out = (weight @ x2d.t()).t()  # [rows, out], a transposed view
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project(module: nn.Linear, x: torch.Tensor, *, exact: bool = True,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """`module(x)` for an nn.Linear (plus `residual`), through `linear`; from the module's packed
    copy (cpu/packed_weights.py: the same bits from fewer bytes) where it has one."""
    packed = module.__dict__.get("packed")  # not getattr: nn.Module's miss path is slow, and most modules miss
    if packed is not None and CPU_MATMUL == "native" and packed.matches(module.weight):
        out = packed_linear(x, packed, module.bias, residual)
        if out is not None:
            return out
    return linear(x, module.weight, module.bias, exact=exact, residual=residual)
