"""The best-first tree proposer (as EAGLE-2 and DDTree grow theirs): the `budget` root paths of
highest draft probability, a path's probability being the product of its tokens' probabilities
given the tokens before them.

Every extension of a path is at most as likely as the path, and a node's children are visited
best first, so growing from a frontier (a node's best child, its next sibling) finds the exact
top `budget` set; it is closed under ancestors, hence a tree. With one candidate per depth it is
the chain of `budget` first choices.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from blockspec.dflash.proposers.base import Draft, need_distributions
from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError


@dataclass(frozen=True)
class BestFirstProposer:
    """At most `budget` proposed nodes (the root aside), none deeper than `max_depth` (None: as
    deep as the distributions go)."""

    budget: int
    max_depth: int | None = None

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ConfigError(f"a tree's node budget must be >= 0, got {self.budget}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ConfigError(f"a tree's max_depth must be >= 1 (or None), got {self.max_depth}")

    def propose(self, draft: Draft) -> TokenTree:
        # taken best first, siblings come in rank order and parents before children
        return TokenTree.from_paths(draft.root, [path for path, _ in self.ranked(draft)])

    def ranked(self, draft: Draft) -> list[tuple[tuple[int, ...], float]]:
        """The tree's nodes as (root path's proposed tokens, its log-probability), best first:
        the first k of them are the best-first tree of budget k, for every k."""
        if self.budget == 0:
            return []
        dists = need_distributions(draft, "best-first tree")
        deepest = dists.max_depth if self.max_depth is None else min(self.max_depth, dists.max_depth)
        if deepest < 1:
            return []
        # The nodes come out in the same order whatever the budget (it only says when to stop), so
        # a ranking taken before from the same distributions (a step prices its tree, then builds
        # it) holds every shorter one as a prefix.
        memo = getattr(dists, "rankings", None)
        key = (draft.root, deepest)
        if memo is not None and key in memo:
            known, complete = memo[key]
            if complete or len(known) >= self.budget:
                return known[: self.budget]
        # a frontier entry: (-path log-probability, tie order, parent's path, parent's candidates, rank)
        heap: list = []
        order = 0

        def push(score: float, parent_path: tuple[int, ...], cands: tuple[list[int], list[float]], rank: int) -> None:
            nonlocal order
            if rank < len(cands[0]):
                heapq.heappush(heap, (-(score + cands[1][rank]), order, score, parent_path, cands, rank))
                order += 1

        push(0.0, (), dists.children(1, draft.root), 0)
        chosen: list[tuple[tuple[int, ...], float]] = []  # in the order they were taken: best first
        while heap and len(chosen) < self.budget:
            neg, _, parent_score, parent_path, cands, rank = heapq.heappop(heap)
            path = (*parent_path, cands[0][rank])
            chosen.append((path, -neg))
            push(parent_score, parent_path, cands, rank + 1)  # the next sibling
            if len(path) < deepest:
                push(-neg, path, dists.children(len(path) + 1, path[-1]), 0)  # the best child
        if memo is not None:
            memo[key] = (chosen, not heap)
        return list(chosen)
