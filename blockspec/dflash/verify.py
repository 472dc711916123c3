"""Pure accept/reject rules of speculative decoding. No model, no state, no randomness of its own.

Terms, used the same way everywhere:
- a step verifies q = m + 1 block positions: the last committed token and m proposals;
- `accepted` (0..m) counts leading proposals the target agrees with;
- the `bonus` token comes from the target at the first disagreement (or after the last proposal);
- the step commits accepted + 1 tokens, its acceptance length tau.

Sampled rows use one of two lossless rules (SamplingParams.rule). The keyed rule is
`accept_greedy` against the target's own keyed draws (dflash/sampling.py): a seed then fixes the
text whatever was proposed. The standard rule (`verify_standard`, Leviathan et al. / Chen et al.
2023) keeps proposal x drawn from q with probability min(1, p(x)/q(x)) and at the first rejection
draws from the normalised residual max(0, p - q): it accepts the overlap sum min(p, q) itself,
the most any lossless rule can from one sampled draft, where the keyed coupling is only bound to
overlap / (2 - overlap).
"""

from __future__ import annotations

import torch

from blockspec.cpu.argmax import greedy_ids
from blockspec.dflash.sampling import sample_from
from blockspec.dflash.sparse_probs import SparseProbs, sample_from_pairs


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


def verify_standard(
    proposals: torch.Tensor, target_probs: torch.Tensor | SparseProbs, draft_probs: torch.Tensor, accept_u: torch.Tensor,
    bonus_u: torch.Tensor, limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule: proposals [b, m], each drawn from its row of draft_probs [b, m, V] (a
    one-hot row for a deterministic proposal), against target_probs [b, m+1, V] (the target's
    shaped p) -> accepted [b], bonus [b].

    Proposal i is kept while accept_u[:, i] * q(x_i) < p(x_i) (accept_u [b, m] uniforms in
    (0, 1): probability min(1, p/q)); the bonus is drawn with bonus_u [b, m+1] (a uniform per
    position, that of position `accepted` used) from the normalised
    max(0, p - q) at the first rejection, or from p after the last verified proposal. Only one
    position per row is read beyond the proposals' own probabilities. `limit` as in
    `verify_greedy`. Each row's uniforms must be independent of its proposals. target_probs may be
    the pairs of a nucleus (`SparseProbs`): the same outcome, read over them alone.
    """
    if isinstance(target_probs, SparseProbs):
        return _verify_pairs(proposals, target_probs, draft_probs, accept_u, bonus_u, limit)
    b, m = proposals.shape
    rows = torch.arange(b, device=proposals.device)
    if m == 0:
        return torch.zeros(b, dtype=torch.long, device=proposals.device), sample_from(target_probs[:, 0], bonus_u[:, 0])
    index = proposals[..., None]
    # in float64, as the uniforms come: rounded to float32 a uniform could reach 1
    p_x = target_probs[:, :m].gather(-1, index)[..., 0].double()  # [b, m]
    q_x = draft_probs.gather(-1, index)[..., 0].double()
    keep = (accept_u.double() * q_x < p_x).to(torch.long)
    last = torch.full((b,), m, dtype=torch.long, device=proposals.device) if limit is None else limit
    if limit is not None:
        keep = keep * _within(limit, m)
    accepted = keep.cumprod(dim=1).sum(dim=1)  # [b]
    p_at = target_probs[rows, accepted]  # [b, V]
    residual = (p_at - draft_probs[rows, accepted.clamp(max=m - 1)].to(p_at.dtype)).clamp_(min=0.0)
    # p == q at a rejection is impossible but for rounding: p itself is then the residual's limit
    from_p = (accepted >= last) | (residual.sum(dim=-1) <= 0)
    return accepted, sample_from(torch.where(from_p[:, None], p_at, residual), bonus_u[rows, accepted])


def _verify_pairs(
    proposals: torch.Tensor, target: SparseProbs, draft_probs: torch.Tensor, accept_u: torch.Tensor,
    bonus_u: torch.Tensor, limit: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_standard` with the target's p as pairs [b, m+1, k]: the same float operations on
    the nucleus's tokens (p(x) is a pair's probability or 0, the residual is 0 off the nucleus),
    so the same accepted and bonus."""
    b, m = proposals.shape
    ids, p = target.ids, target.probs  # [b, m+1, k]
    if m == 0:
        return torch.zeros(b, dtype=torch.long, device=proposals.device), sample_from_pairs(ids[:, 0], p[:, 0],
                                                                                            bonus_u[:, 0])
    rows = torch.arange(b, device=proposals.device)
    # one pair at most matches (padding carries probability 0): the sum is that probability
    p_x = (p[:, :m] * (ids[:, :m] == proposals[..., None])).sum(dim=-1).double()  # [b, m]
    q_x = draft_probs.gather(-1, proposals[..., None])[..., 0].double()
    keep = (accept_u.double() * q_x < p_x).to(torch.long)
    last = torch.full((b,), m, dtype=torch.long, device=proposals.device) if limit is None else limit
    if limit is not None:
        keep = keep * _within(limit, m)
    accepted = keep.cumprod(dim=1).sum(dim=1)  # [b]
    ids_at, p_at = ids[rows, accepted], p[rows, accepted]  # [b, k]
    q_at = draft_probs[rows[:, None], accepted.clamp(max=m - 1)[:, None], ids_at]  # [b, k]
    residual = (p_at - q_at.to(p_at.dtype)).clamp_(min=0.0)
    from_p = (accepted >= last) | (residual.sum(dim=-1) <= 0)
    return accepted, sample_from_pairs(ids_at, torch.where(from_p[:, None], p_at, residual), bonus_u[rows, accepted])
