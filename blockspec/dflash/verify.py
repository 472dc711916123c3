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

import bisect
import struct

import torch

from blockspec.cpu import kernels
from blockspec.cpu.argmax import greedy_ids
from blockspec.dflash.sampling import ACCEPT_SLOT, BONUS_SLOT, sample_from, slot_uniforms
from blockspec.dflash.sparse_probs import SparseProbs


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
    proposals: torch.Tensor, target_probs: torch.Tensor | SparseProbs, draft_probs: torch.Tensor | SparseProbs,
    accept_u: torch.Tensor, bonus_u: torch.Tensor, limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule: proposals [b, m], each drawn from its row of draft_probs [b, m, V] (a
    one-hot row for a deterministic proposal; or a nucleus's pairs), against target_probs [b, m+1, V] (the target's
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
    if isinstance(draft_probs, SparseProbs):  # a nucleus of pairs beside a vocabulary-wide p
        draft_probs = draft_probs.dense()
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


def verify_standard_keyed(
    proposals: torch.Tensor, target_probs: torch.Tensor | SparseProbs, draft_probs: torch.Tensor | SparseProbs,
    keys: torch.Tensor, limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_standard` with each position's uniforms read from its key, keys [b, m+1] (int64,
    `RowRandom.keys`): the accept uniform of position i is its key's ACCEPT_SLOT and the bonus's
    its BONUS_SLOT (`RowRandom.uniforms`). Where both distributions are pairs, one kernel call
    (cpu/csrc/standard_rule.c) decides with the same arithmetic."""
    if isinstance(target_probs, SparseProbs) and isinstance(draft_probs, SparseProbs):
        fast = kernels.standard_rule(proposals, target_probs.ids, target_probs.probs, draft_probs.ids,
                                     draft_probs.probs, keys, limit)
        if fast is not None:
            return fast[0].to(proposals.device), fast[1].to(proposals.device)
    accept_u, bonus_u = standard_uniforms(keys)
    return verify_standard(proposals, target_probs, draft_probs, accept_u.to(proposals.device),
                           bonus_u.to(proposals.device), limit)


def standard_uniforms(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule's uniforms of positions' keys [b, m+1] (float64): accept [b, m] (each
    proposal's ACCEPT_SLOT) and bonus [b, m+1] (each position's BONUS_SLOT)."""
    u = slot_uniforms(keys, torch.tensor([ACCEPT_SLOT, BONUS_SLOT], dtype=torch.int64))  # [b, m+1, 2]
    return u[:, :-1, 0], u[..., 1]


def _verify_pairs(
    proposals: torch.Tensor, target: SparseProbs, draft_probs: torch.Tensor | SparseProbs, accept_u: torch.Tensor,
    bonus_u: torch.Tensor, limit: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_standard` with the target's p as pairs [b, m+1, k], on the host: a handful of
    numbers per row, where each tensor operation would cost more than its arithmetic. The same
    arithmetic as the tensors' (`_f32` rounds as float32 operations do; float32 cumulative sums
    accumulate in float64), so the same accepted and bonus. The draft's q may be pairs too."""
    b, m = proposals.shape
    ids = target.ids.tolist()  # [b][m+1][k]
    p = target.probs.tolist()
    props = proposals.tolist()
    q_x = _draft_at(draft_probs, proposals) if m else [[] for _ in range(b)]  # [b][m]
    acc_u, bon_u = accept_u.tolist(), bonus_u.tolist()
    lim = [m] * b if limit is None else limit.tolist()
    accepted = []
    for r in range(b):
        a = 0
        while a < min(m, lim[r]):
            row_ids, row_p = ids[r][a], p[r][a]
            x = props[r][a]
            p_x = _pair_prob(row_ids, row_p, x)
            if not acc_u[r][a] * q_x[r][a] < p_x:  # float64, as the uniforms come
                break
            a += 1
        accepted.append(a)
    # the draft's q at the first rejection, over that position's pairs alone
    rejected = [r for r in range(b) if accepted[r] < lim[r]]
    q_at: dict[int, list[float]] = {}
    if rejected:
        at = [(r, min(accepted[r], m - 1), ids[r][accepted[r]]) for r in rejected]
        q_at = dict(zip(rejected, _draft_over(draft_probs, at)))
    bonus = []
    for r in range(b):
        a = accepted[r]
        p_at = p[r][a]
        w = p_at
        if r in q_at:
            residual = [max(_f32(pj - qj), 0.0) for pj, qj in zip(p_at, q_at[r])]
            # p == q at a rejection is impossible but for rounding: p itself is then the residual's limit
            if any(x > 0 for x in residual):
                w = residual
        bonus.append(ids[r][a][_inverse_cdf(w, bon_u[r][a])])
    device = proposals.device
    return torch.tensor(accepted, dtype=torch.long, device=device), torch.tensor(bonus, dtype=torch.long, device=device)


def _draft_at(draft_probs: torch.Tensor | SparseProbs, proposals: torch.Tensor) -> list[list[float]]:
    """q [b][m] of each proposal under its row of the draft's q [b, m, V] or its pairs."""
    if isinstance(draft_probs, torch.Tensor):
        return draft_probs.gather(-1, proposals[..., None])[..., 0].tolist()
    ids, probs = draft_probs.ids.tolist(), draft_probs.probs.tolist()  # [b][m][k]
    return [[_pair_prob(ids[r][j], probs[r][j], x) for j, x in enumerate(row)] for r, row in enumerate(proposals.tolist())]


def _draft_over(draft_probs: torch.Tensor | SparseProbs, at: list[tuple[int, int, list[int]]]) -> list[list[float]]:
    """Per (row, position, tokens) of `at`, q of those tokens there (0 outside a nucleus)."""
    if isinstance(draft_probs, SparseProbs):
        out = []
        for r, j, toks in at:
            ids, probs = draft_probs.ids[r, j].tolist(), draft_probs.probs[r, j].tolist()  # one position's pairs
            out.append([_pair_prob(ids, probs, t) for t in toks])
        return out
    k = len(at[0][2])
    dev = draft_probs.device
    rows = torch.tensor([r for r, _, toks in at for _ in toks], device=dev)
    pos = torch.tensor([j for _, j, toks in at for _ in toks], device=dev)
    flat = draft_probs[rows, pos, torch.tensor([t for _, _, toks in at for t in toks], device=dev)].tolist()
    return [flat[i * k:(i + 1) * k] for i in range(len(at))]


def _pair_prob(ids: list[int], probs: list[float], token: int) -> float:
    """The probability of `token` in one position's pairs (0 where it is not among them)."""
    return next((pj for ij, pj in zip(ids, probs) if ij == token and pj > 0), 0.0)


def _f32(x: float) -> float:
    """x rounded to float32 (nearest, ties to even): a float32 operation on float32 operands
    computed in float64 and rounded once gives the float32 operation's result."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _inverse_cdf(w: list[float], u: float) -> int:
    """`sample_from` of one row of float32 weights w (need not sum to 1, some > 0) with uniform u:
    the index whose float32 cumulative sum (accumulated in float64, as PyTorch's) first exceeds
    float32(u) times the total, that product kept below the total as `sample_from` keeps it."""
    cdf, run = [], 0.0
    for x in w:
        run += x
        cdf.append(_f32(run))
    total = cdf[-1]
    below = struct.unpack("f", struct.pack("I", struct.unpack("I", struct.pack("f", total))[0] - 1))[0]
    return min(bisect.bisect_right(cdf, min(_f32(_f32(u) * total), below)), len(w) - 1)
