"""Attention visibility for a token-tree verify pass (docs/DESIGN.md, "Token trees").

A tree's nodes take the last n slots of the cache, one slot per node in node order (siblings
share a position, so slots cannot follow positions there). Each node sees the committed context
by the usual positional rules and, among the tree's slots, only itself and its ancestors: with
the positional rule alone, a node would also see its siblings and cousins at positions up to its
own, and its logits would no longer be those of its root-to-node chain.
"""

from __future__ import annotations

import torch

from blockspec.errors import ConfigError
from blockspec.targets.slots import EMPTY, SlotTable


def check_tree_pass(ids: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor) -> None:
    """A tree pass's arguments, as every target's `forward_tree` takes them: ids and positions
    [b, n], ancestors [n, n] or [b, n, n]; a ConfigError naming the shapes otherwise."""
    b, n = positions.shape
    if ids.shape != (b, n) or ancestors.shape not in ((n, n), (b, n, n)):
        raise ConfigError(f"a tree pass takes ids and positions [b, n] and ancestors [n, n] or [b, n, n]; got "
                          f"{tuple(ids.shape)}, {tuple(positions.shape)}, {tuple(ancestors.shape)}")


def tree_visibility(slots: SlotTable, positions: torch.Tensor, ancestors: torch.Tensor, *,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Boolean mask [b, 1, n, S]: True where tree node i of a row may attend to a slot.

    positions [b, n]: each node's position (the root's plus its depth; EMPTY for padding nodes),
    whose slots are the last n of `slots` (already appended); ancestors [b, n, n] (or [n, n] for
    every row): node i sees node j, its ancestors and itself (`TokenTree.ancestor_mask`).
    A sliding window applies by position to the context and the ancestors alike."""
    b, n = positions.shape
    if ancestors.dim() == 2:
        ancestors = ancestors[None].expand(b, n, n)
    if ancestors.shape != (b, n, n):
        raise ConfigError(f"a tree mask needs ancestors [b={b}, n={n}, n], got {tuple(ancestors.shape)}")
    if slots.num_slots < n:
        raise ConfigError(f"the cache holds {slots.num_slots} slots, fewer than the tree's {n} nodes")
    visible = slots.attention_mask(positions, causal=True, sliding_window=sliding_window)  # [b, 1, n, S]
    valid = positions != EMPTY  # [b, n]
    tree = ancestors.to(torch.bool) & valid[:, None, :] & valid[:, :, None]  # [b, n, n]
    if sliding_window is not None:
        tree = tree & (positions[:, :, None] - positions[:, None, :] < sliding_window)
    own = torch.eye(n, dtype=torch.bool, device=positions.device)[None]  # padding sees itself: no NaN rows
    visible = visible.clone()
    visible[:, 0, :, slots.num_slots - n:] = tree | own
    return visible
