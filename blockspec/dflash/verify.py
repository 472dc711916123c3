"""Pure accept/reject rules of speculative decoding. No model, no state, no randomness of its own.

Terms, used the same way everywhere:
- a step verifies q = m + 1 block positions: the last committed token and m proposals;
- `accepted` (0..m) counts leading proposals the target agrees with;
- the `bonus` token comes from the target at the first disagreement (or after the last proposal);
- the step commits accepted + 1 tokens, its acceptance length tau.
"""

from __future__ import annotations

import torch

from blockspec.cpu.argmax import greedy_ids


def verify_greedy(
    proposals: torch.Tensor, target_logits: torch.Tensor, limit: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """proposals [b, m], target_logits [b, m+1, V] -> accepted [b], bonus [b].

    Proposal i is accepted while it equals the target's argmax at the position before it.
    `limit` [b]: row r verifies only its first limit[r] proposals (a ragged step); the target's
    logits past them are never read, so they may be anything.
    """
    return accept_greedy(proposals, greedy_ids(target_logits), limit)


def accept_greedy(
    proposals: torch.Tensor, best: torch.Tensor, limit: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_greedy` from the target's greedy ids best [b, m+1] (the argmax of its logits at
    each block position) instead of the logits. Ids past a row's `limit` are never read."""
    m = proposals.shape[1]
    match = (proposals == best[:, :m]).to(torch.long)
    if limit is not None:
        match = match * _within(limit, m)
    accepted = match.cumprod(dim=1).sum(dim=1)  # [b]
    bonus = best.gather(1, accepted[:, None])[:, 0]
    return accepted, bonus


def _within(limit: torch.Tensor, m: int) -> torch.Tensor:
    """[b, m] long: 1 for the proposals each row verifies (the first limit[r])."""
    return (torch.arange(m, device=limit.device)[None] < limit[:, None]).to(torch.long)
