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
from blockspec.dflash.sampling import sample_from


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


def verify_sampled(
    proposals: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
    limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling.

    proposals [b, m] drawn from draft_probs [b, m, V]; target_probs [b, m+1, V];
    accept_uniforms [b, m] and bonus_uniforms [b] in [0, 1). Proposal x is accepted with
    probability min(1, p(x) / q(x)); at the first rejection the bonus is drawn from
    norm(max(p - q, 0)), and after m acceptances from p at the last position. The committed
    tokens then follow p exactly, whatever q is. `limit` [b]: row r verifies only its first
    limit[r] proposals, as if its block ended there (after limit[r] acceptances its bonus is drawn
    from p); exact as long as the limits were chosen without looking at the proposals.
    """
    b, m = proposals.shape
    p_x = target_probs[:, :m].gather(-1, proposals[..., None])[..., 0]  # [b, m]
    q_x = draft_probs.gather(-1, proposals[..., None])[..., 0]
    ok = (accept_uniforms.to(p_x.dtype) * q_x < p_x).to(torch.long)
    if limit is not None:
        ok = ok * _within(limit, m)
    accepted = ok.cumprod(dim=1).sum(dim=1)  # [b]
    rows = torch.arange(b, device=proposals.device)
    p_at = target_probs[rows, accepted]  # [b, V]
    if m > 0:  # q after the last proposal is 0 (the bonus follows p), without copying draft_probs
        q_at = draft_probs[rows, accepted.clamp(max=m - 1)] * (accepted < m).to(draft_probs.dtype)[:, None]
    else:
        q_at = draft_probs.new_zeros(b, target_probs.shape[-1])
    if limit is not None:  # a row that accepted all it verified ends its block: the bonus follows p
        q_at = q_at * (accepted < limit).to(q_at.dtype)[:, None]
    residual = (p_at - q_at).clamp_min(0)
    # p == q at a rejected position cannot happen in exact arithmetic; in floats fall back to p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    dist = torch.where(empty, p_at, residual)
    bonus = sample_from(dist, bonus_uniforms)
    return accepted, bonus


def _within(limit: torch.Tensor, m: int) -> torch.Tensor:
    """[b, m] long: 1 for the proposals each row verifies (the first limit[r])."""
    return (torch.arange(m, device=limit.device)[None] < limit[:, None]).to(torch.long)
