"""A preallocated KV cache whose slot index is the token's absolute position.

Each row (sequence) owns a strip of `capacity` slots per layer; the token at position p of a row
lives in slot p. A forward over positions start..start+q-1 writes those slots and attends to
slots 0..p (causal by position), so a row that rejects the tail of a verified block needs no
cleanup at all: the stale slots lie beyond its committed length, are masked until then, and the
next step overwrites them. Rows of a batch thus commit different numbers of tokens per step with
no padding, no recomputation and no compaction.

Invariant: for every row, slots below its committed length hold the K/V of its committed tokens;
slots at or beyond it hold garbage that no query can see (they are only read after being
rewritten). Slot `capacity` is a scratch slot absorbing writes for padding positions (EMPTY).

A token tree's pass (`NativeTarget.forward_tree`) is the one exception to "slot = position": its
nodes share positions, so they take slots root .. root + n - 1 (targets/native/tree_slots.py: the
spine at its positions' slots, then the rest), and the cache remembers those slots until `reject`
copies the accepted path's K/V to slots root .. root + k - 1, the slots of their positions. After
that the invariant above holds again.

`StaticCache` is a window of rows of a shared `KVStore`: the engine keeps the running batch in
rows 0..n-1 and prefills joining requests straight into rows n.. (`spawn` / `merge`), so joining
and leaving copy at most the rows that move.
"""

from __future__ import annotations

import torch

from blockspec.targets.native.tree_slots import TreeSlots
from blockspec.targets.slots import EMPTY


def _grow(n: int, floor: int = 64) -> int:
    size = floor
    while size < n:
        size *= 2
    return size


class KVStore:
    """Per-layer keys and values, each [rows, kv_heads, capacity + 1, head_dim] (zero-filled):
    views of one tensor `kv` [2, layers, rows, kv_heads, capacity + 1, head_dim] (keys, then
    values), so a copy that touches every layer (a tree pass's `reject`) is one indexing operation
    instead of two per layer."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        rows: int = 1,
        capacity: int = 64,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.rows, self.capacity = 0, 0
        self.kv = torch.zeros(2, num_layers, 0, kv_heads, 1, head_dim, dtype=dtype, device=self.device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.ensure(rows, capacity)

    def ensure(self, rows: int, capacity: int) -> None:
        """Grows (geometrically, copying the old contents) to at least rows x capacity."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        new_rows = max(rows, self.rows, 1)
        new_cap = max(_grow(capacity), self.capacity)
        kv = torch.zeros(2, self.num_layers, new_rows, self.kv_heads, new_cap + 1, self.head_dim, dtype=self.dtype,
                         device=self.device)
        if self.rows:
            kv[:, :, : self.rows, :, : self.capacity] = self.kv[:, :, :, :, : self.capacity]
        self.kv = kv
        self.keys, self.values = list(kv[0].unbind(0)), list(kv[1].unbind(0))
        self.rows, self.capacity = new_rows, new_cap

    def nbytes(self) -> int:
        return 2 * sum(k.numel() * k.element_size() for k in self.keys)


