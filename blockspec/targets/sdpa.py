"""PyTorch's scaled dot-product attention, kept off the cuDNN backend on CUDA.

PyTorch picks cuDNN's fused attention for bf16 on Hopper GPUs. That backend builds an execution
plan for each new key length, and a decode step's key length grows by one every step, so every
call rebuilds the plan on the CPU, which costs many times the kernel itself (docs/DESIGN.md
section 12, "CUDA check"). Flash and memory-efficient attention have no such plan, so CUDA calls
allow those two (and the math fallback) only. On a CPU this is `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, **kwargs)`, on CUDA without cuDNN's backend."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(list(CUDA_BACKENDS)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
