"""The DFlash drafter's pass over a position-indexed static context cache, on the CPU kernels.

`DFlashDrafter.forward` (dflash/drafter.py) is the drafter's one layer sequence; a
`StaticDraftCache` gives it a `StaticPass` (the `DraftPass` protocol), the inference backend the
engine runs, proven equal to `DraftCache`'s module pass by parity tests:

- Storage: the context K/V of position p live in slot p of the cache, and the block's K/V are
  written into the slots of the block positions start..start+q-1 for the duration of the pass.
  Those slots hold either nothing yet or context K/V of tokens a verification rejected; the
  block K/V are overwritten by the real context K/V once the tokens there are committed.
  Queries see slots below start + q (the committed context plus the whole block), so at batch
  size 1 the pass needs no mask and no concatenation.
- Kernels: q/k/v and gate/up as one product each (`StaticWeights`), the context flat over its
  real tokens, one call per layer for q/k norms, rope and the K/V writes (cpu/qkv.py), the CPU
  attention kernel (`cached_attention`), fused norms; PyTorch's operators where a kernel does
  not take a tensor (the same bits, tested).
- Whole pass: the C layer program (cpu/program.py) runs a DFlash drafter's layer stack in one
  call where it can (`StaticPass.layers`); DFlash 2's block convolutions keep the layer loop.
- The int8 mode (`DFlashDrafter.use_compute`, an fp32 drafter beside an int8 target): fc and
  every layer product multiply 8-bit activations by integer weights (cpu/int8.py; Q4_1's 4-bit
  forms by default, Q8_0's with `bits=8`), in the program and in the loop alike (the same bits:
  the products are row-wise). Proposals change, the output never does (the target verifies);
  the pass streams about an eighth (4 bits) or a quarter (8 bits) of fp32's weight bytes.

`StaticDrafter` prepares the weights and makes the caches; calling it is the module's forward
under inference mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.cpu import kernels
from blockspec.cpu.int8 import Int8Weight, int8_linear, quantize_weight
from blockspec.cpu.linear import linear, project
from blockspec.cpu.program import LayerProgram, LayerWeights, parameters_of, still_held, tensor_state
from blockspec.cpu.qkv import QKVPlacement, block_places
from blockspec.dflash.drafter import DFlashDrafter, DraftAttention, DraftMLP, RMSNorm
from blockspec.targets.native.attention import cached_attention, visible_keys, visible_keys_fit
from blockspec.targets.native.cache import KVStore, StaticCache, attention_mask
from blockspec.targets.slots import EMPTY
from blockspec.targets.native.llama import padding_index, rms_norm, rope_bqhd, silu_mul
from blockspec.targets.sdpa import sdpa


Fused = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]  # w_qkv, b_qkv, w_gate_up
Int8Layer = tuple[Int8Weight, Int8Weight, Int8Weight, Int8Weight]  # q/k/v, o, gate/up, down


@dataclass(frozen=True)
class Int8Forms:
    """The int8 mode's weights of a drafter (`StaticWeights.integer`): fc's and, per layer, the
    four products' integer forms (cpu/int8.py's `quantize_weight`, in the drafter's `int8_bits`),
    read by the pass and the program."""

    fc: Int8Weight
    layers: list[Int8Layer]


class StaticWeights:
    """A drafter's weights as the static pass reads them: per layer q/k/v stacked [(h + 2 kvh) d,
    H] (and bias) and gate/up stacked [2 I, H], four products per layer instead of nine (fewer
    small calls in a pass that is short at batch 1), and the C layer program built from them.
    Both are rebuilt when a weight changes (training evaluates a live drafter)."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.module = drafter
        self.layer_kinds = [(layer.self_attn.causal, layer.self_attn.sliding_window) for layer in drafter.layers]
        self.plain = all(not causal and window is None for causal, window in self.layer_kinds)
        # bidirectional layers whose windows reach further than a pass can look act as plain ones
        self.reach = None if any(causal for causal, _ in self.layer_kinds) else min(
            (window for _, window in self.layer_kinds if window is not None), default=None)
        # one window for every (bidirectional) layer: the CPU kernel takes each query's first key
        self.window = self.reach if {w for _, w in self.layer_kinds} == {self.reach} else None
        self._fused: tuple[tuple, list[Fused]] | None = None  # (weight versions, per layer weights)
        # (the fused weights it read, the int8 forms it read, program)
        self._program: tuple[list, Int8Forms | None, LayerProgram | None] | None = None
        self._int8: tuple[list, tuple, Int8Forms | None] | None = None  # (fused weights, identities, forms)
        self._slot_cache: tuple | None = None  # (layers, their count, fused slots, other slots): `_slots`
        # `read`: every parameter (layers, their count, dicts, names, tensors), the state they were
        # last read in and what that read gave, and the state the program was last known good at
        self._every: tuple | None = None
        self._read_key: tuple | None = None
        self._read: tuple[list[Fused], Int8Forms | None] | None = None
        self._program_key: tuple | None = None

    def _slots(self) -> tuple[list[tuple[nn.Module, str]], list[tuple[nn.Module, str]]]:
        """(module, parameter name) of each weight the fused weights read, and of the others the
        int8 forms read; gathered again only when the layers are replaced. A pass reads each
        through its module's parameter table, not nn.Module's attribute lookup: the ~30 weights'
        lookups cost ~0.1 ms, a tenth of a lone row's draft pass on a CPU."""
        m = self.module
        layers = m._modules["layers"]
        if self._slot_cache is None or self._slot_cache[0] is not layers or self._slot_cache[1] != len(layers):
            fused = [(mod, name) for layer in layers
                     for mod in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
                     for name in ("weight", "bias")]
            fused += [(mod, "weight") for layer in layers for mod in (layer.mlp.gate_proj, layer.mlp.up_proj)]
            plain = [(m.fc, "weight")] + [(mod, "weight") for layer in layers
                                          for mod in (layer.self_attn.o_proj, layer.mlp.down_proj)]
            self._slot_cache = (layers, len(layers), fused, plain)
        return self._slot_cache[2], self._slot_cache[3]

    @staticmethod
    def _versions(slots: list[tuple[nn.Module, str]]) -> tuple:
        """Each weight's storage and version: what changes when a weight is replaced or updated."""
        return tensor_state([p for p in (mod._parameters[name] for mod, name in slots) if p is not None])

    def read(self, check: bool = True) -> tuple[list[Fused], Int8Forms | None]:
        """`fused()` and `integer(fused)`, what a pass reads, from one check over every parameter of
        the drafter (its storage and version) instead of one check per table: where none changed
        since the last read, what that read gave; and while that holds, the program built from
        them needs no check of its own (`program`). Without `check`, the last read's (a pass
        continuing rows whose first pass checked: ~50 us a drafting step, read cold after the
        target's pass streamed its weights)."""
        if not check and self._read is not None:
            return self._read
        m = self.module
        key = (self._every_key(), m.compute, m.int8_bits)  # the forms follow the mode and its bits too
        if self._read is None or key != self._read_key:
            fused = self.fused()
            self._read, self._read_key = (fused, self.integer(fused)), key
        return self._read

    def _every_key(self) -> tuple:
        """The storage and version of every parameter of the drafter, listed again when the layers
        are replaced (as `_slots`) or a parameter is."""
        layers = self.module._modules["layers"]
        every = self._every
        if (every is None or every[0] is not layers or every[1] != len(layers)
                or not still_held(*every[2:])):
            held = [(m._parameters, name, p) for m in self.module.modules() for name, p in m._parameters.items()
                    if p is not None]
            every = self._every = (layers, len(layers), [d for d, _, _ in held], [n for _, n, _ in held],
                                   [t for _, _, t in held])
        return tensor_state(every[4])

    def fused(self) -> list[Fused]:
        """Per layer (w_qkv, b_qkv, w_gate_up), current with the module's weights."""
        key = self._versions(self._slots()[0])
        if self._fused is None or self._fused[0] != key:
            fused = []
            for layer in self.module.layers:
                a, mlp = layer.self_attn, layer.mlp
                projs = (a.q_proj, a.k_proj, a.v_proj)
                w_qkv = torch.cat([p.weight.detach() for p in projs])
                b_qkv = torch.cat([p.bias.detach() for p in projs]) if a.q_proj.bias is not None else None
                w_gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])
                fused.append((w_qkv, b_qkv, w_gate_up))
            self._fused = (key, fused)
        return self._fused[1]

    def integer(self, fused: list[Fused]) -> Int8Forms | None:
        """The int8 mode's weights, current with these fused weights and the module's; None in
        the exact mode (`DFlashDrafter.use_compute`) or where a matrix has no integer form."""
        m = self.module
        if m.compute != "int8":
            return None
        key = (self._versions(self._slots()[1]), m.int8_bits)
        if self._int8 is None or self._int8[0] is not fused or self._int8[1] != key:
            forms = [quantize_weight(w.detach(), m.int8_bits) for w in [m.fc.weight] + [
                w for layer, (w_qkv, _, w_gate_up) in zip(m.layers, fused)
                for w in (w_qkv, layer.self_attn.o_proj.weight, w_gate_up, layer.mlp.down_proj.weight)]]
            made = None if any(f is None for f in forms) else Int8Forms(
                forms[0], [tuple(forms[1 + 4 * i : 5 + 4 * i]) for i in range(len(m.layers))])
            self._int8 = (fused, key, made)
        return self._int8[2]

    def program(self, fused: list[Fused], integer: Int8Forms | None = None) -> LayerProgram | None:
        """The layer loop as one kernel call (cpu/program.py), built from these fused weights
        (and with `integer` their integer forms: the int8 mode); None where it cannot run (the
        layer loop then runs: the same bits)."""
        if self._program is not None and self._program[0] is fused and self._program[1] is integer:
            program = self._program[2]
            # nothing changed since it was last known good (`read`), or its own check says so
            known = self._read_key is not None and self._program_key == self._read_key
            if program is None or known or program.fits():
                self._program_key = self._read_key
                return program
        program = None
        layers = self.module.layers
        eps = {(layer.input_layernorm.eps, layer.post_attention_layernorm.eps, layer.self_attn.q_norm.eps,
                layer.self_attn.k_norm.eps) for layer in layers}
        # the kernel has no block convolutions (DFlash 2) and one eps for the input and post norms
        if not self.module.cfg.dflash2 and len(eps) == 1 and next(iter(eps))[0] == next(iter(eps))[1]:
            (rms, _, q_eps, k_eps), = eps
            forms = integer.layers if integer is not None else [(None,) * 4] * len(layers)
            weights = [LayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                    layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight,
                                    ((i_qkv, w_qkv, b_qkv), (i_o, layer.self_attn.o_proj.weight,
                                                             layer.self_attn.o_proj.bias),
                                     (i_gate_up, w_gate_up, None),
                                     (i_down, layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)))
                       for layer, (w_qkv, b_qkv, w_gate_up), (i_qkv, i_o, i_gate_up, i_down)
                       in zip(layers, fused, forms)]
            modules = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                       layer.self_attn.q_norm, layer.self_attn.k_norm,
                                                       layer.self_attn.o_proj, layer.mlp.down_proj)]
            program = LayerProgram.build(weights, (rms, q_eps, k_eps), parameters_of(modules))
        self._program = (fused, integer, program)
        self._program_key = self._read_key
        return program


