"""The pieces of a token-tree step (docs/DESIGN.md section 5.3) that `DecodeBatch` composes: what a
trim is offered of each row's tree, each row's tree from its draft (proposers/), the batch's trees
as one verify pass's tensors, and the statistics of the path a row accepted.

A row's tree spends its verify budget best-first (`BestFirstProposer`) over the drafter's
distributions; an n-gram lookup continuation, where the row has one, is one more branch
(`LookupProposer`) and takes its share of the same budget, so a step verifies what its policy paid
for whatever the proposals are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from blockspec.dflash.proposers import BestFirstProposer, Distributions, Draft, LookupProposer
from blockspec.dflash.token_tree import TokenTree
from blockspec.dflash.tree_verify import TreeAcceptance
from blockspec.targets.slots import EMPTY

# Candidates per depth a DFlash drafter's tree may choose among: the best-first tree of a
# budget of B nodes never takes more than B siblings, and past the first few ranks the drafter's
# choices are rarely accepted (BENCHMARKS.md, token trees).
TREE_TOP_K = 8


def propose_tree(root: int, distributions: Distributions, lookup: Sequence[int], budget: int) -> TokenTree:
    """A row's tree of at most `budget` proposed nodes: the lookup continuation (cut to the
    budget) as one branch, the rest of the budget best-first from the drafter's distributions.
    Where the branch shares a prefix with the drafter's tree, the nodes it did not need go to the
    drafter's tree: best-first trees of growing budgets contain each other, so the larger one
    shares at least as much of the branch and the total stays within the budget."""
    branch = list(lookup)[:budget]
    depth = distributions.max_depth or None
    if not branch:  # the drafter's tree alone (what `grown` gives without a branch, built once)
        return BestFirstProposer(budget, max_depth=depth).propose(Draft(root, distributions))

    def grown(inner_budget: int) -> tuple[TokenTree, int]:
        inner = BestFirstProposer(inner_budget, max_depth=depth)
        tree = LookupProposer(inner, len(branch)).propose(Draft(root, distributions, branch))
        return tree, len(tree) - len(inner.propose(Draft(root, distributions)))  # the branch's own nodes

    tree, own = grown(budget - len(branch))
    if branch and own < len(branch):
        tree, _ = grown(budget - own)
    return tree


@dataclass(frozen=True)
class TreeOffer:
    """A row's best-first tree nodes, best first (the first k of them are its tree of k nodes),
    as a trim prices them: each node's depth (1: the first proposal), rank among its siblings (0:
    the drafter's first choice), parent (an index into these nodes; -1: the root) and the
    drafter's probability of its token given its parent's."""

    depths: tuple[int, ...]
    ranks: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]



def tree_offers(roots: Sequence[int], dists: Sequence[Distributions], budget: int) -> list[TreeOffer]:
    """Per row, the nodes of its best-first tree of up to `budget` nodes grown from `roots[r]`
    over dists[r], in the order they are taken: what a trim prices trees of every width by. The
    ranking is kept in the distributions, so building the chosen tree after reuses it."""
    out = []
    for root, dist in zip(roots, dists):
        ranked = BestFirstProposer(budget).ranked(Draft(root, dist))
        index = {path: i for i, (path, _) in enumerate(ranked)}
        logp = {path: lp for path, lp in ranked}
        siblings: dict[tuple[int, ...], int] = {}
        depths, ranks, parents, probs = [], [], [], []
        for path, lp in ranked:
            parent = path[:-1]
            depths.append(len(path))
            ranks.append(siblings.get(parent, 0))  # siblings are taken in rank order
            siblings[parent] = ranks[-1] + 1
            parents.append(index[parent] if parent else -1)
            probs.append(math.exp(lp - (logp[parent] if parent else 0.0)))
        out.append(TreeOffer(tuple(depths), tuple(ranks), tuple(parents), tuple(probs)))
    return out


@dataclass(frozen=True)
class PackedTrees:
    """A batch's trees as one verify pass's inputs: ids, positions [b, n] (node order, padded to
    the largest tree; positions EMPTY at padding), ancestors [b, n, n] and padding [b, n]."""

    ids: torch.Tensor
    positions: torch.Tensor
    ancestors: torch.Tensor
    padding: torch.Tensor


def pack_trees(trees: Sequence[TokenTree], cur: Sequence[int], device: torch.device | str) -> PackedTrees:
    """The verify inputs of row r's tree rooted at position cur[r] (see PackedTrees). Built from
    host lists in a handful of tensor operations, since a step packs its trees on its critical
    path: ids and positions as one tensor, the ancestors from each tree shape's rows of flags
    (`ancestor_flags`) as another."""
    b, n = len(trees), max(len(t) for t in trees)
    ids: list[int] = []
    positions: list[int] = []
    flags: list[bool] = []
    for tree, c in zip(trees, cur):
        pad = n - len(tree)
        ids.extend(tree.tokens)
        ids.extend([0] * pad)
        positions.extend(c + d for d in tree.depths)
        positions.extend([EMPTY] * pad)
        flags.extend(ancestor_flags(tree.parents, n))
    both = torch.tensor(ids + positions).view(2, b, n)
    ancestors = torch.tensor(flags, dtype=torch.bool).view(b, n, n)
    pos = both[1]
    return PackedTrees(both[0].to(device), pos.to(device), ancestors.to(device), (pos == EMPTY).to(device))


@lru_cache(maxsize=4096)
def ancestor_flags(parents: tuple[int, ...], n: int) -> tuple[bool, ...]:
    """[n * n], row-major: entry (i, j) is whether node i of a tree with these parents sees node j
    (an ancestor or itself), padded with nodes that see nothing to n; worked out once per shape
    and width, since a policy's trees take a few shapes over and over."""
    seen: list[int] = []  # per node, bit j set where it sees node j
    for i, p in enumerate(parents):  # a parent precedes its children
        seen.append((seen[p] if p >= 0 else 0) | 1 << i)
    seen += [0] * (n - len(parents))
    return tuple(m >> j & 1 == 1 for m in seen for j in range(n))


def gather_path(values: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """values [b, n, F] at each row's path nodes path [b, m] (node indices) -> [b, m, F]. Indexed
    rather than `gather`ed over an expanded index: 2-4x faster for a batch's features or a row's
    logits (8 rows of features: 23 against 43 us; a row's 8 logit rows: 51 against 201 us); a lone
    row's by `index_select` (4 against 9 us for its features)."""
    if values.shape[0] == 1:
        return values[0].index_select(0, path[0])[None]
    rows = torch.arange(values.shape[0], device=values.device)[:, None]  # [b, 1]
    return values[rows, path]


@dataclass(frozen=True)
class PathStats:
    """What one row's tree step tells the statistics: tried[d - 1] / accepted[d - 1] for each
    depth d the walk reached with candidates there (accepted: it went on to depth d), and each
    accepted node's rank among its siblings (0: its parent's first child, the drafter's best)."""

    tried: int
    accepted: int
    ranks: tuple[int, ...]


def path_stats(tree: TokenTree, acceptance: TreeAcceptance, committed: int) -> PathStats:
    """The statistics of the first `committed` nodes of an accepted path (a length limit may cut
    it): depths tried are those below the last committed node that had children."""
    path = acceptance.path[:committed]
    ranks = tuple(list(tree.children(parent).values()).index(child) for parent, child in zip(path, path[1:]))
    accepted = len(path) - 1
    stopped_with_children = len(path) == len(acceptance.path) and bool(tree.children(path[-1]))
    return PathStats(tried=accepted + int(stopped_with_children), accepted=accepted, ranks=ranks)
