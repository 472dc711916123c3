"""The drafter's context cache: the `DraftContextCache` and `DraftPass` protocols a draft pass
runs against, and `DraftCache` with its `ConcatPass`, the modules' own calls (the reference, for
training, autograd and FSDP). The static drafter's slot cache (dflash/static_drafter.py) is the
other implementation; parity tests hold the two equal.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.targets.slots import EMPTY, SlotTable, gather_slots
from blockspec.targets.sdpa import sdpa

if TYPE_CHECKING:  # the modules a pass runs; they create this cache (DFlashDrafter.new_cache)
    from blockspec.dflash.drafter import DFlashDrafter, DraftAttention, DraftMLP, RMSNorm


class DraftPass(Protocol):
    """What one draft pass asks of its context cache (`DraftContextCache.open_pass`).

    `DFlashDrafter.forward` is the drafter's one layer sequence; it runs against this. The pass
    owns what depends on where K/V live: the layout of the new context tokens, each layer's
    attention over context + block (which keys each query sees, where the context K/V are
    stored) and the kernels of the products and norms around it. `DraftCache`'s pass calls the
    modules (the reference: autograd, FSDP, any device); the static cache's
    (dflash/static_drafter.py) runs the CPU kernels, and may run the whole layer stack as one
    call of the C layer program (`layers`)."""

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The new context's features [b, c, F] laid out as this pass's `attention` reads them."""
        ...

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`module(x)`."""
        ...

    def norm(self, module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """`module(x)`."""
        ...

    def attention(self, i: int, attn: DraftAttention, ctx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Layer i's attention block: y [b, q, H] (its normed input) attends to the cached context,
        the new context ctx (from `context`, fused by fc + hidden_norm) and the block; the new
        context K/V stay in the cache. Returns o_proj's output [b, q, H]."""
        ...

    def mlp(self, i: int, mlp: DraftMLP, y: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP on y [b, q, H]."""
        ...

    def layers(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor | None:
        """The whole layer stack on the block x [b, q, H] in one call (before the final norm),
        or None: the caller runs the layer loop (the same numbers)."""
        ...

    def close(self) -> None:
        """The pass is over (its K/V are the cache's now)."""
        ...


class DraftContextCache(Protocol):
    """The drafter's cache of context K/V for a batch: `DraftCache` (K/V concatenated, the
    module's reference pass) or the static drafter's slot cache (dflash/static_drafter.py). Block
    K/V never stay in it, so it has no `reject`. Every implementation has every method, so
    callers never ask a cache what it can do."""

    def lengths(self) -> torch.Tensor:
        """Valid context slots per row [b]."""
        ...

    def reserve(self, n: int, capacity: int = 0) -> None:
        """The next pass reads slots < n and writes positions below max(n, capacity)
        (preallocated caches grow; growing ones do nothing)."""
        ...

    def compact(self, ratio: float) -> None:
        """Reclaims empty slots once they exceed `ratio` of the cache (may do nothing)."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps only these rows, in this order (an empty index keeps the storage for later)."""
        ...

    def spawn(self, batch: int) -> DraftContextCache:
        """An empty cache of the same kind for `batch` new rows, which `merge` takes."""
        ...

    def merge(self, other: DraftContextCache) -> None:
        """Appends other's rows; raises ConfigError where a cache cannot take joining rows."""
        ...

    def open_pass(self, drafter: DFlashDrafter, ctx_positions: torch.Tensor, block_positions: torch.Tensor,
                  attn_mask: torch.Tensor | dict[int | None, torch.Tensor] | None = None) -> DraftPass:
        """A pass of `drafter` writing the context at ctx_positions [b, c] (EMPTY: padding) and
        reading the block at block_positions [b, q]; `attn_mask` as `DFlashDrafter.forward` takes it."""
        ...


class DraftCache:
    """Context K/V of every draft layer, per row; block K/V are never stored.

    Invariant: each layer's keys/values have `slots.num_slots` slots, and valid slots hold the
    context features of committed tokens at their absolute positions.
    """

    def __init__(self, num_layers: int, batch: int, device: torch.device | str = "cpu") -> None:
        self.slots = SlotTable(batch, device)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def lengths(self) -> torch.Tensor:
        return self.slots.lengths()

    def reserve(self, n: int, capacity: int = 0) -> None:
        """Nothing to do: the keys and values grow as passes append context to them."""

    def compact(self, ratio: float) -> None:
        index = self.slots.compaction_plan(ratio)
        if index is None:
            return
        self.slots.apply(index)
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = gather_slots(k, index)
                self.values[i] = gather_slots(self.values[i], index)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps only the given batch rows (finished requests leave the batch)."""
        self.slots.select_rows(rows)
        self.keys = [k[rows] if k is not None else None for k in self.keys]
        self.values = [v[rows] if v is not None else None for v in self.values]

    def spawn(self, batch: int) -> DraftCache:
        """A new, empty cache for `batch` rows (the same as the drafter's `new_cache`)."""
        return DraftCache(len(self.keys), batch, self.slots.positions.device)

    def merge(self, other: DraftCache) -> None:
        """Refused: rows joining a running batch need the static drafter's cache."""
        raise ConfigError(
            f"{type(self).__name__} cannot take rows joining a running batch; use the native "
            "target / standard drafter, or decode such requests in separate batches"
        )

    def open_pass(self, drafter: DFlashDrafter, ctx_positions: torch.Tensor, block_positions: torch.Tensor,
                  attn_mask: torch.Tensor | dict[int | None, torch.Tensor] | None = None) -> ConcatPass:
        return ConcatPass(self, drafter, ctx_positions, block_positions, attn_mask)


class ConcatPass:
    """`DraftCache`'s pass (see `DraftPass`): the modules' own forwards, context K/V appended to
    the cache's and concatenated with the block's for attention under a mask from the slots'
    positions. What autograd and FSDP see: every product is a module call."""

    def __init__(self, cache: DraftCache, drafter: DFlashDrafter, ctx_positions: torch.Tensor,
                 block_positions: torch.Tensor, attn_mask: torch.Tensor | dict[int | None, torch.Tensor] | None
                 ) -> None:
        b = block_positions.shape[0]
        self.cache = cache
        cache.slots.append(ctx_positions)
        self.table = SlotTable(b, block_positions.device)
        self.table.positions = torch.cat([cache.slots.positions, block_positions], dim=1)  # [b, S+q]
        self.block_positions = block_positions
        self.all_valid = bool((self.table.positions != EMPTY).all())
        self.attn_mask = attn_mask
        self.masks: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        dtype = drafter.fc.weight.dtype
        self.rope_block = drafter.rotary(block_positions, dtype)
        self.rope_ctx = drafter.rotary(ctx_positions, dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    def norm(self, module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    def attention(self, i: int, attn: DraftAttention, ctx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return attn(y, ctx, self.rope_block, self.rope_ctx, functools.partial(self._attend, i, attn))

    def mlp(self, i: int, mlp: DraftMLP, y: torch.Tensor) -> torch.Tensor:
        return mlp(y)

    def layers(self, x: torch.Tensor, ctx: torch.Tensor) -> None:
        return None

    def close(self) -> None:
        pass

    def _mask(self, i: int, attn: DraftAttention) -> torch.Tensor | None:
        key = (attn.causal, attn.sliding_window)
        if isinstance(self.attn_mask, dict):
            if attn.sliding_window not in self.attn_mask:
                raise ValueError(f"attn_mask has no mask for layer {i}'s window {attn.sliding_window}")
            return self.attn_mask[attn.sliding_window]
        if self.attn_mask is not None:
            return self.attn_mask
        if key not in self.masks:
            needs = attn.causal or attn.sliding_window is not None or not self.all_valid
            self.masks[key] = self.table.attention_mask(
                self.block_positions, causal=attn.causal, sliding_window=attn.sliding_window) if needs else None
        return self.masks[key]

    def _attend(self, i: int, attn: DraftAttention, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                k_blk: torch.Tensor, v_blk: torch.Tensor) -> torch.Tensor:
        """q [b, h, q, d] over the cached context, k/v_ctx [b, kvh, c, d] (kept) and k/v_blk
        [b, kvh, q, d] (dropped) -> [b, h, q, d]."""
        cache = self.cache
        if cache.keys[i] is not None:
            k_ctx = torch.cat([cache.keys[i], k_ctx], dim=2)
            v_ctx = torch.cat([cache.values[i], v_ctx], dim=2)
        cache.keys[i], cache.values[i] = k_ctx, v_ctx
        k = torch.cat([k_ctx, k_blk], dim=2)  # [b, kvh, S+c+q, d]
        v = torch.cat([v_ctx, v_blk], dim=2)
        groups = attn.num_heads // attn.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return sdpa(q, k, v, attn_mask=self._mask(i, attn))
