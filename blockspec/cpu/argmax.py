"""Argmax over logits on a CPU through `cpu/csrc/peak.c`: greedy ids alone, or with the softmax
probability at them (a draft's confidence). PyTorch's argmax was a visible share of a draft
head's and a batch's greedy check's time (docs/DESIGN.md section 12); the kernel reads each row
once."""

from __future__ import annotations

import torch

from blockspec.cpu import kernels


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension [..] (the first of tied maxima, as `torch.argmax`)."""
    fast = kernels.argmax(logits) if logits.is_cpu else None
    return fast if fast is not None else logits.argmax(dim=-1)


def argmax_and_peak(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [.., V] (fp32 or bf16) -> (argmax [..], softmax probability of it [..], float32).

    On a CPU through `cpu/csrc/peak.c` (two passes over each row, against PyTorch's several
    operators). Elsewhere `max` gives the argmax (the first of tied maxima, as
    `argmax`) in one pass, and the peak's probability is exp(peak - logsumexp), in place on an
    fp32 copy.
    """
    fast = kernels.argmax_peak(logits) if logits.is_cpu else None
    if fast is not None:
        return fast
    logits = logits.to(torch.float32, copy=True)  # the caller's logits stay as they are
    peak, top = logits.max(dim=-1, keepdim=True)  # [.., 1]
    conf = 1.0 / logits.sub_(peak).exp_().sum(dim=-1)
    return top[..., 0], conf