class StaticCache:
    """Rows [row0, row0 + batch) of a KVStore; the cache object a native forward takes.

    `reserve(n)` must precede a forward whose largest position is n - 1: it grows the store and
    sets the attention horizon (slots 0..n-1 are read). Without it the forward derives the
    horizon from its positions (one host sync).
    """

    def __init__(self, store: KVStore, row0: int = 0, batch: int = 0) -> None:
        self.store = store
        self.row0 = row0
        self.batch = batch
        self.horizon = 0  # slots [0, horizon) may hold data of some row
        self.fresh = False  # reserve() was called for the coming forward
        # a forward has written into it: later passes continue a generation (the one-call layer
        # program checks the model's weights only at a cache's first pass: targets/native/backends.py)
        self.written = False
        self.length = torch.zeros(batch, dtype=torch.long, device=store.device)  # committed per row
        self.tree: TreeSlots | None = None  # the last forward's tree slots, until `reject`

    # ---- storage --------------------------------------------------------------------------------
    @property
    def scratch(self) -> int:
        return self.store.capacity

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [batch, kv_heads, capacity + 1, head_dim] of layer i."""
        rows = slice(self.row0, self.row0 + self.batch)
        return self.store.keys[i][rows], self.store.values[i][rows]

    def reserve(self, n: int, capacity: int = 0) -> None:
        """Next forward reads slots < n (its largest query position is n - 1); it may write
        positions below max(n, capacity)."""
        self.store.ensure(self.row0 + self.batch, max(n, capacity))
        self.horizon = n
        self.fresh = True

    def write_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Slots for positions [b, q]: the position itself, the scratch slot for EMPTY."""
        return torch.where(positions == EMPTY, torch.full_like(positions, self.scratch), positions)

    def note_written(self, positions: torch.Tensor) -> None:
        """Called by the forward: rows now hold data up to their largest position."""
        self.length = torch.maximum(self.length, positions.max(dim=1).values + 1)
        self.fresh = False
        self.written = True
        self.tree = None

    def note_tree(self, tree: TreeSlots) -> None:
        """Called by a tree pass instead of `note_written`: rows hold their nodes in slots
        base .. base + nodes - 1 until `reject` keeps one path of them."""
        if tree.host is not None:  # on host integers: a few nodes' arithmetic, no tensor operations
            old = self.length.tolist()
            self.length = torch.tensor([end if any(real) else length for end, real, length
                                        in zip(tree.host.ends(), tree.host.real, old)],
                                       dtype=self.length.dtype, device=self.length.device)
        else:
            has = tree.real.any(dim=1)
            self.length = torch.where(has, tree.base + tree.real.sum(dim=1), self.length)
        self.fresh = False
        self.written = True
        self.tree = tree

    # ---- the TargetCache protocol -----------------------------------------------------------------
    def lengths(self) -> torch.Tensor:
        return self.length

    def reject(self, keep: torch.Tensor) -> None:
        """Block slots beyond each row's kept prefix are simply forgotten (overwritten later).

        After a tree pass keep [b, n] marks the accepted path's nodes (root first, any nodes of
        the tree): their K/V move to slots base .. base + k - 1 in every layer (already computed
        at those positions), the row's length becomes base + k, and the other nodes' slots lie
        beyond it. Nodes already there (the path's part along the spine) do not move."""
        tree, self.tree = self.tree, None
        if tree is None:
            self.length = self.length - (~keep).sum(dim=1)
            return
        if tree.host is not None:
            self._reject_host(tree, keep)
            return
        keep = keep.to(device=tree.slots.device, dtype=torch.bool) & tree.real  # [b, n]
        kept = keep.sum(dim=1)  # [b]
        self.length = torch.where(tree.real.any(dim=1), tree.base + kept, self.length)
        rank = keep.long().cumsum(dim=1) - 1
        dst = tree.base[:, None] + rank  # [b, n]: where a kept node goes
        move = keep & (tree.slots != dst)
        if not bool(move.any()):
            return
        rows, nodes = move.nonzero(as_tuple=True)  # [m]
        self.move_slots(rows, tree.slots[rows, nodes], dst[rows, nodes])

    def _reject_host(self, tree: TreeSlots, keep: torch.Tensor) -> None:
        """`reject` after a pass whose geometry is on the host (`TreeSlots.host`): the same lengths
        and moves from host integers, one copy only where a kept node is not in its place."""
        host = tree.host
        if tuple(keep.shape) != tuple(tree.slots.shape):
            raise ValueError(f"reject after a tree pass takes keep [{', '.join(map(str, tree.slots.shape))}] "
                             f"(one flag per node), got {tuple(keep.shape)}")
        lengths = self.length.tolist()
        rows, src, dst = [], [], []
        for r, (flags, real, slots, base) in enumerate(zip(keep.tolist(), host.real, host.slots, host.base)):
            kept = 0
            for ok, is_real, slot in zip(flags, real, slots):
                if ok and is_real:
                    if slot != base + kept:
                        rows.append(r)
                        src.append(slot)
                        dst.append(base + kept)
                    kept += 1
            if any(real):
                lengths[r] = base + kept
        self.length = torch.tensor(lengths, dtype=self.length.dtype, device=self.length.device)
        if rows:
            device = tree.slots.device
            self.move_slots(*(torch.tensor(v, dtype=torch.int64, device=device) for v in (rows, src, dst)))

    def move_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies the K/V of slot src[i] to slot dst[i] in row rows[i] (all [m]), every layer in one
        indexing operation over the store's stacked tensor; every source is read before any write."""
        kv = self.store.kv[:, :, self.row0 : self.row0 + self.batch]  # [2, layers, batch, kv_heads, slots, head_dim]
        kv[:, :, rows, :, dst] = kv[:, :, rows, :, src]

    def compact(self, ratio: float) -> None:
        """Nothing to do: rejected slots are reused in place."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps the given rows (new row i = old row rows[i]), copying only rows that move."""
        order = [int(r) for r in rows.tolist()] if isinstance(rows, torch.Tensor) else list(rows)
        span = slice(0, max(1, min(self.horizon, self.store.capacity)))
        moves = [(i, r) for i, r in enumerate(order) if i != r]
        in_place = all(r >= len(order) for _, r in moves) or order == sorted(order)
        for i in range(self.store.num_layers):
            k, v = self.layer(i)
            if not moves:
                break
            if in_place:  # sources are never earlier destinations: copy row by row
                for dst, src in moves:
                    k[dst, :, span] = k[src, :, span]
                    v[dst, :, span] = v[src, :, span]
            else:
                index = torch.tensor(order, device=k.device)
                k[: len(order), :, span] = k[index, :, span]
                v[: len(order), :, span] = v[index, :, span]
        index = torch.as_tensor(order, dtype=torch.long, device=self.length.device)
        self.length = self.length[index]
        self.batch = len(order)
        if self.tree is not None:  # rows leaving between a tree pass and its `reject`
            self.tree = self.tree.select_rows(index.to(self.tree.slots.device))

    def spawn(self, batch: int) -> StaticCache:
        """A cache for `batch` new rows right after this one's, in the same store."""
        self.store.ensure(self.row0 + self.batch + batch, self.store.capacity)
        return StaticCache(self.store, self.row0 + self.batch, batch)

    def merge(self, other: StaticCache) -> None:
        """Appends other's rows to this cache (no copy when other came from `spawn`)."""
        dst = self.row0 + self.batch
        if other.store is not self.store or other.row0 != dst:
            self.store.ensure(dst + other.batch, other.store.capacity)
            span = min(other.horizon or other.store.capacity, other.store.capacity)
            for i in range(self.store.num_layers):
                self.store.keys[i][dst : dst + other.batch, :, :span] = other.store.keys[i][
                    other.row0 : other.row0 + other.batch, :, :span
                ]
                self.store.values[i][dst : dst + other.batch, :, :span] = other.store.values[i][
                    other.row0 : other.row0 + other.batch, :, :span
                ]
        self.batch += other.batch
        self.horizon = max(self.horizon, other.horizon)
        if self.tree is not None:  # rows joining between a tree pass and its `reject` hold no node
            self.tree = self.tree.extended(other.batch, self.scratch)
        self.length = torch.cat([self.length, other.length.to(self.length.device)])
        self.fresh = False
        self.written = self.written or other.written


def attention_mask(
    query_positions: torch.Tensor, horizon: int, groups: int, *, window_end: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean mask [b, 1, groups * q, horizon] for queries grouped per KV head.

    Causal by position: slot j is visible to a query at position p when j <= p (EMPTY queries
    see slot 0, so they stay finite). With `window_end` [b] a query instead sees every slot
    below window_end (bidirectional blocks, as the drafter attends).
    """
    b, q = query_positions.shape
    keys = torch.arange(horizon, device=query_positions.device)
    if window_end is None:
        visible = keys[None, None, :] <= query_positions.clamp_min(0)[:, :, None]  # [b, q, S]
    else:
        visible = (keys[None, :] < window_end[:, None])[:, None, :].expand(b, q, horizon)
    if groups > 1:
        visible = visible[:, None].expand(b, groups, q, horizon).reshape(b, groups * q, horizon)
    return visible[:, None]
