"""A forward's decoder layers as one kernel call (`cpu/csrc/layers.c`, bs_layers / bs_layers_bf16).

The Python loops of `NativeLlama.forward` and of the drafter's static pass (`StaticPass`) call about ten
kernels per layer, and each call pays a few microseconds of argument checks and ctypes
conversion, a large share of a small model's one-token forward (docs/DESIGN.md section 12).
A `LayerProgram` keeps
every layer's weight pointers (packed or not) in one int64 table and runs the loop in C with the
same kernels, arguments and order, so the outputs have the Python loop's bits (tested); the
loops stay for everything a program does not take (GPUs, other dtypes, autograd, prefills,
ragged passes, resumed passes, causal or windowed draft layers).
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from blockspec.cpu import kernels
from blockspec.cpu.int8 import Int8Weight
from blockspec.cpu.qkv import QKVPlacement

DTYPES = (torch.float32, torch.bfloat16)
DIMS = 19  # the int64 geometry values `run` passes (cpu/csrc/layers.c's D_COUNT; `build` checks)
INT8_KIND = 16  # a product's kind in the table: 16 + bits for an integer product (cpu/csrc/layers.c)
ENV = "BLOCKSPEC_LAYER_LOOP"  # "0": keep the Python loops (to compare, or to rule the C loop out)
# A thread's scratch tensors are kept for its SCRATCH_SHAPES most recently used pass shapes: a
# lone row's verify passes come in a dozen widths (chains and trees of 2-16 tokens) beside the
# plain step's, and with four kept, 45% of them allocated their nine tensors afresh (GSM8K,
# batch 1 and 8). Sets larger than SCRATCH_KEEP_BYTES (a long prompt's chunks) are not kept: their
# pass dwarfs the allocation, and holding them would pin their memory.
SCRATCH_SHAPES = 24
SCRATCH_KEEP_BYTES = 4 << 20
# Layer pointer tables kept (`_layer_pointers`), the least recently used dropped first: one per store
# and row window (a join prefills into rows past the running ones), for the few engines a process steps
POINTER_SETS = 16
Watched = tuple[dict | None, str | None, torch.Tensor]  # (holder such as module._parameters, key, tensor)


class KVStoreRows(Protocol):
    """What `run` reads of a position-indexed KV cache (targets/native/cache.py's StaticCache):
    rows [row0, row0 + batch) of a store whose per-layer `keys` / `values` are
    [rows, kv_heads, capacity + 1, head_dim]."""

    store: object
    row0: int
    batch: int


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the kernel reads it: norm weights (q/k norms may be None) and the four
    products q/k/v, o, gate/up, down as (packed copy or None, weight [out, in], bias or None); the
    packed copy may be an Int8Weight (the int8 compute mode: the product is then an integer one,
    cpu/int8.py)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    products: tuple[tuple[object | None, torch.Tensor, torch.Tensor | None], ...]


def _layout() -> tuple[int, int, int] | None:
    fn = kernels.kernel()
    if fn is None or not hasattr(fn, "layers_layout"):
        return None
    out = torch.zeros(3, dtype=torch.int64)
    fn.layers_layout(out.data_ptr())
    return int(out[0]), int(out[1]), int(out[2])


class LayerProgram:
    """The pointer table of one model's layers (`build`); `run` is a forward's layer loop."""

    def __init__(self, dtype: torch.dtype, table: torch.Tensor, eps: tuple[float, float, float],
                 watched: list[Watched], keep: list[object]) -> None:
        self.dtype = dtype
        self.table = table  # [layers * fields] int64
        self.eps = eps  # rms, q-norm, k-norm
        self.watched = watched
        self.keep = keep  # what the table points into (packed copies, views of the weights), kept alive
        # `fits` reads every weight (180 for SmolLM2) through `map`: ~22 us hot against ~29 for a
        # loop over the triples, 150-180 us cold after a pass streamed the weights
        self._tensors = [t for _, _, t in watched]
        held = [(owner, name, t) for owner, name, t in watched if owner is not None]
        self._owners, self._names, self._owned = (list(x) for x in zip(*held)) if held else ([], [], [])
        self.key = self._key()
        # the layers' K/V pointers [2 layers] by (store tensor's address, shape and dtype, byte offset):
        # read from every layer's views at each pass, they took ~0.07 ms of a 4-5 ms step
        self._pointers: dict[tuple, torch.Tensor] = {}
        # per thread (its ident), the kernel's scratch tensors of its recent shapes (`_scratch`):
        # allocating all nine at every pass cost measurable time (docs/DESIGN.md, tuning log)
        self._scratches: dict[int, dict[tuple, tuple[torch.Tensor, ...]]] = {}

    def _key(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # data_ptr too: `module.to()` and `param.data = ...` swap storage without a new version
        return tensor_state(self._tensors)

    @classmethod
    def build(cls, layers: list[LayerWeights], eps: tuple[float, float, float],
              watched: list[Watched]) -> LayerProgram | None:
        """The program of these layers, or None where the kernel cannot run them (no kernel, a
        dtype other than fp32 or bf16, tensors not contiguous on the CPU, layers with and without
        q/k norms) or $BLOCKSPEC_LAYER_LOOP is 0. `watched`: the tensors whose change (`fits`) means the layers must be read
        again, each with the dict and key it is held under (a module's `_parameters`), if any."""
        layout = _layout()
        if layout is None or not layers or os.environ.get(ENV, "1") == "0":
            return None
        dims, fields, product_fields = layout
        dtype = layers[0].input_norm.dtype
        if dtype not in DTYPES or len({layer.q_norm is None for layer in layers}) > 1:
            return None

        def plain(t: torch.Tensor | None) -> bool:
            return t is None or (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu")

        rows: list[int] = []
        keep: list[object] = []
        for layer in layers:
            norms = (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
            if not all(plain(n) for n in norms):
                return None
            rows += [0 if n is None else n.data_ptr() for n in norms]
            # views of what the table points into: bytes that stay alive when a parameter is given
            # new storage between the checks (`fits`, at a cache's first pass)
            keep += [n.detach() for n in norms if n is not None]
            for packed, weight, bias in layer.products:
                if not plain(weight) or (bias is not None and (bias.dim() != 1 or not plain(bias))):
                    return None
                if bias is not None:
                    # the kernel adds an fp32 bias, as kernels._product
                    bias = bias.detach() if dtype == torch.float32 else bias.float().contiguous()
                    keep.append(bias)
                if isinstance(packed, Int8Weight):
                    if dtype != torch.float32 or not packed.matches(weight):
                        return None
                    keep.append(packed)
                    rows += [INT8_KIND + packed.bits, packed.qs.data_ptr(), packed.d.data_ptr(),
                             0 if bias is None else bias.data_ptr(), 0 if packed.m is None else packed.m.data_ptr()]
                    continue
                use = packed is not None and packed.dtype == dtype and packed.matches(weight)
                keep.append(weight.detach())
                if use:
                    keep.append(packed)
                rows += [packed.bits if use else 0, packed.qs.data_ptr() if use else 0,
                         packed.sc.data_ptr() if use else 0, 0 if bias is None else bias.data_ptr(),
                         weight.data_ptr()]
        if len(rows) != fields * len(layers) or fields != 4 + 4 * product_fields or dims != DIMS:
            return None
        return cls(dtype, torch.tensor(rows, dtype=torch.int64), eps, watched, keep)

    def kinds(self) -> list[tuple[int, ...]]:
        """Per layer, what each product (q/k/v, o, gate/up, down) reads: 0 the weight, 4 or 8 its
        packed copy of that many bits (bf16: for products of few rows), 20 or 24 its integer form
        of 4 or 8 bits (the int8 mode)."""
        _, fields, pf = _layout()
        rows = self.table.view(-1, fields)
        return [tuple(int(row[4 + i * pf]) for i in range(4)) for row in rows]

    def _layer_pointers(self, store: object, off: int) -> torch.Tensor:
        """Each layer's key and value pointers [2 layers] int64 into `store`, `off` bytes on."""
        whole = getattr(store, "kv", None)  # KVStore: every layer's keys and values are views of it
        key = None if whole is None else (whole.data_ptr(), tuple(whole.shape), whole.dtype, off)
        kv = self._pointers.pop(key, None) if key is not None else None  # re-inserted: most recent last
        if kv is None:
            kv = torch.tensor([p + off for k, v in zip(store.keys, store.values) for p in (k.data_ptr(), v.data_ptr())],
                              dtype=torch.int64)
        if key is not None:
            self._pointers[key] = kv
            if len(self._pointers) > POINTER_SETS:  # stores come and go with batches: keep the recent ones
                self._pointers.pop(next(iter(self._pointers)))
        return kv

    def _scratch(self, dtype: torch.dtype, t: int, tokens: int, b: int, q: int, hidden: int, width: int, h: int,
                 kvh: int, d: int, inter: int) -> tuple[torch.Tensor, ...]:
        """The kernel's scratch tensors for a pass of these sizes (kin, acc, xb, qkv, qs, att, o_in,
        gate_up, act), kept per calling thread for its SCRATCH_SHAPES most recently used shapes: a
        plain step's are the same at every step. Nothing in them outlives a call (the kernel writes
        before it reads)."""
        key = (dtype, t, tokens, b, q, hidden, width, h, kvh, d, inter)
        mine = self._scratches.get(threading.get_ident())
        if mine is None:
            if len(self._scratches) >= 8:  # threads come and go (engines, tests): keep the recent ones
                self._scratches.pop(next(iter(self._scratches)))
            mine = self._scratches[threading.get_ident()] = {}
        bufs = mine.pop(key, None)  # re-inserted below: the dict's order is least recently used first
        if bufs is None:
            g = h // kvh
            acc = torch.empty(max((t + tokens) * width, tokens * 2 * inter, tokens * hidden) if dtype != torch.float32
                              else 1)
            bufs = (torch.empty(t + tokens, hidden, dtype=dtype), acc, torch.empty(b, q, hidden, dtype=dtype),
                    torch.empty(t + tokens, width, dtype=dtype), torch.empty(b, kvh, g * q, d, dtype=dtype),
                    torch.empty(b, kvh, g * q, d), torch.empty(tokens, h * d, dtype=dtype),
                    torch.empty(tokens, 2 * inter, dtype=dtype), torch.empty(tokens, inter, dtype=dtype))
            if sum(buf.nbytes for buf in bufs) > SCRATCH_KEEP_BYTES:
                return bufs
        mine[key] = bufs
        if len(mine) > SCRATCH_SHAPES:
            mine.pop(next(iter(mine)))
        return bufs

    def fits(self) -> bool:
        """Whether the weights are still the ones the table was built from (none replaced,
        changed in place or given new storage since `build`). The native target asks at a
        cache's first pass, not at every decoding step; the table's bytes stay alive either way
        (`keep`)."""
        return still_held(self._owners, self._names, self._owned) and self._key() == self.key

    def run(self, x: torch.Tensor, place: QKVPlacement, visible: torch.Tensor, horizon: int, cache: KVStoreRows,
            *, inter: int, scale: float, ctx: torch.Tensor | None = None, capture: list[int] | None = None,
            features: torch.Tensor | None = None, packed_max: int = 0,
            start: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [b, q, H] (consumed) -> the last layer's output [b, q, H], before the final norm; K/V
        written into `cache` as the Python loop writes them. ctx [t, H]: rows that go through each
        layer's q/k/v projection before the block's and have no queries (the drafter's context;
        `place` then starts its queries at t). capture [layers]: the column of `features`
        [b, q, F] that takes each layer's output, or -1. packed_max: the most rows a bf16 product
        reads its packed copy for. start [b, q]: each query's first key (cached_attention), or
        None. tree [b, q, 1 + w]: a token tree's keys (cached_attention), or None. None where
        the kernel reports a failure (then nothing but repeatable K/V writes happened: the
        caller reruns its own loop)."""
        fn = kernels.kernel()
        dtype = self.dtype
        b, q, hidden = x.shape
        tokens = b * q
        t = 0 if ctx is None else ctx.shape[0]
        h, kvh, d = place.heads, place.kv_heads, place.head_dim
        width = (h + 2 * kvh) * d
        store = cache.store
        k0 = store.keys[0]
        s_row, s_head, s_slot, _ = k0.stride()
        off = cache.row0 * s_row * k0.element_size()  # the batch's first row
        kv = self._layer_pointers(store, off)
        layers = len(store.keys)
        dims = [t, tokens, hidden, layers, h, kvh, d, inter, b, q, cache.batch, k0.shape[2], s_row, s_head, s_slot,
                horizon, 0 if features is None else features.shape[-1], packed_max,
                0 if tree is None else tree.shape[-1] - 1]
        assert len(dims) == DIMS  # the order of cpu/csrc/layers.c's D_* values
        dims_t = torch.tensor(dims, dtype=torch.int64)  # named: a temporary would be freed before the call
        kin, acc, xb, qkv, qs, att, o_in, gate_up, act = self._scratch(dtype, t, tokens, b, q, hidden, width, h, kvh,
                                                                       d, inter)
        if ctx is not None:
            kin[:t] = ctx
        cap = torch.tensor(capture if capture is not None else [-1] * layers, dtype=torch.int64)
        scal = torch.tensor([*self.eps, scale], dtype=torch.float32)
        rc = (fn.layers if dtype == torch.float32 else fn.layers_bf16)(
            x.data_ptr(), xb.data_ptr(), dims_t.data_ptr(), scal.data_ptr(),
            self.table.data_ptr(), kv.data_ptr(), place.cos.data_ptr(), place.sin.data_ptr(), place.q_rows.data_ptr(),
            place.q_cols.data_ptr(), place.kv_rows.data_ptr(), place.kv_slots.data_ptr(), visible.data_ptr(),
            0 if start is None else start.data_ptr(), 0 if tree is None else tree.data_ptr(), kin.data_ptr(), qkv.data_ptr(), qs.data_ptr(), att.data_ptr(),
            o_in.data_ptr(), gate_up.data_ptr(), act.data_ptr(), acc.data_ptr(), cap.data_ptr(),
            0 if features is None else features.data_ptr(), torch.get_num_threads())
        return x if rc == 0 else None


def tensor_state(tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each tensor's storage address and version: what changes when one is changed in place or
    given new storage (`module.to()` and `param.data = ...` swap storage without a new version).
    Read through `map`: a check reads every weight of a model with it."""
    return tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(operator.attrgetter("_version"), tensors))


def still_held(owners: list[dict], names: list[str], tensors: list[torch.Tensor]) -> bool:
    """Whether owners[i][names[i]] is still tensors[i] for every i (no parameter replaced)."""
    return all(map(operator.is_, map(operator.getitem, owners, names), tensors))


def parameters_of(modules: list[nn.Module]) -> list[Watched]:
    """Every direct parameter of these modules, held where `LayerProgram.fits` can see a
    replacement."""
    return [(m._parameters, name, p) for m in modules for name, p in m._parameters.items() if p is not None]


def target_program(net: nn.Module, integer: Callable[[nn.Linear], Int8Weight | None] | None = None
                   ) -> LayerProgram | None:
    """The program of a NativeLlama's layers (its packed copies where it has them, or with
    `integer` the integer form it gives of each projection: the int8 mode), or None."""

    def form(m: nn.Linear) -> object | None:
        w = None if integer is None else integer(m)
        return w if w is not None else m.__dict__.get("packed")

    layers = [LayerWeights(layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                           tuple((form(m), m.weight, m.bias)
                                 for m in (layer.qkv, layer.o, layer.gate_up, layer.down)))
              for layer in net.layers]
    eps = net.cfg.rms_norm_eps
    modules = [m for layer in net.layers for m in (layer, layer.qkv, layer.o, layer.gate_up, layer.down)]
    return LayerProgram.build(layers, (eps, eps, eps), parameters_of(modules))
