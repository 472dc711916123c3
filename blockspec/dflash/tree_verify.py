"""Pure acceptance rules over a token tree (dflash/token_tree.py): which root-to-node path a step
commits, given the target's outputs at every node of one verify pass.

The walk starts at the root; at each node it takes the target's own token there (its argmax, or
its keyed draw when sampling) and descends to the child carrying that token; where no child does,
it stops and that token is the bonus. A node on the walk has exactly the committed tokens before
it, so the target's token there is the one plain decoding would produce at that output position:
greedy output equals plain greedy decoding, and sampled output equals plain decoding with the
same seed (draws keyed by (seed, output position), dflash/sampling.py), whatever the tree.
Node i's output position is start + depth(i), not start + i: siblings share a position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockspec.cpu.argmax import greedy_ids
from blockspec.dflash.sampling import RowRandom
from blockspec.dflash.sparse_probs import SparseProbs, draw
from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError


@dataclass(frozen=True)
class TreeAcceptance:
    """path: the accepted node indices, root first (accepted = len(path) - 1 proposals); bonus:
    the target's token at the last node of the path."""

    path: tuple[int, ...]
    bonus: int

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    def committed(self, tree: TokenTree) -> list[int]:
        """The tokens the step commits: the accepted proposals, then the bonus."""
        return [tree.tokens[i] for i in self.path[1:]] + [self.bonus]


def walk(tree: TokenTree, target_tokens: Sequence[int] | torch.Tensor) -> TreeAcceptance:
    """The accepted path given the target's token at each node [n]; tokens at nodes off the
    path are never read (they may be anything)."""
    if len(target_tokens) != len(tree):
        raise ConfigError(f"{len(target_tokens)} target tokens for a tree of {len(tree)} nodes")
    toks = target_tokens.tolist() if isinstance(target_tokens, torch.Tensor) else list(target_tokens)
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if i}
    path = [0]
    while True:
        nxt = children.get((path[-1], int(toks[path[-1]])))
        if nxt is None:
            return TreeAcceptance(tuple(path), int(toks[path[-1]]))
        path.append(nxt)


def walk_greedy(tree: TokenTree, logits: torch.Tensor) -> TreeAcceptance:
    """Greedy: the target's argmax at each node; logits [n, V] in node order."""
    return walk(tree, greedy_ids(logits))


def node_draws(tree: TokenTree, probs: torch.Tensor, seed: int, start: int) -> torch.Tensor:
    """The target's keyed draw at every node [n] from its probabilities there, probs [n, V]
    (shaped as `sampling.probabilities` shapes them): node i's draw is the one plain decoding
    of a request with this seed takes at output position start + depth(i) from the same
    distribution. start: the output position the root's logits predict (`DecodeBatch._starts`)."""
    n = len(tree)
    if probs.dim() != 2 or probs.shape[0] != n:
        raise ConfigError(f"probabilities must be [nodes={n}, vocab], got {tuple(probs.shape)}")
    return keyed_draws(RowRandom([seed]), probs[None], [tree.depths], [start])[0]


def keyed_draws(random: RowRandom, probs: torch.Tensor | SparseProbs, depths: Sequence[Sequence[int]], starts: Sequence[int]
                ) -> torch.Tensor:
    """`node_draws` for a batch of trees in one call: ids [b, n] from probs [b, n, V], row r's
    node i with the clocks of output position starts[r] + depths[r][i] under row r's seed
    (`random`); nodes past len(depths[r]) (a shorter tree's padding) draw at starts[r]. probs
    may be a nucleus's pairs (dflash/sparse_probs.py)."""
    b, n, v = probs.shape
    if len(depths) != b or len(starts) != b or len(random.seeds) != b:
        raise ConfigError(f"{b} rows of probabilities, {len(depths)} trees, {len(starts)} starts, "
                          f"{len(random.seeds)} seeds")
    # one single-position row per node, each with the clocks of its own output position
    flat = random.subset([r for r in range(b) for _ in range(n)])
    positions = [start + (ds[i] if i < len(ds) else 0) for ds, start in zip(depths, starts) for i in range(n)]
    return draw(flat, probs.reshape(b * n, 1, v), positions).reshape(b, n)


def walk_sampled(tree: TokenTree, probs: torch.Tensor, seed: int, start: int) -> TreeAcceptance:
    """Sampled: the target's keyed draw at each node picks the child (see `node_draws`)."""
    return walk(tree, node_draws(tree, probs, seed, start))
