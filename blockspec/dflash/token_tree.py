"""A token tree: several candidate continuations of one row, verified in one target pass
(docs/DESIGN.md, "Token trees").

Node 0 is the root, the row's last committed token; every other node is a proposed token whose
parent is the token before it. Nodes are in breadth-first order (a parent precedes its children,
depths never decrease), the children of one node carry distinct tokens, and a node at depth d
sits at position cur + d, cur being the root's position. A node attends to the committed context
and to its ancestors (itself included), never to a sibling or a cousin: that is what makes its
logits those of the chain root -> ... -> node. A chain is the tree where every node has one child.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from blockspec.errors import ConfigError

NO_PARENT = -1


@dataclass(frozen=True)
class TokenTree:
    """tokens[i] is node i's token, parents[i] its parent's index (NO_PARENT for the root, node 0)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tokens, parents = tuple(int(t) for t in self.tokens), tuple(int(p) for p in self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if not tokens:
            raise ConfigError("a token tree needs at least its root (the last committed token)")
        if len(parents) != len(tokens):
            raise ConfigError(f"a token tree has {len(tokens)} tokens but {len(parents)} parents")
        if parents[0] != NO_PARENT:
            raise ConfigError(f"node 0 is the root: its parent must be {NO_PARENT}, got {parents[0]}")
        depths = [0]
        seen: set[tuple[int, int]] = set()
        for i in range(1, len(tokens)):
            p = parents[i]
            if not 0 <= p < i:
                raise ConfigError(f"node {i}'s parent {p} does not precede it (nodes go parents first)")
            d = depths[p] + 1
            if d < depths[-1]:
                raise ConfigError(f"node {i} at depth {d} follows a node at depth {depths[-1]}: not breadth-first")
            if (p, tokens[i]) in seen:
                raise ConfigError(f"node {p} has two children with token {tokens[i]}: merge them")
            seen.add((p, tokens[i]))
            depths.append(d)
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, root: int, proposals: Sequence[int]) -> TokenTree:
        """The chain root -> proposals[0] -> proposals[1] -> ... (what a plain DFlash step verifies)."""
        n = len(proposals)
        return cls((root, *proposals), tuple(range(-1, n)))

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]]) -> TokenTree:
        """The tree holding every path (token sequences after the root), identical prefixes shared.
        Children are ordered by first appearance, so earlier paths come first at every depth."""
        trie: list[dict[int, int]] = [{}]  # per trie node: token -> trie node
        trie_tokens = [root]
        for path in paths:
            at = 0
            for tok in path:
                tok = int(tok)
                nxt = trie[at].get(tok)
                if nxt is None:
                    nxt = len(trie)
                    trie[at][tok] = nxt
                    trie.append({})
                    trie_tokens.append(tok)
                at = nxt
        tokens, parents = [root], [NO_PARENT]
        frontier = [0]  # trie nodes of the current depth, in tree order
        while frontier:
            nxt_frontier = []
            for tree_index, node in zip(range(len(tokens) - len(frontier), len(tokens)), frontier):
                for child in trie[node].values():
                    tokens.append(trie_tokens[child])
                    parents.append(tree_index)
                    nxt_frontier.append(child)
            frontier = nxt_frontier
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    def children(self, node: int) -> dict[int, int]:
        """token -> child index of node's children."""
        return {self.tokens[i]: i for i in range(node + 1, len(self)) if self.parents[i] == node}

    def path(self, node: int) -> list[int]:
        """The node indices root -> ... -> node."""
        out = [node]
        while self.parents[out[-1]] != NO_PARENT:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """The proposed tokens on the way to node (the root's excluded)."""
        return [self.tokens[i] for i in self.path(node)[1:]]

    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(len(self)) if i not in has_child]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path's proposed tokens, leaves in tree order."""
        return [self.path_tokens(leaf) for leaf in self.leaves() if leaf != 0] or [[]]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i > 0)

    def positions(self, cur: int) -> list[int]:
        """Each node's position: the root's position cur plus its depth."""
        return [cur + d for d in self.depths]

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[n, n] bool: row i is True at node i and its ancestors, the tree nodes node i attends to."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, self.path(i)] = True
        return mask.to(device)

    def merge(self, branch: Sequence[int]) -> TokenTree:
        """This tree with one more root-to-node path (e.g. an n-gram lookup continuation), sharing
        whatever prefix of it is already in the tree. A new node comes after its siblings; the
        existing nodes keep their order where it is canonical (at each depth, children grouped
        by parent, parents in order), as `from_paths` and the proposers make it."""
        every = [self.path_tokens(i) for i in range(1, len(self))]
        return TokenTree.from_paths(self.tokens[0], [*every, list(branch)])
