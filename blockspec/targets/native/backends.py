"""How a native model's forward computes: one backend, chosen at load (`NativeLlama.use`).

- `TorchBackend` ("pytorch"): PyTorch's operators (GPUs, dtypes the CPU kernels do not take,
  a machine without a C compiler); products through cpu/linear.py.
- `KernelBackend` ("kernels", the exact compute mode on a CPU): the C kernels of cpu/, bit-exact
  fp32 (or bf16), batch invariant. Its whole layer loop is one C call where the pass fits
  (cpu/program.py), else the same kernels called layer by layer from Python (same bits).
- `Int8Backend` ("int8"): the kernels, but every projection and the LM head as integer products
  of 8-bit activations with 4- or 8-bit weights (cpu/int8.py); without a kernel, their PyTorch
  emulation (the same products) beside PyTorch's other operators.

The model (targets/native/llama.py) computes a forward's geometry once (`Pass`), then calls
`layers` and `head`; which kernel a pass of some shape takes (one token, a ragged block, a long
prompt) is decided here, inside each backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.cpu import kernels
from blockspec.cpu.argmax import greedy_ids
from blockspec.cpu.greedy_head import GreedyHead
from blockspec.cpu.int8 import Int8Weight, from_packed, int8_linear, int8_path, quantize_weight
from blockspec.cpu.linear import project
from blockspec.cpu.packed_weights import BF16_MAX_ROWS
from blockspec.cpu.program import LayerProgram, target_program
from blockspec.cpu.qkv import QKVPlacement, block_places
from blockspec.targets.native.attention import cached_attention
from blockspec.targets.native.cache import StaticCache, attention_mask
from blockspec.targets.native.tree_slots import TreeSlots
from blockspec.targets.slots import EMPTY
from blockspec.targets.sdpa import sdpa

COMPUTES = ("exact", "int8", "auto")
PACKED_HEAD_ROWS = 6  # greedy rows whose ids come from a packed head's logits (`KernelBackend._packed_head_takes`)
# Block positions (or tree nodes) whose greedy ids a verify pass's head finds first
# (`KernelBackend.head_until_rejected`): the rest only where the accepted path leads past them. Up
# to 6 rows cost the head about what one does (the weights stream from memory once; one row tile
# of the int8 kernel), and most steps reject a proposal within them (BENCHMARKS.md, "Compute
# modes").
FIRST_VERIFY_ROWS = 6
# Tokens per pass of a long prompt in the int8 mode (`Int8Backend.prompt_chunk`): a chunk the
# one-call layer program takes (cpu/program.py: no Python loop), whose activations stay in the
# outer caches between a layer's kernels (docs/DESIGN.md section 12)
PROMPT_CHUNK = 128


@dataclass
class Pass:
    """One forward's geometry, the same for all its layers. Tokens: the [b, q] block, or with
    `real` [T] (flat indices of the tokens that are not padding) those T only."""

    b: int
    q: int
    positions: torch.Tensor  # [b, q], EMPTY = padding
    real: torch.Tensor | None  # [T], or None: no padding
    rows: torch.Tensor  # the cache row of each token: [b, 1], or [T]
    write: torch.Tensor  # its cache slot: [b, q], or [T]
    cos: torch.Tensor  # rope [b, q, 1, d], or [T, 1, d]
    sin: torch.Tensor
    horizon: int  # cache slots [0, horizon) hold every key a query may see
    visible: torch.Tensor | None  # [b, q]: the batch-invariant attention kernel's, or None
    cache: StaticCache
    place: QKVPlacement | None = None  # the placement kernel's plan (KernelBackend), or None
    masks: tuple | None = None  # `sdpa_masks`, made at the first layer that needs them
    tree: TreeSlots | None = None  # a token tree's pass: its slots and what each node sees
    tree_keys: torch.Tensor | None = None  # [b, q, 1 + w]: the attention kernel's table of tree keys, or None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, cast back, then scale. On a CPU through the
    native kernel where it takes x (one call for PyTorch's ten small operators)."""
    out = kernels.rms_norm(x, weight, eps) if x.is_cpu else None
    if out is not None:
        return out
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rope_bqhd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., h, d] with cos/sin [..., 1, d] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2 I] -> [..., I]: the CPU kernel's (the same bits as the
    one-call layer loop) where it takes it, else PyTorch's."""
    out = kernels.silu_mul(gate_up)
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def spread(t: torch.Tensor, real: torch.Tensor, b: int, q: int) -> torch.Tensor:
    """Rows t [T, n] of the tokens at flat indices `real` -> [b, q, n], zero at padding."""
    out = t.new_zeros(b * q, t.shape[-1])
    out[real] = t
    return out.view(b, q, t.shape[-1])


