"""DFlash 2's selector loss and measurements (docs/DESIGN.md section 7).

The selector re-ranks the drafter's top-K unary candidates of each block position, given the
previous token. Training teacher-forces it: the previous token is the TRUE one (the anchor for
block position 1), and the loss is a K-way cross-entropy over the candidate set scored by
S(prev, c) = U(c) + <A[prev] * (W h), B[c]>. Where the true token is not among the top K it
replaces the K-th (lowest) candidate, so the loss stays defined; the measurements still use the
real top K, which is what decoding sees. Rows are weighted by the same position decay as the
unary loss. The unary logits U(c) carry gradient, so the selector loss also shapes the backbone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


def training_candidates(top: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top [m, K] (descending), labels [m] -> (candidates [m, K] with a missing label in the last
    slot, the label's slot [m], whether the label was in the real top K [m])."""
    match = top == labels[:, None]  # [m, K]
    inside = match.any(-1)
    slot = torch.where(inside, match.long().argmax(-1), top.shape[-1] - 1)
    cands = top.clone()
    cands[:, -1] = torch.where(inside, top[:, -1], labels)
    return cands, slot, inside


@dataclass(frozen=True)
class SelectorResult:
    """sum(w * ce) of the selector (graph attached), and per row [m] (bool): the label within the
    unary top K (oracle recall) and the selector's teacher-forced choice equal to the label."""

    total: torch.Tensor
    in_top_k: torch.Tensor
    correct: torch.Tensor


def selector_loss(
    selector: torch.nn.Module,
    final_hidden: torch.Tensor,
    head_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    top: torch.Tensor,
    labels: torch.Tensor,
    prev_tokens: torch.Tensor,
    weights: torch.Tensor,
    *,
    token_ids: torch.Tensor | None = None,
    output_multiplier: float = 1.0,
) -> SelectorResult:
    """The selector loss of m block positions.

    final_hidden [m, H]: the drafter's final normalised hidden states (what the selector reads);
    head_hidden [m, H]: the same in the head's dtype; head_weight [V', H] / head_bias [V']: the
    frozen head rows the unary logits come from; top [m, K]: the unary top K (row indices of
    head_weight); labels [m]: the true token as a row index; prev_tokens [m]: the true previous
    token ids; weights [m]: position decay (0: not counted). token_ids [V']: the token id of each
    head row when the head is restricted to some tokens (None: row index == token id).
    """
    cands, slot, inside = training_candidates(top, labels)  # [m, K], [m], [m]
    rows = head_weight[cands]  # [m, K, H]
    unary = torch.einsum("mh,mkh->mk", head_hidden.to(rows.dtype), rows).float()  # [m, K], with grad
    if head_bias is not None:
        unary = unary + head_bias[cands].float()
    unary = unary * output_multiplier
    cand_tokens = cands if token_ids is None else token_ids[cands]
    final_hidden = final_hidden.to(selector.hidden_projection.weight.dtype)
    scores = unary + selector.transitions(final_hidden, prev_tokens, cand_tokens)  # [m, K]
    ce = F.cross_entropy(scores, slot, reduction="none")  # [m]
    total = (ce * weights).sum()
    # an empty batch still reaches every selector weight, so data-parallel gradient sums line up
    total = total + sum(p.sum() for p in selector.parameters()) * 0.0
    with torch.no_grad():
        # what decoding picks given the true predecessor; where the label is inside the real top
        # K the candidates are exactly those, elsewhere decoding cannot propose it
        pick = cands.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
        correct = inside & (pick == labels)
    return SelectorResult(total, inside, correct)
