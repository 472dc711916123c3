"""The target protocol: what DFlash decoding needs from a target model and its cache.

A target forward takes token ids at explicit absolute positions, appends their K/V to a cache
the caller owns, and returns logits plus the concatenated features of the drafter's chosen layers
(captured with hooks: other hidden states are never kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from blockspec.cpu.argmax import greedy_ids

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class TargetInfo:
    """What the decoder and drafter need to know about a target."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int
    model_type: str
    eos_token_ids: tuple[int, ...] = ()


class TargetCache(Protocol):
    """KV cache of a target for a batch. Invariant: valid slots hold committed tokens only.

    Every implementation has every method (a no-op where it has nothing to do), so callers never
    ask a cache what it can do. docs/DESIGN.md section 9 says how each one keeps the invariant.
    """

    def lengths(self) -> torch.Tensor:
        """Valid (committed) slots per row [b]."""
        ...

    def reserve(self, n: int, capacity: int = 0) -> None:
        """The next forward reads slots < n and may write positions below max(n, capacity):
        preallocated caches grow and set their attention horizon; growing ones do nothing."""
        ...

    def reject(self, keep: torch.Tensor) -> None:
        """Of the last forward's q slots per row, keep those where keep [b, q] is True."""
        ...

    def compact(self, ratio: float) -> None:
        """Reclaims rejected slots once they exceed `ratio` of the cache (may do nothing)."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps only these rows, in this order (an empty index keeps the storage for later)."""
        ...

    def spawn(self, batch: int) -> TargetCache:
        """An empty cache of the same kind for `batch` new rows, which `merge` takes (without
        copying where the storage is shared)."""
        ...

    def merge(self, other: TargetCache) -> None:
        """Appends other's rows (requests joining a running batch); other came from `spawn`.
        Raises ConfigError where a cache cannot take joining rows."""
        ...


class Target(Protocol):
    """A causal LM usable as a DFlash target."""

    info: TargetInfo
    # whether padding tokens (EMPTY positions) cost nothing in `forward`'s products, so the rows
    # of a batch may verify different lengths for the price of their sum
    skips_padding: bool
    # whether `forward_tree` verifies a token tree in one pass (attention-only targets); a target
    # without it verifies chains only
    supports_trees: bool

    @property
    def device(self) -> torch.device:
        """Where the weights live: inputs go there."""

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""

    def new_cache(self, batch: int) -> TargetCache: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def head(self) -> nn.Module: ...

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: TargetCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def greedy_forward(
    target: Target,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: TargetCache,
    layer_ids: tuple[int, ...] = (),
    last_logits_only: bool = False,
    until_rejected: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`target.forward`, but the greedy ids [b, q|1] (the argmax of each position's logits, the
    first of ties) in place of the logits. A target whose class can find them without computing
    every logit (the native one: `forward_greedy`) does; any other computes the logits. Looked up
    on the class, so a wrapper that forwards attributes to a target still runs its own `forward`.
    until_rejected: a verify pass of proposals ids[:, 1:] (accept_greedy): a row's ids past its
    first position whose id differs from the next input id are not needed, and the native target
    may leave them out (-1)."""
    fast = getattr(type(target), "forward_greedy", None)
    if fast is not None:
        if until_rejected:
            return fast(target, ids, positions, cache, layer_ids, last_logits_only, until_rejected=True)
        return fast(target, ids, positions, cache, layer_ids, last_logits_only)
    logits, feats = target.forward(ids, positions, cache, layer_ids, last_logits_only)
    return greedy_ids(logits), feats


def greedy_forward_tree(
    target: Target,
    ids: torch.Tensor,
    positions: torch.Tensor,
    ancestors: torch.Tensor,
    cache: TargetCache,
    layer_ids: tuple[int, ...] = (),
    until_rejected: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`target.forward_tree`, but each node's greedy id [b, n] in place of its logits, as
    `greedy_forward` is for `forward`: a class with `forward_tree_greedy` (the native target)
    skips most of its head; any other computes the logits. until_rejected: only the ids that
    tree_verify.walk reads (along each row's accepted path) are needed; the native target may
    leave the others out (-1)."""
    fast = getattr(type(target), "forward_tree_greedy", None)
    if fast is not None:
        if until_rejected:
            return fast(target, ids, positions, ancestors, cache, layer_ids, until_rejected=True)
        return fast(target, ids, positions, ancestors, cache, layer_ids)
    logits, feats = target.forward_tree(ids, positions, ancestors, cache, layer_ids)
    return greedy_ids(logits), feats
