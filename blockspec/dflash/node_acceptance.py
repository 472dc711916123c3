"""Observed acceptance of proposed nodes by depth and rank: what the adaptive policy prices chains
and token trees by (docs/DESIGN.md sections 5.1 and 5.3).

Every verified node is a trial: given its parent was accepted, it is accepted when the target's
token there is the node's. A chain's proposals are the nodes of rank 0 (the drafter's first
choice); a tree adds lower ranks. The drafter's own probability of a node is a fair estimate of
its chance for first choices but not for the others: its second and third choices are accepted far
less often than their draft probabilities say (BENCHMARKS.md, token trees), so pricing a tree by
them buys the wrong widths. `NodeAcceptance` keeps, per (depth, rank, band of the drafter's
conditional probability), the trials, their acceptances and the drafter's probabilities summed
over them, and maps a node's draft probability to a calibrated one: the probability times the
observed / predicted acceptance of its cell, shrunk towards the same ratio over all depths of its
(rank, band), which shrinks towards 1 (the drafter's word) in turn. Trials of steps whose
probabilities were not read back (a batch's untrimmed steps) count towards the mean rate of their
(depth, rank) only (`mean_rate`), which prices steps chosen before their draft exists.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

DEPTHS = 8  # depths past this share the last cell
RANKS = 4  # ranks past this share the last cell
BANDS = (0.05, 0.2, 0.5)  # upper edges of the probability bands (the last band goes to 1)
# The prior's weight: this many expected acceptances at the drafter's word (a cell's ratio
# observed / predicted is a Poisson rate ratio, so its evidence grows with the predicted mass).
WEIGHT = 4.0
MEAN_WEIGHT = 8.0  # tries of the prior of a mean rate (as the chain's per-position rates)
# A (depth, rank > 0) mean rate's prior, as a share of the first choice's at that depth per rank
# below it: second choices were accepted a small fraction as often as first ones (BENCHMARKS.md).
LOWER_RANK_SHARE = 0.2


@dataclass
class Cell:
    """Trials of one cell: how many, how many were accepted, and the drafter's probabilities summed."""

    tries: int = 0
    accepted: int = 0
    predicted: float = 0.0


def _band(p: float) -> int:
    return next((i for i, edge in enumerate(BANDS) if p < edge), len(BANDS))


def _depth(depth: int) -> int:
    return min(max(depth, 1), DEPTHS)


def _rank(rank: int) -> int:
    return min(max(rank, 0), RANKS - 1)


@dataclass
class NodeAcceptance:
    """Acceptance of proposed nodes by (depth, rank), for one verification rule."""

    cells: dict[tuple[int, int, int], Cell] = field(default_factory=dict)  # (depth, rank, band)
    pooled: dict[tuple[int, int], Cell] = field(default_factory=dict)  # (rank, band), over depths
    means: dict[tuple[int, int], Cell] = field(default_factory=dict)  # (depth, rank), with or without p
    # (depth, rank, band) -> calibration ratio, until the next trial with p (a step prices many nodes)
    _ratios: dict[tuple[int, int, int], float] = field(default_factory=dict, repr=False)

    def observe(self, depth: int, rank: int, p: float | None, accepted: bool) -> None:
        """Books one trial: a node at `depth` (1: the first proposal) of `rank` among its siblings
        (0: the drafter's first choice) whose drafter probability given its parent was p (None:
        not read back), accepted or not."""
        d, r = _depth(depth), _rank(rank)
        cells = [self.means.setdefault((d, r), Cell())]
        if p is not None:
            self._ratios.clear()
            band = _band(p)
            cells += [self.cells.setdefault((d, r, band), Cell()), self.pooled.setdefault((r, band), Cell())]
        for i, c in enumerate(cells):
            c.tries += 1
            c.accepted += int(accepted)
            if i:
                c.predicted += p

    def rate(self, depth: int, rank: int, p: float) -> float:
        """The calibrated chance that a node of drafter probability p (given its parent) at
        `depth` and `rank` is accepted once its parent is."""
        if p <= 0:
            return 0.0
        key = (_depth(depth), _rank(rank), _band(p))
        ratio = self._ratios.get(key)
        if ratio is None:
            pool = self.pooled.get(key[1:])
            ratio = 1.0 if pool is None else (pool.accepted + WEIGHT) / (pool.predicted + WEIGHT)
            cell = self.cells.get(key)
            if cell is not None:
                ratio = (cell.accepted + WEIGHT * ratio) / (cell.predicted + WEIGHT)
            self._ratios[key] = ratio
        return min(1.0, p * ratio)

    def relative_rate(self, depth: int, rank: int, p: float) -> float:
        """`rate` in the units a chain is priced in, its first choices' draft probabilities: p
        itself for rank 0, p times its rank's calibration over rank 0's (same depth and band)
        for the others. Priced so, a chain step chooses what it would without trees, and a tree
        only adds what its lower ranks are observed to add beside it."""
        if rank == 0 or p <= 0:
            return max(0.0, p)
        first = self.rate(depth, 0, p)
        return min(1.0, p * self.rate(depth, rank, p) / first) if first > 0 else 0.0

    def mean_rate(self, depth: int, rank: int, first: float) -> float:
        """The observed chance that a node at `depth` of `rank` is accepted once its parent is,
        whatever its drafter probability, shrunk towards a prior: `first` (the first choice's
        rate at that depth) for rank 0, a LOWER_RANK_SHARE of it per rank below for the others."""
        prior = first * LOWER_RANK_SHARE ** rank
        cell = self.means.get((_depth(depth), _rank(rank)))
        if cell is None:
            return prior
        return (cell.accepted + MEAN_WEIGHT * prior) / (cell.tries + MEAN_WEIGHT)


def best_tree_expectations(rate: Callable[[int, int], float], budget: int, max_depth: int, ranks: int
                           ) -> list[float]:
    """[E(0), ..., E(budget)]: the expected committed tokens (the bonus included) of the best
    tree of 0..budget proposed nodes when a node at depth d of rank r is accepted with
    probability rate(d, r) once its parent is, independently of the step (what a batch's step is
    priced by before its drafts exist). Rates are made non-increasing in rank, so a node's next
    sibling is never better than it and best-first growth finds the best set of every size."""
    table = [[0.0] * ranks for _ in range(max_depth + 1)]
    for d in range(1, max_depth + 1):
        best = 1.0
        for r in range(ranks):
            best = min(best, max(0.0, rate(d, r)))
            table[d][r] = best
    out = [1.0]
    if max_depth < 1 or ranks < 1:
        return out + [1.0] * budget
    heap = [(-table[1][0], 1, 0, 1.0)]  # (-node probability, depth, rank, parent's probability)
    while len(out) <= budget:
        if not heap:
            out.append(out[-1])
            continue
        neg, d, r, parent = heapq.heappop(heap)
        out.append(out[-1] - neg)
        if r + 1 < ranks:
            heapq.heappush(heap, (-parent * table[d][r + 1], d, r + 1, parent))
        if d < max_depth:
            heapq.heappush(heap, (neg * table[d + 1][0], d + 1, 0, -neg))
    return out
