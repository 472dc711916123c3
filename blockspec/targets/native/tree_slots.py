"""Where a token tree's nodes go in the native (position-indexed) cache, and what each one sees.

A tree's nodes share positions (siblings sit at the same depth), so they cannot all take the
slots of their positions as the tokens of a chain do. The tree's n real nodes take slots base ..
base + n - 1, base being the root's position (padding nodes, EMPTY, the scratch slot): first the
spine, the root and then each spine node's first child (the proposers put a node's most likely
child first, so the spine is the drafter's own chain), at base + depth, the slots of their
positions; then the other nodes in node order. A chain is all spine: every token in the slot of its
position, as in a plain verify. The positions (hence the rotary embedding) stay the nodes' own. A
node sees the committed context, slots 0 .. base - 1, and the slots of the nodes its row of
`ancestors` marks (itself and its ancestors).

For the batch-invariant C attention (cpu/csrc/attention.c) each node's keys are numbered
logically: the context 0 .. base - 1, then its ancestors by depth, itself last, exactly the keys a
plain decode of its root-to-node chain reads from slots 0 .. position. `keys` lists the slots of
the logical keys from base on, so the kernel sums them in the plain order and gets plain
decoding's bits. After the pass the cache (targets/native/cache.py, `StaticCache.reject`) copies
the accepted path's K/V to slots base .. base + k - 1, where plain decoding would have put them:
nothing for the part of the path along the spine, which is there already.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from blockspec.errors import ConfigError
from blockspec.targets.slots import EMPTY


@dataclass(frozen=True)
class HostGeometry:
    """A tree pass's geometry as host integers, per row: what `tree_slots` found on the host (CPU
    tensors), so that the cache's `note_tree` / `reject` and the verify head read it without small
    tensor operations (each costs more than a few nodes' arithmetic)."""

    slots: tuple[tuple[int, ...], ...]  # [b][n]: each node's slot (`scratch` for padding)
    base: tuple[int, ...]  # [b]
    real: tuple[tuple[bool, ...], ...]  # [b][n]
    parents: tuple[tuple[int, ...], ...]  # [b][n]: each node's parent as `tree_parents` finds it (-1: none)
    scratch: int

    def ends(self) -> list[int]:
        """Per row one past its last tree slot (its base where it holds no node)."""
        return [base + sum(real) for base, real in zip(self.base, self.real)]


@dataclass(frozen=True)
class TreeSlots:
    """One tree pass's geometry: per row [b] and per node [b, n] in node order."""

    slots: torch.Tensor  # [b, n] int64: each node's cache slot (the scratch slot for padding)
    base: torch.Tensor  # [b] int64: the root's position, the first tree slot (0 in a row of padding only)
    real: torch.Tensor  # [b, n] bool: not padding
    sees: torch.Tensor  # [b, n, n] bool: node i sees node j (itself, its ancestors; never padding)
    visible: torch.Tensor  # [b, n] int64: how many keys each node sees (context + tree nodes), 0 for padding
    # `keys()` and `end`, where they were computed with the rest (on the host): None, computed on demand
    table: torch.Tensor | None = field(default=None, repr=False, compare=False)
    known_end: int | None = field(default=None, repr=False, compare=False)
    host: HostGeometry | None = field(default=None, repr=False, compare=False)  # where computed on the host

    @property
    def end(self) -> int:
        """One past the largest tree slot: the attention reads slots below it (one host sync)."""
        if self.known_end is not None:
            return self.known_end
        ends = self.base + self.real.sum(dim=1)  # [b]
        return int(ends.max()) if ends.numel() else 0

    def with_scratch(self, scratch: int) -> TreeSlots:
        """The same geometry with padding nodes writing to `scratch` (a grown cache's)."""
        host = self.host
        if host is None:
            return replace(self, slots=torch.where(self.real, self.slots, scratch))
        if scratch == host.scratch or all(all(real) for real in host.real):
            return self
        slots = tuple(tuple(x if ok else scratch for x, ok in zip(row, real)) for row, real in zip(host.slots, host.real))
        return replace(self, slots=torch.tensor(slots, dtype=torch.int64).reshape(self.slots.shape),
                       host=replace(host, slots=slots, scratch=scratch))

    def parents(self) -> torch.Tensor | None:
        """Each node's parent [b, n] (`tree_parents` of the pass's ancestors) where the host
        geometry holds them, else None."""
        if self.host is None:
            return None
        return torch.tensor(self.host.parents, dtype=torch.int64, device=self.slots.device).reshape(self.slots.shape)

    def select_rows(self, rows: torch.Tensor) -> TreeSlots:
        """These rows (new row i = old row rows[i]), as the cache's `select_rows` keeps them."""
        return TreeSlots(*(t[rows] for t in (self.slots, self.base, self.real, self.sees, self.visible)))

    def extended(self, rows: int, scratch: int) -> TreeSlots:
        """With `rows` more rows that hold no node (rows joining the cache)."""
        b, n = self.slots.shape
        return TreeSlots(torch.cat([self.slots, self.slots.new_full((rows, n), scratch)]),
                         torch.cat([self.base, self.base.new_zeros(rows)]),
                         torch.cat([self.real, self.real.new_zeros(rows, n)]),
                         torch.cat([self.sees, self.sees.new_zeros(rows, n, n)]),
                         torch.cat([self.visible, self.visible.new_zeros(rows, n)]))

    def keys(self) -> torch.Tensor:
        """[b, n, 1 + w] int64, w the most tree nodes a node sees: per node its base, then the slots
        of the tree nodes it sees in node order (= by depth for a tree), unused entries 0: the
        table `cached_attention` takes."""
        if self.table is not None:
            return self.table
        b, n = self.slots.shape
        index = torch.arange(n, device=self.slots.device)
        order = torch.where(self.sees, index, n).sort(dim=-1).values  # [b, n, n]: seen nodes first
        w = max(1, int(self.sees.sum(dim=-1).max())) if self.sees.numel() else 1
        padded = torch.cat([self.slots, self.slots.new_zeros(b, 1)], dim=1)  # [b, n + 1]: index n -> 0
        ext = torch.gather(padded[:, None, :].expand(b, n, n + 1), 2, order[:, :, :w])  # [b, n, w]
        return torch.cat([self.base[:, None, None].expand(b, n, 1), ext], dim=2).contiguous()

    def attention_mask(self, horizon: int, groups: int) -> torch.Tensor:
        """Boolean mask [b, 1, groups * n, horizon] for PyTorch's attention over queries grouped per
        KV head (as targets/native/cache.py's `attention_mask`). Padding nodes see slot 0 only, so
        they stay finite."""
        b, n = self.slots.shape
        keys = torch.arange(horizon, device=self.slots.device)
        visible = (keys[None, None, :] < self.base[:, None, None]).expand(b, n, horizon)  # the context
        cols = torch.where(self.real, self.slots, 0)  # [b, n]; padding columns add nothing below
        tree = torch.zeros(b, n, horizon, dtype=torch.int32, device=self.slots.device)
        tree.scatter_add_(2, cols[:, None, :].expand(b, n, n), self.sees.to(torch.int32))
        visible = (visible | (tree > 0)) & self.real[:, :, None]
        visible = visible | ((keys[None, None, :] == 0) & ~self.real[:, :, None])
        if groups > 1:
            visible = visible[:, None].expand(b, groups, n, horizon).reshape(b, groups * n, horizon)
        return visible[:, None]


def tree_slots(positions: torch.Tensor, ancestors: torch.Tensor, scratch: int) -> TreeSlots:
    """The geometry of a tree pass: positions [b, n] (root first, EMPTY for padding nodes),
    ancestors [n, n] or [b, n, n] (`TokenTree.ancestor_mask`: row i marks what node i sees among
    the nodes; a node always sees itself), `scratch` the cache's scratch slot."""
    b, n = positions.shape
    if ancestors.dim() == 2:
        ancestors = ancestors[None].expand(b, n, n)
    if ancestors.shape != (b, n, n):
        raise ConfigError(f"a tree pass needs ancestors [n, n] or [b={b}, n={n}, n], got {tuple(ancestors.shape)}")
    if positions.device.type == "cpu" and ancestors.device.type == "cpu":
        return _host_tree_slots(positions, ancestors, scratch)
    return _tensor_tree_slots(positions, ancestors, scratch)


def _tensor_tree_slots(positions: torch.Tensor, ancestors: torch.Tensor, scratch: int) -> TreeSlots:
    """`tree_slots` in tensor operations (where the tensors live on an accelerator)."""
    b, n = positions.shape
    real = positions != EMPTY  # [b, n]
    has = real.any(dim=1)  # [b]
    base = torch.where(has, torch.where(real, positions, torch.iinfo(torch.int64).max).min(dim=1).values, 0)
    own = torch.eye(n, dtype=torch.bool, device=positions.device)[None]
    sees = (ancestors.to(device=positions.device, dtype=torch.bool) | own) & real[:, None, :] & real[:, :, None]
    count = sees.sum(dim=-1)  # [b, n]: a tree node's depth + 1
    spine = on_spine(sees, count) & real
    rest = real & ~spine
    slots = torch.where(spine, base[:, None] + count - 1,  # the slot of its position
                        base[:, None] + spine.sum(dim=1, keepdim=True) + rest.long().cumsum(dim=1) - 1)
    if not distinct(torch.where(real, slots, -1 - torch.arange(n, device=slots.device))):
        # `ancestors` is no tree's (a node sees a non-ancestor): no spine, node i at base + i
        slots = base[:, None] + real.long().cumsum(dim=1) - 1
    slots = torch.where(real, slots, scratch)
    visible = torch.where(real, base[:, None] + count, 0)
    return TreeSlots(slots, base, real, sees, visible)


def on_spine(sees: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[b, n] bool: the nodes whose every ancestor (and itself) is its parent's first child, the
    root included. sees [b, n, n] (ancestors and self), count [b, n] (their number). A node's
    parent is the ancestor one level up; a child is first when no earlier node has its parent."""
    b, n = count.shape
    parent = sees & (count[:, None, :] == count[:, :, None] - 1)  # [b, n, n]: node j's parent k
    siblings = torch.bmm(parent.float(), parent.float().transpose(1, 2)) > 0  # [b, n, n]: same parent
    earlier = torch.ones(n, n, dtype=torch.bool, device=sees.device).tril(-1)[None]  # k < j
    first = ~(siblings & earlier).any(dim=-1)  # [b, n]; the root has no parent: first
    return ~(sees & ~first[:, None, :]).any(dim=-1)


def distinct(values: torch.Tensor) -> bool:
    """Whether each row of values [b, n] holds n different values."""
    ordered = values.sort(dim=1).values
    return not bool((ordered[:, 1:] == ordered[:, :-1]).any())


def _host_tree_slots(positions: torch.Tensor, ancestors: torch.Tensor, scratch: int) -> TreeSlots:
    """`tree_slots` for CPU tensors, on host integers: each node's visible nodes as a bit mask.
    A tree pass is a few dozen nodes, where the tensor formulation's ~60 small operations cost
    more than the arithmetic; this one makes the same geometry (tested equal) plus the key table
    and the end, with five tensors out. A row's geometry relative to its base depends on its mask
    and padding alone (`_row_shape`), and a policy's trees take a few shapes over and over, so
    each shape is worked out once."""
    b, n = positions.shape
    pos = positions.tolist()
    if b * n * n > 256 and n <= 62:  # each row of the mask as one int64 (a few list items are cheaper read)
        masks = (ancestors.to(torch.int64) << torch.arange(n)).sum(dim=-1).tolist()  # [b][n]
    else:
        masks = [[sum(1 << j for j, v in enumerate(row) if v) for row in rows] for rows in ancestors.tolist()]
    shapes = [_row_shape(tuple(row_masks), tuple(p != EMPTY for p in row_pos))
              for row_masks, row_pos in zip(masks, pos)]
    bases = [min((p for p in row_pos if p != EMPTY), default=0) for row_pos in pos]
    tree_shaped = all(shape.shaped for shape in shapes)  # else (no tree's mask) every row in node order
    width = max(1, max((shape.width for shape in shapes), default=0))
    slots, visible, table, ends = [], [], [], []
    for shape, base in zip(shapes, bases):
        rel = shape.spine_slots if tree_shaped else shape.order_slots
        row = [scratch if x < 0 else base + x for x in rel]
        slots.append(row)
        visible.extend(base + c if c else 0 for c in shape.counts)
        ends.append(base + shape.real_count)
        for seen in shape.seen:  # per node: its base, then the slots of the nodes it sees in node order, then 0
            table.append(base)
            table.extend(row[j] for j in seen)
            table.extend([0] * (width - len(seen)))
    real_t = torch.tensor([shape.real for shape in shapes], dtype=torch.bool).reshape(b, n)
    if ancestors.dtype == torch.bool and all(shape.packed for shape in shapes):
        sees_t = ancestors  # every node real and marked as seeing itself (a packed tree's mask): as it is
    else:
        own = torch.eye(n, dtype=torch.bool)[None]
        sees_t = (ancestors.to(torch.bool) | own) & real_t[:, None, :] & real_t[:, :, None]
    host = HostGeometry(tuple(map(tuple, slots)), tuple(bases), tuple(shape.real for shape in shapes),
                        tuple(shape.parents for shape in shapes), scratch)
    # every integer output as one tensor (each creation costs more than the numbers): slots, bases,
    # visible, the key table, as views of it
    flat = torch.tensor([x for row in slots for x in row] + bases + visible + table, dtype=torch.int64)
    m = b * n
    return TreeSlots(flat[:m].view(b, n), flat[m : m + b], real_t, sees_t, flat[m + b : 2 * m + b].view(b, n),
                     table=flat[2 * m + b :].view(b, n, 1 + width), known_end=max(ends, default=0), host=host)


@dataclass(frozen=True)
class _RowShape:
    """One row's tree geometry relative to its base (`_row_shape`): slots as offsets from the
    base (-1: padding, the scratch slot), in the spine layout and in node order."""

    real: tuple[bool, ...]
    real_count: int
    counts: tuple[int, ...]  # visible tree nodes per node (a tree node's depth + 1), 0 for padding
    spine_slots: tuple[int, ...]
    order_slots: tuple[int, ...]
    shaped: bool  # the spine layout gives each real node its own slot (the mask is a tree's)
    seen: tuple[tuple[int, ...], ...]  # per node, the nodes it sees in node order
    width: int  # the most nodes a node sees
    parents: tuple[int, ...]  # `_deepest_other` of each node on the raw mask
    packed: bool  # the raw mask is the live one: padding sees nothing, a real node itself


@lru_cache(maxsize=4096)
def _row_shape(masks: tuple[int, ...], real: tuple[bool, ...]) -> _RowShape:
    """The geometry of a row whose node i's mask bits are masks[i] (bit j: it sees node j) and
    whose real nodes are `real`, relative to its base (see the module docstring)."""
    n = len(real)
    live = sum(1 << i for i in range(n) if real[i])
    sees = [(masks[i] | 1 << i) & live if real[i] else 0 for i in range(n)]
    counts = tuple(s.bit_count() for s in sees)
    level = [0] * (n + 1)  # per count: the nodes with that many visible nodes
    for i in range(n):
        level[counts[i]] |= 1 << i
    # a node's parents: the nodes it sees one level up (one in a tree); a child is first when no
    # earlier node shares a parent with it, and the spine is what sees first children only
    seen_parents, later = 0, 0
    for i in range(n):
        parents = sees[i] & level[counts[i] - 1] if counts[i] else 0
        if parents & seen_parents:
            later |= 1 << i
        seen_parents |= parents
    spine = [real[i] and not sees[i] & later for i in range(n)]
    on_spine = sum(spine)
    spine_slots, order_slots, rest, taken = [], [], 0, 0
    for i in range(n):
        taken += real[i]
        if not real[i]:
            spine_slots.append(-1)
            order_slots.append(-1)
            continue
        if spine[i]:
            spine_slots.append(counts[i] - 1)  # the slot of its position
        else:
            rest += 1
            spine_slots.append(on_spine + rest - 1)
        order_slots.append(taken - 1)
    real_slots = [x for x in spine_slots if x >= 0]
    seen = tuple(tuple(j for j in range(n) if s >> j & 1) for s in sees)
    raw = list(masks)
    return _RowShape(real, sum(real), counts, tuple(spine_slots), tuple(order_slots),
                     len(set(real_slots)) == len(real_slots), seen, max(counts, default=0),
                     tuple(_deepest_other(raw, i) for i in range(n)),
                     all(s == m for s, m in zip(sees, masks)))


def _deepest_other(masks: list[int], i: int) -> int:
    """`tree_parents` of node i on host bit masks (row j of the ancestors as bits): the other
    marked node that marks the most nodes itself, the first of ties; -1 where it marks none (and,
    as the argmax of a row of zeros, 0 where those it marks mark nothing)."""
    others, best, parent = masks[i] & ~(1 << i), 0, 0
    if not others:
        return -1
    while others:
        low = others & -others
        j = low.bit_length() - 1
        depth = masks[j].bit_count()
        if depth > best:
            best, parent = depth, j
        others ^= low
    return parent
