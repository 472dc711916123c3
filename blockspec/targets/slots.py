"""Position bookkeeping for KV caches shared by a ragged batch.

A cache holds S *slots* per row. Each slot stores the K/V of one token at an absolute position,
or is empty (-1): left padding of short prompts, or block tokens a verification rejected. Masks
are built from positions, never from slot order, so rows can commit different numbers of tokens
per step without recomputation. Empty slots are removed by `compact()` (a gather) once they are
a large enough share, and trailing empty columns are simply cropped, which is the whole story at
batch size 1.

Invariant: `positions[b]` lists the positions of the valid slots of row b in increasing order
(empty slots anywhere), and the cache tensors that follow this table have exactly S slots.
"""

from __future__ import annotations

import torch

EMPTY = -1


class SlotTable:
    """Positions of the KV slots of a batch: `positions` is [b, S] long, EMPTY where unused."""

    def __init__(self, batch: int, device: torch.device | str = "cpu") -> None:
        self.positions = torch.full((batch, 0), EMPTY, dtype=torch.long, device=device)

    @property
    def num_slots(self) -> int:
        return self.positions.shape[1]

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    def lengths(self) -> torch.Tensor:
        """Valid slots per row: [b]."""
        return (self.positions != EMPTY).sum(dim=1)

    def append(self, positions: torch.Tensor) -> None:
        """Adds slots for new tokens; positions [b, n], EMPTY for padding."""
        self.positions = torch.cat([self.positions, positions], dim=1)

    def reject(self, keep: torch.Tensor) -> None:
        """Marks the last n slots empty where keep [b, n] is False."""
        n = keep.shape[1]
        tail = self.positions[:, -n:]
        self.positions[:, -n:] = torch.where(keep, tail, torch.full_like(tail, EMPTY))

    def attention_mask(
        self,
        query_positions: torch.Tensor,
        *,
        causal: bool = True,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Boolean mask [b, 1, q, S]: True where a query may attend to a slot.

        `query_positions` [b, q] are the positions of the last q slots (already appended); causal
        and sliding-window rules compare positions. A query always sees its own slot, so padding
        queries never produce NaNs that would then be written to the cache.
        """
        q = query_positions.shape[1]
        keys = self.positions[:, None, :]  # [b, 1, S]
        queries = query_positions[:, :, None]  # [b, q, 1]
        visible = keys != EMPTY
        if causal:
            visible = visible & (keys <= queries)
        if sliding_window is not None:
            visible = visible & (queries - keys < sliding_window)
            if not causal:  # a non-causal window reaches both ways
                visible = visible & (keys - queries < sliding_window)
        s = self.num_slots
        own = torch.zeros(q, s, dtype=torch.bool, device=keys.device)
        own[torch.arange(q), s - q + torch.arange(q)] = True
        visible = visible | own
        return visible[:, None]

    def compaction_plan(self, ratio: float) -> torch.Tensor | None:
        """Slot indices [b, S'] to gather, or None when no compaction or crop is worthwhile.

        Trailing columns empty in every row are always dropped (a crop). A full gather happens
        only when empty slots exceed `ratio` of the remaining ones.
        """
        valid = self.positions != EMPTY
        used_cols = valid.any(dim=0).nonzero()
        keep_cols = int(used_cols.max()) + 1 if used_cols.numel() else 0
        lengths = valid.sum(dim=1)
        longest = int(lengths.max()) if lengths.numel() else 0
        empty = keep_cols * self.batch - int(lengths.sum())
        if keep_cols > 0 and empty > ratio * keep_cols * self.batch and longest < keep_cols:
            # Stable sort puts each row's valid slots first, in their original (position) order.
            order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
            return order[:, :longest]
        if keep_cols < self.num_slots:
            idx = torch.arange(keep_cols, device=self.positions.device)
            return idx[None].expand(self.batch, keep_cols)
        return None

    def apply(self, index: torch.Tensor) -> None:
        """Reorders/crops the table like `gather_slots` does the cache tensors."""
        self.positions = torch.gather(self.positions, 1, index)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.positions = self.positions[rows]


def gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gathers slots of a cache tensor t [b, h, S, d] with index [b, S'] -> [b, h, S', d]."""
    b, h, _, d = t.shape
    if _is_prefix(index):
        return t[:, :, : index.shape[1]]
    idx = index[:, None, :, None].expand(b, h, index.shape[1], d)
    return torch.gather(t, 2, idx)


def _is_prefix(index: torch.Tensor) -> bool:
    n = index.shape[1]
    ref = torch.arange(n, device=index.device)
    return bool((index == ref).all())
