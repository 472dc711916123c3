"""A native target's decoder layers as one kernel call (`kernels/layers.c`, bs_layers).

The Python loop of `NativeLlama.forward` calls about ten kernels per layer, and each call pays a
few microseconds of argument checks and ctypes conversion: ~1.3 ms of a 6.3 ms one-token
SmolLM2-135M forward on 2 cores. `LayerProgram` keeps every layer's weight pointers (packed or
fp32) in one int64 table and runs the loop in C with the same kernels, arguments and order, so
the outputs have the Python loop's bits (tested); the loop stays for everything the program does
not take (GPUs, bf16, autograd, prefills, ragged passes, resumed passes).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.models import rowmatmul
from blockspec.models.native.cache import StaticCache
from blockspec.models.native.qkv import QKVPlacement

LAYER_FIELDS = 20  # int64 per layer in the table: see kernels/layers.c


def _product(module: nn.Linear) -> list[int] | None:
    """The 4 table entries of one projection: its packed copy where `linear.project` would use it,
    else its fp32 weight; None where the kernel could not take it."""
    w = module.weight
    bias = module.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    b = 0 if bias is None else bias.data_ptr()
    packed = module.__dict__.get("packed")
    if packed is not None and packed.dtype == torch.float32 and packed.matches(w):
        return [packed.bits, packed.qs.data_ptr(), packed.sc.data_ptr(), b]
    if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
        return None
    return [0, w.data_ptr(), 0, b]


class LayerProgram:
    """The pointer table of one NativeLlama's layers; `run` is the forward's layer loop."""

    def __init__(self, net: nn.Module, table: torch.Tensor, owners: list[tuple[dict, str, torch.Tensor]]) -> None:
        self.net = net
        self.table = table  # [layers * LAYER_FIELDS] int64
        self.owners = owners  # (module._parameters, name, tensor) of every tensor the table points into
        self.key = self._key()

    def _key(self) -> tuple[tuple[int, int], ...]:
        # data_ptr too: `module.to()` and `param.data = ...` swap storage without a new version
        return tuple((t.data_ptr(), t._version) for _, _, t in self.owners)

    @classmethod
    def build(cls, net: nn.Module) -> LayerProgram | None:
        """The program of `net` as its weights are now, or None where the kernel cannot run it
        (no kernel, weights other than fp32 on the CPU, layers with and without q/k norms)."""
        fn = rowmatmul.kernel()
        if fn is None or not hasattr(fn, "layers"):
            return None
        layers = list(net.layers)
        if len({layer.q_norm is None for layer in layers}) > 1:
            return None
        rows: list[int] = []
        owners: list[tuple[dict, str, torch.Tensor]] = []
        for layer in layers:
            names = ("input_norm", "post_norm", "q_norm", "k_norm")
            norms = [getattr(layer, n) for n in names]
            if any(n is not None and (n.dtype != torch.float32 or not n.is_contiguous() or n.device.type != "cpu")
                   for n in norms):
                return None
            rows += [0 if n is None else n.data_ptr() for n in norms]
            owners += [(layer._parameters, name, n) for name, n in zip(names, norms) if n is not None]
            for module in (layer.qkv, layer.o, layer.gate_up, layer.down):
                entry = _product(module)
                if entry is None:
                    return None
                rows += entry
                owners += [(module._parameters, name, module._parameters[name]) for name in ("weight", "bias")
                           if module._parameters.get(name) is not None]
        return cls(net, torch.tensor(rows, dtype=torch.int64), owners)

    def kinds(self) -> list[tuple[int, ...]]:
        """Per layer, what each product (q/k/v, o, gate/up, down) reads: 0 its fp32 weight, 4 or 8
        its packed copy of that many bits."""
        rows = self.table.view(-1, LAYER_FIELDS)
        return [tuple(int(k) for k in row[4::4]) for row in rows]

    def fits(self) -> bool:
        """Whether the weights are still the ones the table points to (no parameter replaced or
        changed in place since `build`)."""
        return all(params[name] is t for params, name, t in self.owners) and self._key() == self.key

    def run(self, x: torch.Tensor, place: QKVPlacement, visible: torch.Tensor, horizon: int, cache: StaticCache,
            capture: list[int], features: torch.Tensor | None) -> torch.Tensor | None:
        """x [b, q, H] (the embeddings; consumed) -> the last layer's output [b, q, H], before the
        final norm; K/V written into `cache` as the Python loop writes them. capture [layers]:
        the column of `features` [b, q, F] that takes each layer's output, or -1. None where the
        kernel reports a failure (then nothing but repeatable K/V writes happened: the caller
        reruns its own loop)."""
        fn = rowmatmul.kernel()
        cfg = self.net.cfg
        b, q, hidden = x.shape
        t = b * q
        h, kvh, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        g = h // kvh
        store = cache.store
        k0 = store.keys[0]
        rows, _, slots, _ = k0.shape
        s_row, s_head, s_slot, _ = k0.stride()
        off = cache.row0 * s_row * k0.element_size()  # the batch's first row
        kv = torch.tensor([p + off for k, v in zip(store.keys, store.values) for p in (k.data_ptr(), v.data_ptr())],
                          dtype=torch.int64)
        xb = torch.empty_like(x)
        y = torch.empty(t, hidden)
        qkv = torch.empty(t, (h + 2 * kvh) * d)
        qs = torch.empty(b, kvh, g * q, d)
        att = torch.empty(b, kvh, g * q, d)
        o_in = torch.empty(t, h * d)
        gate_up = torch.empty(t, 2 * inter)
        act = torch.empty(t, inter)
        cap = torch.tensor(capture, dtype=torch.int64)
        eps = cfg.rms_norm_eps
        norm_eps = eps if self.net.layers[0].q_norm is not None else 0.0
        rc = fn.layers(x.data_ptr(), xb.data_ptr(), t, hidden, len(store.keys), self.table.data_ptr(), kv.data_ptr(),
                       h, kvh, d, eps, norm_eps, norm_eps, place.cos.data_ptr(), place.sin.data_ptr(),
                       place.q_rows.data_ptr(), place.q_cols.data_ptr(), b, q, place.kv_rows.data_ptr(),
                       place.kv_slots.data_ptr(), cache.batch, slots, s_row, s_head, s_slot, visible.data_ptr(),
                       horizon, self.net.scale, inter, y.data_ptr(), qkv.data_ptr(), qs.data_ptr(), att.data_ptr(),
                       o_in.data_ptr(), gate_up.data_ptr(), act.data_ptr(), cap.data_ptr(),
                       0 if features is None else features.data_ptr(),
                       0 if features is None else features.shape[-1], torch.get_num_threads())
        return x if rc == 0 else None
