"""What a step is expected to commit: acceptance counts per verification rule, a row's expected
tokens by verify width for chains and trees, and the split of a verify budget between rows."""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter, sub

from blockspec.dflash.row import Row
from blockspec.dflash.trim import TreeOffer
from blockspec.dflash.node_acceptance import NodeAcceptance
from blockspec.dflash.policy.costs import cost_at

RULES = ("greedy", "keyed", "standard")  # SamplingParams.rule


@dataclass
class Acceptance:
    """Batch-wide acceptance counts of one verification rule: how often proposal k (drafted, or
    looked up) was accepted, of the times it was verified with proposals 0..k-1 accepted."""

    accepted: list[int]
    tries: list[int]
    lookup_accepted: list[int]
    lookup_tries: list[int]

    @classmethod
    def empty(cls, positions: int) -> Acceptance:
        return cls(*([0] * positions for _ in range(4)))


def acceptance_counts(rows: list[Row]) -> list[tuple[list[int], ...]]:
    """Each row's acceptance counts so far, for `AdaptiveBlock.record` after a step."""
    return [(list(r.stats.accepted_by_position), list(r.tries), list(r.stats.lookup_accepted_by_position),
             list(r.lookup_tries)) for r in rows]


def count_growth(now: list[int], before: list[int], positions: int) -> list[int]:
    """Per position (the first `positions`), how much a count grew since `before`."""
    if len(now) < positions or len(before) < positions:
        raise IndexError(f"counts of {len(now)} and {len(before)} positions, need {positions}")
    return list(map(sub, now[:positions], before[:positions]))


def split_lengths(expected: list[list[float]], sunk: float, verify: list[float],
                  pad_share: float) -> tuple[list[int], float]:
    """A verify length per row that maximises expected tokens per second, and that rate.

    expected[i]: row i's expected committed tokens [E(1), E(2), ...] for verifying 1, 2, ...
    tokens (rows may offer different most); sunk: seconds already paid (a draft pass); verify:
    seconds of a uniform verify of 1..n tokens per row. T verified tokens over b rows cost what a
    uniform block of T / b does (the matmuls cost by rows), plus pad_share of what padding every
    row to the longest adds (0: padding is free; 1: every row costs the longest, as without
    packing). Each row's gains per extra token are non-increasing, so taking the largest gains
    across rows first is the best split of every total (a stable sort keeps a row's own gains in
    order where they tie).
    """
    b = len(expected)
    # largest first; equal gains keep their order (a reversed sort stays stable)
    gains = sorted(((e[k] - e[k - 1], i) for i, e in enumerate(expected) for k in range(1, len(e))),
                   key=itemgetter(0), reverse=True)
    total = sum(e[0] for e in expected)
    best_rate, best_extra = total / (sunk + verify[0]), 0
    lengths, longest = [1] * b, 1
    for extra, (gain, i) in enumerate(gains, 1):
        if gain <= 0:
            break
        total += gain
        lengths[i] += 1
        longest = max(longest, lengths[i])
        packed = cost_at(verify, 1 + extra / b)
        rate = total / (sunk + packed + pad_share * (verify[longest - 1] - packed))
        if rate > best_rate:
            best_rate, best_extra = rate, extra
    lengths = [1] * b
    for _, i in gains[:best_extra]:
        lengths[i] += 1
    return lengths, best_rate


def expected_tokens(rates: list[float], block: int, remaining: int) -> float:
    """E(block) for one row: 1 + sum over k < block-1 of prod_{j<=k} rates[j], capped."""
    return expected_by_block(rates, block, remaining)[-1]


def expected_by_block(rates: list[float], max_block: int, remaining: int) -> list[float]:
    """[E(1), ..., E(max_block)] for one row, in one pass."""
    out, total, p = [1.0], 1.0, 1.0
    for rate in rates[:max_block - 1]:
        p *= rate
        total += p
        out.append(total)
    out += [total] * (max_block - len(out))
    cap = float(max(1, remaining))
    # rates are probabilities, so E is non-decreasing: only a row near its end needs capping
    return out if total <= cap else [min(e, cap) for e in out]


def tree_expected_by_width(offer: TreeOffer, nodes: NodeAcceptance, width: int, remaining: int,
                           lookup: list[float], *, calibrated: bool = False) -> list[float]:
    """[E(1), ..., E(width)] for one row's tree step of 1..width nodes (the root included):
    1 plus each of its first w - 1 best-first nodes' chance of acceptance, the product of the
    rates along its path, calibrated in a chain's units (`NodeAcceptance.relative_rate`: a
    chain's trim reads its first choices' draft probabilities), capped by the row's remaining
    tokens. A row with a lookup continuation (`lookup`: its rates) spends the first nodes of its
    budget on that branch (as `propose_tree` does) and the rest on the drafter's best nodes.
    `calibrated`: every node at its observed chance (`NodeAcceptance.rate`) instead."""
    rate = nodes.rate if calibrated else nodes.relative_rate
    reach: list[float] = []
    for depth, rank, parent, p in zip(offer.depths, offer.ranks, offer.parents, offer.probs):
        reach.append((reach[parent] if parent >= 0 else 1.0) * rate(depth, rank, p))
    branch = expected_by_block(lookup, 1 + len(lookup), remaining) if lookup else [1.0]
    summed = [0.0]  # summed[k]: the first k nodes' chances
    for x in reach:
        summed.append(summed[-1] + x)
    out, cap = [], float(max(1, remaining))
    for w in range(1, width + 1):
        own = min(w - 1, len(branch) - 1)
        out.append(min(cap, branch[own] + summed[min(w - 1 - own, len(reach))]))
    return out
