"""The k most likely tokens of each row of draft logits, with their log-softmax, in one defined
order: larger logit first, the lower id first on equal logits (`cpu/csrc/topk.c` on a CPU, the
PyTorch path below elsewhere or with BLOCKSPEC_CPU_KERNELS=0: the same ids either way).

A defined tie order is what lets a step read its greedy chain from the top-k's first column
(`cpu/argmax.py` breaks ties towards the lower id too); torch.topk's tie order is unspecified.
Which draft wins a tie never changes the output, only what is proposed.
"""

from __future__ import annotations

import torch

from blockspec.cpu import kernels


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [.., V] (k <= V) -> (log-softmax of the k largest [.., k] float32, descending; their
    ids [.., k] int64), ordered as the module docstring says."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top-k needs 1 <= k <= {logits.shape[-1]} (the vocabulary), got k={k}")
    fast = kernels.top_k(logits, k) if logits.is_cpu else None
    return fast if fast is not None else reference_top_logprobs(logits, k)


def reference_top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_logprobs` through PyTorch's operators (what the kernel is tested against)."""
    x = logits.float()
    n = x.shape[-1]
    vals, ids = x.topk(min(k + 1, n), dim=-1)  # [.., k+1], descending
    # torch.topk orders equal logits as it likes: where any of the first k + 1 tie, a stable sort
    # (the lower id first among equals) decides, which the rare tie alone pays for
    if bool((vals[..., 1:] == vals[..., :-1]).any()):
        vals, ids = x.sort(dim=-1, descending=True, stable=True)
    vals, ids = vals[..., :k], ids[..., :k]
    return vals - x.logsumexp(dim=-1, keepdim=True), ids


__all__ = ["reference_top_logprobs", "top_logprobs"]