class StaticDraftCache(StaticCache):
    """A StaticCache of a drafter's context K/V (a `DraftContextCache`): its passes are `StaticPass`es."""

    def __init__(self, store: KVStore, row0: int, batch: int, weights: StaticWeights) -> None:
        super().__init__(store, row0, batch)
        self.weights = weights
        # every row's first pass read the drafter's weights through their check (`StaticWeights.read`):
        # later passes continue the rows' generations, on the weights those began with
        self.checked = False

    def spawn(self, batch: int) -> StaticDraftCache:
        """A cache for `batch` new rows right after this one's, in the same store."""
        self.store.ensure(self.row0 + self.batch + batch, self.store.capacity)
        return StaticDraftCache(self.store, self.row0 + self.batch, batch, self.weights)

    def merge(self, other: StaticCache) -> None:
        super().merge(other)
        self.checked = self.checked and isinstance(other, StaticDraftCache) and other.checked

    def open_pass(self, drafter: DFlashDrafter, ctx_positions: torch.Tensor, block_positions: torch.Tensor,
                  attn_mask: torch.Tensor | dict[int | None, torch.Tensor] | None = None) -> StaticPass:
        if attn_mask is not None:
            raise ValueError("a static draft cache takes no attn_mask (it derives who sees whom from the "
                             "positions); pass a DraftCache, or none, to train on packed blocks")
        if drafter is not self.weights.module:
            raise ValueError("this static draft cache was made for another drafter; make one with that "
                             "drafter's StaticDrafter(...).new_cache")
        return StaticPass(self, ctx_positions, block_positions)