class TorchBackend:
    """PyTorch's operators; the layer loop every backend shares (`layers`)."""

    name = "pytorch"
    compute = "exact"

    def __init__(self, net: nn.Module) -> None:
        self.net = net  # a NativeLlama (not registered as a submodule: the backend holds no weights of its own)

    def prepare(self) -> None:
        """Called when the weights changed form (packed): rebuild what depends on them."""

    def describe(self) -> str:
        """The compute mode and the kernels that run it, e.g. "exact (pytorch)"."""
        return f"{self.compute} ({self.name})"

    def prompt_chunk(self) -> int:
        """Tokens per pass in which `NativeLlama.forward` runs a longer pass of consecutive
        positions (a prompt) through every layer, chunk after chunk; 0: in one pass."""
        return 0

    # -- the forward --------------------------------------------------------------------------------

    def layers(self, x: torch.Tensor, p: Pass, start: int, layer_ids: tuple[int, ...]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers start.. on x [b, q, H] (or [T, H]) -> (the last layer's output, features [.., F]
        with the columns of every layer in layer_ids but the last filled, or None)."""
        net = self.net
        cfg = net.cfg
        h, kvh, g, d, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.groups, cfg.head_dim, cfg.hidden_size
        eps = cfg.rms_norm_eps
        features = x.new_empty(*x.shape[:-1], len(layer_ids) * hidden) if layer_ids else None
        at = {i: j * hidden for j, i in enumerate(layer_ids) if i != cfg.num_layers - 1}
        for i in range(start, cfg.num_layers):
            layer = net.layers[i]
            y = self.norm(x, layer.input_norm, eps)
            qkv = self.product(layer.qkv, y)
            k_cache, v_cache = p.cache.layer(i)  # [b, kvh, cap + 1, d]
            qg = self.queries(layer, qkv, p, k_cache, v_cache)  # [b, kvh, g * q, d]: no K/V repeat
            out = self.attention(qg, k_cache, v_cache, p)
            out = out.view(p.b, kvh, g, p.q, d).permute(0, 3, 1, 2, 4).reshape(p.b, p.q, h * d)
            if p.real is not None:
                out = out.reshape(p.b * p.q, h * d)[p.real]  # [T, h * d]
            x = self.product(layer.o, out, residual=x)
            y = self.norm(x, layer.post_norm, eps)
            x = self.product(layer.down, silu_mul(self.product(layer.gate_up, y)), residual=x)
            for j, i_ in enumerate(layer_ids):
                if i_ == i and i in at:
                    features[..., j * hidden : (j + 1) * hidden] = x
        return x, features

    def head_until_rejected(self, x: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor | None = None
                            ) -> torch.Tensor:
        """Greedy ids [b, q] of a verify pass's final norm output x [b, q, H]: input ids [b, q] hold
        each row's proposals, a chain at 1..q-1 or, with parents [b, q] (each node's parent index,
        the root's -1), a token tree's nodes. Exact at every node of a row's accepted path and at
        its last node (the bonus), what accept_greedy / tree_verify.walk read; the others may be
        -1. Here every position is computed: PyTorch's products need not give a row the same bits
        in a smaller block, so only the batch-invariant kernels skip any."""
        return self.head(x, True)

    def head(self, x: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Logits [.., V] of the final norm's output x [.., H], or with greedy their argmax ids [..]."""
        net = self.net
        single = net.single_head if x.numel() == x.shape[-1] else None
        logits = x @ single if single is not None else self.product(net.lm_head, x)
        return greedy_ids(logits) if greedy else logits

    # -- the parts of a layer -------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def product(self, module: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """module(x) (+ residual). One token where the CPU's GEMM is MKL's: the transposed copy
        (`NativeLlama.prepare_single_token_weights`), which streams faster for one row."""
        single = self.net.single
        wt = single.get(module) if single is not None and x.numel() == x.shape[-1] else None
        if wt is None:
            return project(module, x, residual=residual)
        out = x @ wt
        out = out if module.bias is None else out + module.bias
        return out if residual is None else residual + out

    def queries(self, layer: nn.Module, qkv: torch.Tensor, p: Pass, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """q/k norms, rope and the K/V writes of a layer's q/k/v -> queries [b, kvh, g * q, d]."""
        cfg = self.net.cfg
        h, kvh, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.groups, cfg.head_dim
        lead = qkv.shape[:-1]  # [b, q], or [T] without padding
        qs, ks, vs = qkv.split(self.net.split, dim=-1)
        qs = qs.view(*lead, h, d)
        ks = ks.view(*lead, kvh, d)
        vs = vs.view(*lead, kvh, d)
        if layer.q_norm is not None:
            qs = rms_norm(qs, layer.q_norm, cfg.rms_norm_eps)
            ks = rms_norm(ks, layer.k_norm, cfg.rms_norm_eps)
        qs = rope_bqhd(qs, p.cos, p.sin)
        ks = rope_bqhd(ks, p.cos, p.sin)
        k_cache[p.rows, :, p.write] = ks
        v_cache[p.rows, :, p.write] = vs
        if p.real is not None:
            qs = spread(qs.reshape(-1, h * d), p.real, p.b, p.q).view(p.b, p.q, h, d)
        return qs.view(p.b, p.q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(p.b, kvh, g * p.q, d)

    def attention(self, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: Pass) -> torch.Tensor:
        """PyTorch's attention -> [b, kvh, g * q, d], qg's layout (see `sdpa_masks`)."""
        mask, causal = self._masks(p)
        scale = self.net.scale
        if causal is False:
            return sdpa(qg, k_cache[:, :, :p.horizon], v_cache[:, :, :p.horizon],
                                                  attn_mask=mask, scale=scale)
        b, kvh, gq, d = qg.shape
        g = self.net.cfg.groups
        q = gq // g
        qh = qg.reshape(b, kvh * g, q, d)

        def attend(rows: slice, cols: slice, n: int) -> torch.Tensor:
            return sdpa(qh[rows, :, cols], k_cache[rows, :, :n], v_cache[rows, :, :n],
                                                  is_causal=True, scale=scale, enable_gqa=g > 1)

        if causal is True:
            return attend(slice(None), slice(None), q).view(b, kvh, gq, d)
        out = qh.new_zeros(b, kvh * g, q, d)
        for r, (first, n) in enumerate(causal):
            if n:
                out[r : r + 1, :, first : first + n] = attend(slice(r, r + 1), slice(first, first + n), n)
        return out.view(b, kvh, gq, d)

    def _masks(self, p: Pass) -> tuple[torch.Tensor | None, bool | tuple[tuple[int, int], ...]]:
        """`sdpa_masks` of this pass (a tree's: its nodes' visibility), made once for its layers."""
        if p.masks is None:
            groups = self.net.cfg.groups
            p.masks = ((p.tree.attention_mask(p.horizon, groups), False) if p.tree is not None
                       else sdpa_masks(p.positions, p.cache, p.horizon, groups))
        return p.masks


def sdpa_masks(positions: torch.Tensor, cache: StaticCache, horizon: int,
               groups: int) -> tuple[torch.Tensor | None, bool | tuple[tuple[int, int], ...]]:
    """(mask, causal) for PyTorch's attention, shared by the layers of one forward.

    Whole prompts from position 0 attend under the causal rule as [h, q]: PyTorch's kernel then
    skips the keys above the diagonal and reads no mask. causal True: every token sits at its
    own column's position (padding after the prompts), one call for the batch; a tuple: each
    row's (first column, length), its prompt somewhere in the row (the engine's joins pad on
    the left), one call per row over its own tokens, so a prompt attends alike alone or
    beside others. Padding queries get zeros (a forward that skips padding drops them). Otherwise
    (tokens after some context) the grouped boolean mask [b, 1, g * q, horizon].
    """
    b, q = positions.shape
    if b == 1 and q == 1 and cache.fresh:
        return None, False  # the single query sits at horizon - 1: sees everything
    if cache.fresh and b == 1 and q == horizon:
        return None, True  # q distinct positions below q (no host sync on a GPU)
    if cache.fresh and positions.device.type == "cpu":
        real = positions != EMPTY  # [b, q]
        lengths = real.sum(dim=1)  # [b]
        first = torch.where(lengths > 0, real.int().argmax(dim=1), 0)  # [b]
        cols = torch.arange(q)[None]
        span = (cols >= first[:, None]) & (cols < (first + lengths)[:, None])  # [b, q]
        if torch.equal(real, span) and torch.equal(positions, torch.where(real, cols - first[:, None], EMPTY)):
            if not bool(first.any()):
                return None, True
            return None, tuple(zip(first.tolist(), lengths.tolist()))
    return attention_mask(positions, horizon, groups), False


class KernelBackend(TorchBackend):
    """The exact compute mode on a CPU: the C kernels, bit-exact and batch invariant. Parts a
    kernel does not take (another dtype, a prompt longer than the attention kernel's) fall
    back to PyTorch's operators inside each part."""

    name = "kernels"

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.program: LayerProgram | None = None  # the layer loop in one call, built at the first pass it fits
        self._program_tried = False
        self.greedy_head: GreedyHead | None = None  # the LM head's bf16 screen, built at the first greedy pass

    def prepare(self) -> None:
        self.program, self._program_tried = None, False  # its table points at the weights' current forms

    def layers(self, x: torch.Tensor, p: Pass, start: int, layer_ids: tuple[int, ...]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._place(x, p)
        if not p.cache.written:
            self._check_program()
        ran = self.run_program(x, p, layer_ids) if start == 0 else None
        return ran if ran is not None else super().layers(x, p, start, layer_ids)

    def _place(self, x: torch.Tensor, p: Pass) -> None:
        """Where this pass's tokens put their queries and K/V, for the one-call placement kernel
        (cpu/qkv.py): p.place, None where PyTorch's operators run instead."""
        p.place = None
        if not QKVPlacement.available(x.dtype, x.device):
            return
        cfg = self.net.cfg
        d = cfg.head_dim
        if p.real is not None:  # T real tokens: rows, write [T], cos, sin [T, 1, d]
            q_rows, q_cols, kv_rows, kv_slots = p.rows, p.real % p.q, p.rows, p.write
        else:
            q_rows, q_cols = block_places(p.b, p.q)  # [b q]
            kv_rows, kv_slots = q_rows, p.write.reshape(-1)
        p.place = QKVPlacement.build(x.dtype, x.device, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=d,
                                     cos=p.cos.reshape(-1, d), sin=p.sin.reshape(-1, d), kv_rows=kv_rows,
                                     kv_slots=kv_slots, q_from=0, q_rows=q_rows, q_cols=q_cols, batch=p.b, q_len=p.q)

    def queries(self, layer: nn.Module, qkv: torch.Tensor, p: Pass, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        if p.place is not None:
            eps = self.net.cfg.rms_norm_eps
            norms = ((layer.q_norm, eps), (layer.k_norm, eps)) if layer.q_norm is not None else (None, None)
            qg = p.place(qkv.reshape(-1, qkv.shape[-1]), k_cache, v_cache, *norms)
            if qg is not None:
                return qg
        return super().queries(layer, qkv, p, k_cache, v_cache)

    def attention(self, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: Pass) -> torch.Tensor:
        out = None if p.visible is None else cached_attention(qg, k_cache, v_cache, p.visible, p.horizon,
                                                               self.net.scale, tree=p.tree_keys)
        return out if out is not None else super().attention(qg, k_cache, v_cache, p)

    def run_program(self, x: torch.Tensor, p: Pass, layer_ids: tuple[int, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The layer loop as one kernel call (cpu/program.py) -> (last layer's output [b, q, H],
        features with every captured layer but the last filled), or None where the program does
        not take this pass (ragged, one token on MKL's transposed weights, too many rows, no
        kernel): the Python loop then runs, with the same bits."""
        net = self.net
        fn = kernels.kernel()
        place = p.place
        if (p.real is not None or p.visible is None or place is None or not place.full or fn is None
                or p.b * p.q > fn.max_rows.get(x.dtype, 0) or (net.single is not None and p.b * p.q == 1)
                or len(set(layer_ids)) != len(layer_ids) or torch.is_grad_enabled() and x.requires_grad):
            return None
        program = self.program
        if program is None:
            if self._program_tried:
                return None
            self._program_tried = True
            program = self.program = self.build_program()
            if program is None:
                return None
        if program.dtype != x.dtype:
            return None
        cfg = net.cfg
        b, q, hidden = x.shape
        capture = [-1] * cfg.num_layers
        for j, i in enumerate(layer_ids):
            if i != cfg.num_layers - 1:
                capture[i] = j * hidden
        features = torch.empty(b, q, len(layer_ids) * hidden, dtype=x.dtype) if layer_ids else None
        out = program.run(x.clone(), place, p.visible, p.horizon, p.cache, inter=cfg.intermediate_size,
                          scale=net.scale, capture=capture, features=features, packed_max=BF16_MAX_ROWS,
                          tree=p.tree_keys)  # x.clone(): x stays for a rerun
        return None if out is None else (out, features)

    def _check_program(self) -> None:
        """Drops the layer program where the weights changed since it was built (`fits`), so the
        next pass it takes builds it again. Asked at a cache's first pass (a prompt's prefill),
        whichever path that pass runs, not at each decoding step: a generation runs on the
        weights it began with, as its keys and values did. Each check reads every weight's
        storage and version, cold after a pass streamed the weights: 3% of a plain step
        (BENCHMARKS.md, "Kernel measurements")."""
        if self.program is not None and not self.program.fits():
            self.program, self._program_tried = None, False

    def build_program(self) -> LayerProgram | None:
        return target_program(self.net)

    def head(self, x: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Greedy ids of up to PACKED_HEAD_ROWS rows from the packed head's logits; of more, from
        the bf16 screen (cpu/greedy_head.py); the same ids either way (the argmax of the same
        fp32 logits, the first of ties)."""
        if greedy and not self._packed_head_takes(x):
            screen = self._screened_head()
            best = None if screen is None else screen.ids(x)
            if best is not None:
                return best
        return super().head(x, greedy)

    def head_until_rejected(self, x: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor | None = None
                            ) -> torch.Tensor:
        """The first FIRST_VERIFY_ROWS nodes' ids, then the other nodes' for the rows whose path
        leads past them (`accepted_path_leaves`); -1 at the rest. The kernels give a row the same
        bits in any block (batch invariance), so each id is the full head's."""
        b, q = ids.shape
        first = min(q, FIRST_VERIFY_ROWS)
        best = torch.full((b, q), -1, dtype=torch.int64, device=x.device)
        best[:, :first] = self._verify_ids(x[:, :first])
        if first < q:
            going = [r for r in range(b) if accepted_path_leaves(best[r, :first].tolist(), ids[r].tolist(),
                                                                 None if parents is None else parents[r].tolist())]
            if going:
                rows = torch.tensor(going, device=x.device)
                best[rows, first:] = self._verify_ids(x[rows, first:])
        return best

    def _verify_ids(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy ids [b, n] of x [b, n, H] for a verify pass: the bf16 screen where there is one,
        also for the few rows whose ids `head` takes from the packed head's logits (the same ids;
        in verify passes of 4 to 16 tokens the screen's first rows measured faster: BENCHMARKS.md,
        "Compute modes")."""
        screen = self._screened_head()
        best = None if screen is None else screen.ids(x)
        return best if best is not None else self.head(x, True)

    def _packed_head_takes(self, x: torch.Tensor) -> bool:
        head = self.net.lm_head
        packed = head.__dict__.get("packed")
        return (packed is not None and x.dtype == torch.float32 and x.numel() <= PACKED_HEAD_ROWS * x.shape[-1]
                and packed.matches(head.weight))

    def _screened_head(self) -> GreedyHead | None:
        """The LM head's bf16 screen, rebuilt if the weight changed; None where it does not
        apply (not fp32 on a CPU, no kernel) and the logits are computed."""
        w = self.net.lm_head.weight
        if not GreedyHead.available(w):
            return None
        if self.greedy_head is None or not self.greedy_head.fits(w):
            self.greedy_head = GreedyHead(w)
        return self.greedy_head


class Int8Backend(KernelBackend):
    """The int8 compute mode: each projection and the LM head multiply 8-bit activations by
    integer weights (cpu/int8.py): a GGUF's own 4- and 8-bit values where the model has them
    (packed), other fp32 matrices quantised to 8 bits. fp32 models on a CPU only."""

    name = "int8"
    compute = "int8"

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.weights: dict[nn.Linear, Int8Weight] = {}
        self.prepare()

    def prepare(self) -> None:
        super().prepare()
        self.weights = {}
        for _, module in self.net.packable():
            packed = module.__dict__.get("packed")
            w = from_packed(packed) if packed is not None and packed.matches(module.weight) else None
            w = w or quantize_weight(module.weight)
            if w is not None:
                self.weights[module] = w

    def describe(self) -> str:
        return f"int8 ({int8_path()})"

    def prompt_chunk(self) -> int:
        """PROMPT_CHUNK where the layer program takes that many rows; a prompt of up to
        attention.MAX_TOKENS tokens gets the same bits in chunks as in one pass (batch-invariant
        products and attention), a longer one attends through the C kernel chunk by chunk."""
        fn = kernels.kernel()
        return PROMPT_CHUNK if fn is not None and fn.max_rows.get(torch.float32, 0) >= PROMPT_CHUNK else 0

    def weight(self, module: nn.Linear) -> Int8Weight | None:
        w = self.weights.get(module)
        return w if w is not None and w.matches(module.weight) else None

    def product(self, module: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight(module) if x.dtype == torch.float32 and x.is_cpu else None
        return super().product(module, x, residual) if w is None else int8_linear(x, w, module.bias, residual)

    def head(self, x: torch.Tensor, greedy: bool) -> torch.Tensor:
        logits = self.product(self.net.lm_head, x)
        return greedy_ids(logits) if greedy else logits

    def _verify_ids(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x, True)  # the int8 head's own logits (the bf16 screen finds the exact mode's)

    def build_program(self) -> LayerProgram | None:
        return target_program(self.net, self.weight)


def accepted_path_leaves(best: list[int], ids: list[int], parents: list[int] | None) -> bool:
    """Whether greedy acceptance, walking from node 0 with the target's ids `best` of the first
    len(best) nodes, reaches a node past them: node c follows node p where c's parent is p and its
    token ids[c] is best[p] (a chain: parents None, node p + 1), the last such c as
    tree_verify.walk takes it (children of one parent hold distinct tokens); a node's parent comes
    before it."""
    known, node = len(best), 0
    while True:
        if parents is None:
            nxt = node + 1 if node + 1 < len(ids) and ids[node + 1] == best[node] else None
        else:
            nxt = max((c for c in range(1, len(ids)) if parents[c] == node and ids[c] == best[node]), default=None)
        if nxt is None:
            return False
        if nxt >= known:
            return True
        node = nxt


def backend_for(net: nn.Module, compute: str) -> TorchBackend:
    """The backend that runs `compute` ("exact" or "int8") for this model's device and dtype."""
    weight = net.embed.weight
    cpu = weight.device.type == "cpu"
    if compute == "int8":
        if not cpu or weight.dtype != torch.float32:
            raise ValueError(f"compute='int8' runs fp32 models on a CPU; this one is {weight.dtype} on "
                             f"{weight.device.type}: use compute='exact'")
        return Int8Backend(net)
    if compute != "exact":
        raise ValueError(f"compute must be one of {', '.join(COMPUTES[:2])} here, got {compute!r}")
    if cpu and weight.dtype in (torch.float32, torch.bfloat16) and kernels.kernel() is not None:
        return KernelBackend(net)
    return TorchBackend(net)
