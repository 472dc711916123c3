"""The DFlash training loss: position-decayed cross-entropy over packed blocks (docs/DESIGN.md s. 7).

Block position k (1..B-1) predicts token[p + k]; its weight is w_k = exp(-(k - 1) / gamma), so
early positions, which decide most of the acceptance length, count most. The loss of a batch is
sum(w * ce) / sum(w) over all valid (assistant-token) labels of all its blocks.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

# gamma per block size as published; other sizes interpolate linearly between the known ones.
_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """The published decay constant for a block size (7 for 16, 5 for 10, 4 for 8)."""
    if block_size in _GAMMA:
        return _GAMMA[block_size]
    keys = sorted(_GAMMA)
    if block_size < keys[0]:
        return max(1.0, _GAMMA[keys[0]] * block_size / keys[0])
    if block_size > keys[-1]:
        return _GAMMA[keys[-1]] * block_size / keys[-1]
    lo = max(k for k in keys if k < block_size)
    hi = min(k for k in keys if k > block_size)
    t = (block_size - lo) / (hi - lo)
    return _GAMMA[lo] + t * (_GAMMA[hi] - _GAMMA[lo])


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k for k = 1..B-1 [B-1]: exp(-(k - 1) / gamma)."""
    g = default_gamma(block_size) if gamma is None else float(gamma)
    if not g > 0 or not math.isfinite(g):
        raise ValueError(f"gamma must be a positive number, got {gamma!r}")
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / g)


def weighted_block_ce(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of w * ce and the per-row ce, for rows that count.

    logits [m, V], labels [m], weights [m] (0 for labels that do not count) -> (sum(w*ce), ce [m]).
    Callers divide by sum(w) themselves so that sharded batches can use the global sum.
    """
    ce = F.cross_entropy(logits.float(), labels, reduction="none")  # [m]
    return (ce * weights).sum(), ce


def block_loss(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float | None = None
) -> torch.Tensor:
    """Loss of one set of blocks: logits [n, B-1, V], labels/valid [n, B-1] -> scalar.

    Reference form of the published loss (sum(w*ce)/sum(w)); the trainer computes the same thing
    on valid rows only, in chunks.
    """
    n, km1, vocab = logits.shape
    w = position_weights(km1 + 1, gamma).to(logits.device)[None, :].expand(n, km1) * valid.float()
    total, _ = weighted_block_ce(logits.reshape(-1, vocab), labels.reshape(-1), w.reshape(-1))
    return total / w.sum().clamp_min(1e-12)


def soft_block_ce(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, teacher: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Reference form of the distillation loss: sum(w * ce(t, softmax(logits))) with the label
    distribution t = alpha * teacher + (1 - alpha) * onehot(label).

    logits, teacher [m, V] (teacher: probabilities), labels, weights [m] -> scalar.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    t = alpha * teacher.float()
    t[torch.arange(labels.shape[0]), labels] += 1.0 - alpha
    return (-(t * logp).sum(-1) * weights).sum()


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mult: float) -> torch.Tensor:
    """(hidden @ weight^T + bias) * mult [m, V] in fp32: the logits the loss reads, the drafter's
    and (train/teacher.py) the target's alike."""
    logits = (hidden.to(weight.dtype) @ weight.t()).float()
    if bias is not None:
        logits += bias.float()
    if mult != 1.0:
        logits *= mult
    return logits


class _FusedHeadCE(torch.autograd.Function):
    """sum(w * ce(h @ W^T (+ b) times mult)) without keeping the [m, V] logits for backward.

    The head is frozen, so the only gradient needed is d/dh, which is computed chunk by chunk in
    the forward pass (softmax - t) @ W: the same two matmuls an unfused forward + backward does,
    but peak memory is one chunk of logits instead of all of them. t is onehot(label), or with
    a teacher alpha * teacher[row] + (1 - alpha) * onehot(label).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, mult, chunk, stats,  # noqa: D102
                teacher, teacher_rows, alpha, top_k):
        total = hidden.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        top = torch.empty(hidden.shape[0], top_k, dtype=torch.long, device=hidden.device) if top_k else None
        for a in range(0, hidden.shape[0], chunk):
            h = hidden[a : a + chunk]
            logits = head_logits(h, weight, bias, mult)  # [c, V]
            lab, w = labels[a : a + chunk], weights[a : a + chunk]
            correct[a : a + chunk] = logits.argmax(-1) == lab
            if top is not None:  # DFlash 2's candidate sets, while the chunk's logits exist anyway
                top[a : a + chunk] = logits.topk(top_k, dim=-1).indices
            lse = torch.logsumexp(logits, dim=-1)  # [c]
            ce = lse - logits.gather(1, lab[:, None])[:, 0]
            soft = None
            if teacher is not None:
                soft = teacher[teacher_rows[a : a + chunk]]  # [c, V]
                ce = (1.0 - alpha) * ce + alpha * (lse - (soft * logits).sum(-1))
            total += (ce * w).sum()
            if grad is not None:
                probs = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place
                if soft is not None:
                    probs.sub_(soft, alpha=alpha)
                probs[torch.arange(lab.shape[0], device=lab.device), lab] -= 1.0 - alpha
                probs *= (w * mult)[:, None]
                grad[a : a + chunk] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad if grad is not None else hidden.new_zeros(0))
        stats["correct"] = correct
        stats["top"] = top
        return total

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype),) + (None,) * 11


def fused_head_ce(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    output_multiplier: float = 1.0,
    chunk: int = 1024,
    teacher: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
    alpha: float = 0.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum(w * ce) of the frozen linear head on hidden [m, H] and whether argmax == label [m];
    with top_k > 0 also the head rows of the top_k largest logits of each row [m, top_k]
    (descending; DFlash 2's candidates).

    Exactly the cross-entropy of `head(hidden) * output_multiplier` over the head's rows. With a
    teacher (probabilities [U, V] over the same rows, teacher_rows [m] picking each row's) and
    alpha in (0, 1], the label is the mixture of soft_block_ce.
    """
    if teacher is not None and (teacher_rows is None or teacher.shape[-1] != head.weight.shape[0]):
        raise ValueError("teacher needs teacher_rows and one probability per head row")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if teacher is None or alpha == 0.0:
        teacher, teacher_rows, alpha = None, None, 0.0
    stats: dict = {}
    bias = getattr(head, "bias", None)
    total = _FusedHeadCE.apply(
        hidden, head.weight.detach(), None if bias is None else bias.detach(), labels, weights.float(),
        float(output_multiplier), int(chunk), stats, teacher, teacher_rows, float(alpha), int(top_k),
    )
    if top_k:
        return total, stats["correct"], stats["top"]
    return total, stats["correct"]