HOST_GEOMETRY = 256  # most context and block tokens a pass's geometry is worked out for on the host


class StaticPass:
    """One draft pass over a `StaticDraftCache` (the `DraftPass` protocol; module docstring).

    Call `cache.reserve(n)` first with n = the largest block position + 1 and capacity for every
    context position written (else the pass reserves what its block reads: one host sync).
    """

    def __init__(self, cache: StaticDraftCache, ctx_positions: torch.Tensor, block_positions: torch.Tensor) -> None:
        w = cache.weights
        m = w.module
        cfg = m.cfg
        b, q = block_positions.shape
        c = ctx_positions.shape[1]
        device = block_positions.device
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dtype = m.fc.weight.dtype
        if not cache.fresh:
            cache.reserve(int(block_positions.max()) + 1)
        self.cache, self.weights = cache, w
        self.fused, self.integer = w.read(check=not cache.checked)  # integer: the int8 mode's, or None (exact)
        cache.checked = True
        self.b, self.q, self.heads, self.kv_heads, self.head_dim = b, q, h, kvh, d
        self.horizon = cache.horizon
        # The context runs flat over its T real tokens: rows that joined with long prompts leave
        # the others' columns mostly padding (EMPTY), which would otherwise cost full rows. Context
        # slots at or past the block's start would be overwritten by the block's K/V in the same
        # write, in no defined order: they go to the scratch slot (the block wins).
        # self.real [T]: flat indices into b * c (None: all real); all_pos, all_rows, slots [T + b q]:
        # the context's and the block's tokens, flat, through each layer's K/V projection together.
        seen = None  # [b, q]: the keys each block query sees, where worked out on the host
        if device.type == "cpu" and b * (c + q) <= HOST_GEOMETRY:
            self.real, all_pos, self.all_rows, self.slots, q_cols, seen = self._host_geometry(
                cache, ctx_positions, block_positions)
        else:
            self.real, all_pos, self.all_rows, self.slots = self._geometry(cache, ctx_positions, block_positions)
            q_cols = block_places(b, q)[1]
        t = self.t = all_pos.shape[0] - b * q
        cos, sin = (x[0, :, None] for x in m.rotary.below(all_pos[None], dtype, self.horizon))  # [T + b q, 1, d]
        self.cos, self.sin = cos, sin
        self.cos_b, self.sin_b = cos[t:].view(b, q, 1, d), sin[t:].view(b, q, 1, d)
        # the block's queries in the attention's layout, every token's K/V in its slot: one call per layer
        self.place = QKVPlacement.build(dtype, device, heads=h, kv_heads=kvh, head_dim=d, cos=cos.reshape(-1, d),
                                        sin=sin.reshape(-1, d), kv_rows=self.all_rows, kv_slots=self.slots, q_from=t,
                                        q_rows=self.all_rows[t:], q_cols=q_cols, batch=b, q_len=q)
        self.block_positions = block_positions
        self.masks: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        self.plain = self._plain_for(self.horizon, q)
        windowed = not self.plain and w.window is not None and q <= w.window  # the kernel takes first keys
        self.visible = self._visible(block_positions, dtype, self.plain or windowed, seen)  # [b, q] or None: PyTorch's
        self.start = (block_positions - (w.window - 1)).clamp_min(0).to(torch.int64).contiguous() if (
            windowed and self.visible is not None) else None  # [b, q]: each query's first key under the window
        self.scale = d ** -0.5

    @staticmethod
    def _geometry(cache: StaticDraftCache, ctx_positions: torch.Tensor, block_positions: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(real, all_pos, all_rows, slots) of a pass (see __init__), in tensor operations."""
        b, q = block_positions.shape
        c = ctx_positions.shape[1]
        device = block_positions.device
        real = padding_index(ctx_positions)  # [T] or None
        ctx_pos = ctx_positions.reshape(-1)
        ctx_rows = torch.arange(b, device=device).repeat_interleave(c)  # [b * c]
        ctx_slots = cache.write_index(ctx_positions)  # [b, c]
        start = block_positions[:, :1]
        overlap = (ctx_slots >= start) & (ctx_slots < start + q)
        ctx_slots = torch.where(overlap, torch.full_like(ctx_slots, cache.scratch), ctx_slots).reshape(-1)
        if real is not None:
            ctx_pos, ctx_rows, ctx_slots = ctx_pos[real], ctx_rows[real], ctx_slots[real]
        all_rows = torch.cat([ctx_rows, torch.arange(b, device=device).repeat_interleave(q)])
        return (real, torch.cat([ctx_pos, block_positions.reshape(-1)]), all_rows,
                torch.cat([ctx_slots, block_positions.reshape(-1)]))

    @staticmethod
    def _host_geometry(cache: StaticDraftCache, ctx_positions: torch.Tensor, block_positions: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
        """`_geometry`'s tensors from host lists, and the block's query columns [b q] (as
        `block_places`) and the keys each of its queries sees [b, q] (as `_visible` reads them:
        every slot below the block's end): for the few tokens of a lone row's pass, a dozen tensor
        operations cost more than the arithmetic (~0.2 ms of a ~9 ms drafting step). Every integer
        is in one tensor, the six as views of it."""
        b, q = block_positions.shape
        c = ctx_positions.shape[1]
        positions, blocks = ctx_positions.tolist(), block_positions.tolist()
        skip_padding = b * c > 1  # as padding_index: a lone position is never dropped
        real, pos, rows, kv_slots = [], [], [], []
        scratch = cache.scratch
        for i, (row_pos, block) in enumerate(zip(positions, blocks)):
            start = block[0]
            for j, p in enumerate(row_pos):
                if p == EMPTY and skip_padding:
                    continue
                slot = scratch if p == EMPTY else p  # `write_index`
                real.append(i * c + j)
                pos.append(p)
                rows.append(i)
                kv_slots.append(scratch if start <= slot < start + q else slot)
        flat_block = [p for block in blocks for p in block]
        t, m = len(pos), b * q
        flat = torch.tensor(pos + flat_block + rows + [i for i in range(b) for _ in range(q)] + kv_slots + flat_block
                            + list(range(q)) * b + [block[0] + q for block in blocks for _ in range(q)]
                            + (real if t < b * c else []), dtype=torch.long)
        n = t + m
        return (flat[3 * n + 2 * m :] if t < b * c else None, flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n],
                flat[3 * n : 3 * n + m],
                flat[3 * n + m : 3 * n + 2 * m].view(b, q))

    def _plain_for(self, horizon: int, q: int) -> bool:
        """Whether this pass's layers all see every slot below the block's end: no causal layer,
        and any sliding window longer than every key-query distance (slots 0..horizon-1, blocks
        of q). A drafter trained on short sequences can carry a window (the one shipped for
        SmolLM2: 512) that changes nothing until the context outgrows it, and until then its
        passes take the plain fast path."""
        w = self.weights
        return w.plain or (w.reach is not None and horizon <= w.reach and q <= w.reach)

    def _visible(self, block_positions: torch.Tensor, dtype: torch.dtype, kernel: bool,
                 seen: torch.Tensor | None = None) -> torch.Tensor | None:
        """Keys each block query sees [b, q] for the CPU attention kernel (`cached_attention`):
        all of its row's slots below the block's end, the committed context and the whole block
        (from each query's first key on, under a window). None where PyTorch's attention runs
        instead: other devices or dtypes, causal layers, windows that differ by layer or are
        shorter than a block (kernel False). Why: PyTorch's CPU attention with a mask was most of
        a batched draft pass's attention time (docs/DESIGN.md section 12)."""
        if not kernel:
            return None
        b, q = block_positions.shape
        if seen is not None:  # `_host_geometry`'s: the same numbers
            return seen if visible_keys_fit(dtype, block_positions.device, q) else None
        # the keys of a query at the block's last position are exactly those slots
        return visible_keys((block_positions[:, :1] + q - 1).expand(b, q), dtype)

    def _mask(self, kind: tuple[bool, int | None]) -> torch.Tensor | None:
        """PyTorch attention's mask [b, 1, g q, S] for layers of this kind (None: every slot)."""
        if kind in self.masks:
            return self.masks[kind]
        block_positions, horizon = self.block_positions, self.horizon
        b, q = block_positions.shape
        if b == 1 and self.plain:
            self.masks[kind] = None
            return None
        causal, window = kind
        end = block_positions[:, 0] + q  # [b]
        if causal:
            mask = attention_mask(block_positions, horizon, 1)  # [b, 1, q, S]: slot <= position
        else:
            mask = attention_mask(block_positions, horizon, 1, window_end=end)
        if window is not None:
            keys = torch.arange(horizon, device=block_positions.device)
            dist = block_positions[:, :, None] - keys[None, None, :]  # [b, q, S]
            near = dist < window if causal else dist.abs() < window
            mask = mask & near[:, None]
        groups = self.heads // self.kv_heads
        if groups > 1:
            mask = mask[:, :, None].expand(b, 1, groups, q, horizon).reshape(b, 1, groups * q, horizon)
        self.masks[kind] = mask
        return mask

    # ---- the DraftPass protocol ----------------------------------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        flat = features.reshape(-1, features.shape[-1])  # [b c, F]
        return flat if self.real is None else flat[self.real]  # [T, F]

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.integer is not None and module is self.weights.module.fc:
            return int8_linear(x, self.integer.fc, module.bias)
        return project(module, x, exact=False)

    def _product(self, i: int, k: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        """Layer i's product k (0 q/k/v, 1 o, 2 gate/up, 3 down): x [.., in] -> [.., out], from
        its integer form in the int8 mode."""
        if self.integer is not None:
            return int8_linear(x, self.integer.layers[i][k], bias)
        return linear(x, weight, bias, exact=False)

    def norm(self, module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, module.weight, module.eps)  # fp32 statistics, as the module computes

    def attention(self, i: int, attn: DraftAttention, ctx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, q, h, kvh, d, t = self.b, self.q, self.heads, self.kv_heads, self.head_dim, self.t
        nq, nk = h * d, kvh * d
        w_qkv, b_qkv, _ = self.fused[i]
        # one projection for the block's q/k/v and the context's k/v (its q columns unused)
        qkv = self._product(i, 0, torch.cat([ctx, y.reshape(b * q, -1)]), w_qkv, b_qkv)  # [T + b q, (h + 2 kvh) d]
        k_cache, v_cache = self.cache.layer(i)
        qg = None if self.place is None else self.place(
            qkv, k_cache, v_cache, (attn.q_norm.weight, attn.q_norm.eps), (attn.k_norm.weight, attn.k_norm.eps))
        if qg is None:  # the placement kernel's operators: [b, kvh, g q, d], K/V written
            qs = rope_bqhd(self.norm(attn.q_norm, qkv[t:, :nq].reshape(b, q, h, d)), self.cos_b, self.sin_b)
            ks = rope_bqhd(self.norm(attn.k_norm, qkv[:, nq : nq + nk].reshape(t + b * q, kvh, d)), self.cos,
                           self.sin)
            vs = qkv[:, nq + nk :].reshape(t + b * q, kvh, d)
            k_cache[self.all_rows, :, self.slots] = ks
            v_cache[self.all_rows, :, self.slots] = vs
            qg = qs.view(b, q, kvh, h // kvh, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, h // kvh * q, d)
        out = None if self.visible is None else cached_attention(qg, k_cache, v_cache, self.visible, self.horizon,
                                                                 self.scale, self.start)
        if out is None:
            horizon = self.horizon
            out = sdpa(qg, k_cache[:, :, :horizon], v_cache[:, :, :horizon],
                                                 attn_mask=self._mask(self.weights.layer_kinds[i]))
        out = out.view(b, kvh, h // kvh, q, d).permute(0, 3, 1, 2, 4).reshape(b, q, h * d)
        if self.integer is not None:
            return self._product(i, 1, out, attn.o_proj.weight, attn.o_proj.bias)
        return project(attn.o_proj, out, exact=False)

    def mlp(self, i: int, mlp: DraftMLP, y: torch.Tensor) -> torch.Tensor:
        act = silu_mul(self._product(i, 2, y, self.fused[i][2], None))
        if self.integer is not None:
            return self._product(i, 3, act, mlp.down_proj.weight, mlp.down_proj.bias)
        return project(mlp.down_proj, act, exact=False)

    def layers(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor | None:
        if self.place is None or self.visible is None or torch.is_grad_enabled():
            return None
        program = self.weights.program(self.fused, self.integer)
        dtype = x.dtype
        if program is None or program.dtype != dtype or (
                self.t + self.b * self.q > kernels.kernel().fast_rows.get(dtype, 0)):  # as `linear(exact=False)`
            return None
        return program.run(x.contiguous().clone(), self.place, self.visible, self.horizon, self.cache,
                           inter=self.weights.module.cfg.intermediate_size, scale=self.scale, ctx=ctx,
                           start=self.start)

    def close(self) -> None:
        self.cache.fresh = False


class StaticDrafter:
    """A DFlashDrafter on static caches: `new_cache` makes them, calling it runs the module's
    forward over one (inference mode)."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.module = drafter
        self.cfg = drafter.cfg
        self.weights = StaticWeights(drafter)

    @property
    def block_size(self) -> int:
        return self.module.block_size

    @property
    def mask_token_id(self) -> int:
        return self.module.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.module.target_layer_ids

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return self.module.logits(hidden, head)

    def new_cache(self, batch: int, capacity: int = 64) -> StaticDraftCache:
        w = self.module.fc.weight
        store = KVStore(self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim,
                        dtype=w.dtype, device=w.device, rows=max(1, batch), capacity=capacity)
        return StaticDraftCache(store, 0, batch, self.weights)

    @torch.inference_mode()
    def __call__(
        self,
        ctx_features: torch.Tensor,
        ctx_positions: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: StaticDraftCache,
    ) -> torch.Tensor:
        """`DFlashDrafter.forward` over a cache from `new_cache`: new context features [b, c, L*H]
        at ctx_positions (EMPTY for padding), block_embeds [b, q, H] at block_positions [b, q]
        -> hidden [b, q, H]. Call `cache.reserve(n)` first (`StaticPass`)."""
        return self.module(ctx_features, ctx_positions, block_embeds, block_positions, cache)
