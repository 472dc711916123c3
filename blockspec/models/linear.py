"""The projections of the native models, with a faster CPU path for a few rows.

`linear(x, w, b)` equals `F.linear(x, w, b)` up to float rounding. On a CPU, for 2..SMALL_ROWS
rows it computes `(w @ x^T)^T` instead: MKL then streams the [out, in] weight once past the few
columns of x, where linear's GEMM runs a compute kernel that, on the 2-core AVX2 machine this was
developed on, made 2 rows cost twice 1 row. There, the projections of a SmolLM2-135M-sized stack
took 19 ms instead of 46-49 ms for 2-4 rows and 40 ms instead of 52 ms for 16, so verifying a
short block costs about what one token does; speculative decoding on a CPU lives on that.
`python -m blockspec.engine.stepcost --small-rows 1` turns the path off for a comparison
(BENCHMARKS.md, session 4). GPUs keep `F.linear` (cuBLAS picks its kernel by shape).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SMALL_ROWS = 64  # measured equal or faster up to 64 rows; beyond, the two paths are level


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T + bias -> [..., out] (see the module docstring)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not 1 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    # MKL takes the fast path only when x^T is a transposed view of a row-major x (a column-major
    # x, e.g. an earlier output of this function, would make x^T contiguous: the slow path).
    x2d = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, in]
    out = (weight @ x2d.t()).t()  # [rows, out], a transposed view
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for an nn.Linear, through `linear`."""
    return linear(x, module.weight, module.bias)
