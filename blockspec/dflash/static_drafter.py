"""The DFlash drafter's forward over a position-indexed static context cache.

Same weights and numerics as `DFlashDrafter.forward` (dflash/drafter.py), different bookkeeping:
the context K/V of position p live in slot p of a StaticCache, and the block's K/V are written
into the slots of the block positions start..start+q-1 for the duration of the pass. Those slots
hold either nothing yet or context K/V of tokens a verification rejected; the block K/V are
overwritten by the real context K/V once the tokens there are committed. Queries see slots below
start + q (the committed context plus the whole block), so at batch size 1 the pass needs no
mask and no concatenation. A DFlash 2 drafter's block convolutions (dflash/conv.py) run in the
PyTorch loop; the C layer program (cpu/program.py) takes DFlash drafters only.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.cpu import kernels
from blockspec.dflash.drafter import DFlashDrafter, RMSNorm
from blockspec.cpu.linear import linear, project
from blockspec.targets.native.attention import cached_attention, visible_keys
from blockspec.targets.native.cache import KVStore, StaticCache, attention_mask
from blockspec.targets.native.llama import padding_index, rms_norm, rope_bqhd, silu_mul
from blockspec.cpu.program import LayerProgram, LayerWeights, parameters_of
from blockspec.cpu.qkv import QKVPlacement, block_places


def has_standard_forward(drafter: nn.Module) -> bool:
    """True for DFlashDrafter instances whose forward was not replaced (e.g. by a test double)."""
    return isinstance(drafter, DFlashDrafter) and type(drafter).forward is DFlashDrafter.forward


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The drafter's RMSNorm through the fused kernel (fp32 statistics, as the module computes)."""
    return rms_norm(x, norm.weight, norm.eps)


class StaticDrafter:
    """Runs a DFlashDrafter's weights with StaticCache context caches; call like the module."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        if not has_standard_forward(drafter):
            raise TypeError("StaticDrafter needs a DFlashDrafter with the standard forward")
        self.module = drafter
        cfg = drafter.cfg
        self.cfg = cfg
        self.layer_kinds = [(layer.self_attn.causal, layer.self_attn.sliding_window) for layer in drafter.layers]
        self.plain = all(not causal and window is None for causal, window in self.layer_kinds)
        # bidirectional layers whose windows reach further than a pass can look act as plain ones
        self.reach = None if any(causal for causal, _ in self.layer_kinds) else min(
            (window for _, window in self.layer_kinds if window is not None), default=None)
        # one window for every (bidirectional) layer: the CPU kernel takes each query's first key
        self.window = self.reach if {w for _, w in self.layer_kinds} == {self.reach} else None
        self._fused: tuple[tuple, list] | None = None  # (weight versions, per layer weights)
        self._program: tuple[list, LayerProgram | None] | None = None  # (the fused weights it read, program)

    def _fused_weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        """Per layer: q/k/v weights stacked [(h + 2 kvh) d, H] (and bias), gate/up stacked
        [2 I, H]: four products per layer instead of nine, fewer small calls in a pass that is
        short at batch 1. Rebuilt when a weight changes (training evaluates a live drafter)."""
        a = [layer.self_attn for layer in self.module.layers]
        params = [p for attn, layer in zip(a, self.module.layers) for p in (
            attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_proj.bias, attn.k_proj.bias,
            attn.v_proj.bias, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight) if p is not None]
        key = tuple((p.data_ptr(), p._version) for p in params)
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

    def _layer_program(self, fused: list) -> LayerProgram | None:
        """The pass's layer loop as one kernel call (cpu/program.py), built from these
        fused weights; None where it cannot run (the Python loop below then runs: same bits)."""
        if self._program is not None and self._program[0] is fused:
            program = self._program[1]
            if program is None or program.fits():
                return program
        program = None
        layers = self.module.layers
        if self.cfg.dflash2:  # the kernel has no block convolutions: the Python loop runs them
            self._program = (fused, None)
            return None
        eps = {(layer.input_layernorm.eps, layer.post_attention_layernorm.eps, layer.self_attn.q_norm.eps,
                layer.self_attn.k_norm.eps) for layer in layers}
        if len(eps) == 1:
            (rms, post, q_eps, k_eps), = eps
            if rms == post:
                weights = [LayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                        layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight,
                                        ((None, w_qkv, b_qkv), (None, layer.self_attn.o_proj.weight,
                                                                layer.self_attn.o_proj.bias),
                                         (None, w_gate_up, None),
                                         (None, layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)))
                           for layer, (w_qkv, b_qkv, w_gate_up) in zip(layers, fused)]
                modules = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                           layer.self_attn.q_norm, layer.self_attn.k_norm,
                                                           layer.self_attn.o_proj, layer.mlp.down_proj)]
                program = LayerProgram.build(weights, (rms, q_eps, k_eps), parameters_of(modules))
        self._program = (fused, program)
        return program

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

    def new_cache(self, batch: int, capacity: int = 64) -> StaticCache:
        w = self.module.fc.weight
        store = KVStore(self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim,
                        dtype=w.dtype, device=w.device, rows=max(1, batch), capacity=capacity)
        return StaticCache(store, 0, batch)

    def _mask(self, kind: tuple[bool, int | None], block_positions: torch.Tensor, horizon: int,
              groups: int) -> torch.Tensor:
        causal, window = kind
        b, q = block_positions.shape
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
        if groups > 1:
            mask = mask[:, :, None].expand(b, 1, groups, q, horizon).reshape(b, 1, groups * q, horizon)
        return mask

    def _plain_for(self, horizon: int, q: int) -> bool:
        """Whether this pass's layers all see every slot below the block's end: no causal layer,
        and any sliding window longer than every key-query distance (slots 0..horizon-1, blocks
        of q). A drafter trained on short sequences can carry a window (the one shipped for
        SmolLM2: 512) that changes nothing until the context outgrows it, and until then its
        passes take the plain fast path."""
        return self.plain or (self.reach is not None and horizon <= self.reach and q <= self.reach)

    def _window_start(self, block_positions: torch.Tensor) -> torch.Tensor:
        """Each block query's first key under the layers' common sliding window [b, q]: |query
        position - key slot| < window (the block's own slots are within reach: q <= window)."""
        return (block_positions - (self.window - 1)).clamp_min(0).to(torch.int64).contiguous()

    def _visible(self, block_positions: torch.Tensor, dtype: torch.dtype, kernel: bool) -> torch.Tensor | None:
        """Keys each block query sees [b, q] for the CPU attention kernel (`cached_attention`):
        all of its row's slots below the block's end, the committed context and the whole block
        (from `_window_start` on, under a window). None where PyTorch's attention runs instead:
        other devices or dtypes, causal layers, windows that differ by layer or are shorter than
        a block (kernel False). Why: PyTorch's CPU attention with a mask cost 170-280 us per
        layer at 8 rows (SmolLM2's drafter, 2 cores), most of a batched draft pass's attention."""
        if not kernel:
            return None
        b, q = block_positions.shape
        # the keys of a query at the block's last position are exactly those slots
        return visible_keys((block_positions[:, :1] + q - 1).expand(b, q), dtype)

    @torch.inference_mode()
    def __call__(
        self,
        ctx_features: torch.Tensor,
        ctx_positions: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: StaticCache,
    ) -> torch.Tensor:
        """Like DFlashDrafter.forward: new context features [b, c, L*H] at ctx_positions (EMPTY
        for padding), block_embeds [b, q, H] at block_positions [b, q] -> hidden [b, q, H].

        Call `cache.reserve(n)` first with n = the largest block position + 1 and capacity for
        every context position written.
        """
        m = self.module
        cfg = self.cfg
        b, q, _ = block_embeds.shape
        ctx_features, block_embeds = m.own_dtype(ctx_features), m.own_dtype(block_embeds)
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = h // kvh
        c = ctx_features.shape[1]
        if not cache.fresh:
            cache.reserve(int(block_positions.max()) + 1)
        horizon = cache.horizon
        fused = self._fused_weights()
        # The context runs flat over its T real tokens: rows that joined with long prompts leave
        # the others' columns mostly padding (EMPTY), which would otherwise cost full rows.
        real = padding_index(ctx_positions)  # [T] flat indices into b * c, None: all real
        ctx_flat = ctx_features.reshape(b * c, -1)
        ctx_pos = ctx_positions.reshape(-1)
        ctx_rows = torch.arange(b, device=block_embeds.device).repeat_interleave(c)  # [b * c]
        # context slots at or past the block's start would be overwritten by the block's K/V in
        # the same write, in no defined order: send them to the scratch slot (the block wins)
        ctx_slots = cache.write_index(ctx_positions)  # [b, c]
        start = block_positions[:, :1]
        overlap = (ctx_slots >= start) & (ctx_slots < start + q)
        ctx_slots = torch.where(overlap, torch.full_like(ctx_slots, cache.scratch), ctx_slots).reshape(-1)
        if real is not None:
            ctx_flat, ctx_pos, ctx_rows, ctx_slots = ctx_flat[real], ctx_pos[real], ctx_rows[real], ctx_slots[real]
        t = ctx_flat.shape[0]
        ctx = _norm(m.hidden_norm, project(m.fc, ctx_flat, exact=False))  # [T, H]
        dtype = block_embeds.dtype
        # context and block tokens, flat: [T + b q], through each layer's K/V projection together
        all_pos = torch.cat([ctx_pos, block_positions.reshape(-1)])
        cos, sin = (x[0, :, None] for x in m.rotary(all_pos[None], dtype))  # [T + b q, 1, d]
        cos_b, sin_b = cos[t:].view(b, q, 1, d), sin[t:].view(b, q, 1, d)
        all_rows = torch.cat([ctx_rows, torch.arange(b, device=block_embeds.device).repeat_interleave(q)])
        slots = torch.cat([ctx_slots, block_positions.reshape(-1)])  # [T + b q]
        # the block's queries in the attention's layout, every token's K/V in its slot: one call per layer
        place = QKVPlacement.build(dtype, block_embeds.device, heads=h, kv_heads=kvh, head_dim=d,
                                   cos=cos.reshape(-1, d), sin=sin.reshape(-1, d), kv_rows=all_rows, kv_slots=slots,
                                   q_from=t, q_rows=all_rows[t:], q_cols=block_places(b, q)[1], batch=b, q_len=q)
        masks: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        plain = self._plain_for(horizon, q)
        windowed = not plain and self.window is not None and q <= self.window  # the kernel takes first keys
        visible = self._visible(block_positions, dtype, plain or windowed)  # [b, q] or None: PyTorch's attention
        start = self._window_start(block_positions) if windowed and visible is not None else None  # [b, q]
        scale = d ** -0.5
        x = block_embeds
        if place is not None and visible is not None and not torch.is_grad_enabled():
            program = self._layer_program(fused)
            kernel = kernels.kernel()
            if (program is not None and program.dtype == dtype
                    and t + b * q <= kernel.fast_rows.get(dtype, 0)):  # as `linear(exact=False)` takes them
                out = program.run(x.contiguous().clone(), place, visible, horizon, cache,
                                  inter=cfg.intermediate_size, scale=scale, ctx=ctx, start=start)
                if out is not None:
                    cache.fresh = False
                    return _norm(m.norm, out)
        nq, nk = h * d, kvh * d
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            kind = self.layer_kinds[i]
            w_qkv, b_qkv, w_gate_up = fused[i]
            y = _norm(layer.input_layernorm, x)
            if layer.attention_conv is not None:  # DFlash 2 (dflash/conv.py): the block's q/k/v read conv(y)
                y, delta = layer.attention_conv.prepare(y, q)
            # one projection for the block's q/k/v and the context's k/v (its q columns unused)
            qkv = linear(torch.cat([ctx, y.reshape(b * q, -1)]), w_qkv, b_qkv, exact=False)  # [T + b q, (h + 2 kvh) d]
            k_cache, v_cache = cache.layer(i)
            qg = None if place is None else place(qkv, k_cache, v_cache, (attn.q_norm.weight, attn.q_norm.eps),
                                                  (attn.k_norm.weight, attn.k_norm.eps))  # [b, kvh, g q, d]
            if qg is None:
                qs = rope_bqhd(_norm(attn.q_norm, qkv[t:, :nq].reshape(b, q, h, d)), cos_b, sin_b)
                ks = rope_bqhd(_norm(attn.k_norm, qkv[:, nq : nq + nk].reshape(t + b * q, kvh, d)), cos, sin)
                vs = qkv[:, nq + nk :].reshape(t + b * q, kvh, d)
                k_cache[all_rows, :, slots] = ks
                v_cache[all_rows, :, slots] = vs
                qg = qs.view(b, q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * q, d)
            out = None if visible is None else cached_attention(qg, k_cache, v_cache, visible, horizon, scale, start)
            if out is None:
                if kind not in masks:  # built only here: the kernel's mask is `visible`
                    masks[kind] = None if (b == 1 and plain) else self._mask(kind, block_positions, horizon, g)
                out = F.scaled_dot_product_attention(
                    qg, k_cache[:, :, :horizon], v_cache[:, :, :horizon], attn_mask=masks[kind]
                )
            out = out.view(b, kvh, g, q, d).permute(0, 3, 1, 2, 4).reshape(b, q, h * d)
            out = project(attn.o_proj, out, exact=False)
            if layer.attention_conv is not None:
                out = layer.attention_conv.finish(out, delta, q)
            x = x + out
            y = _norm(layer.post_attention_layernorm, x)
            if layer.mlp_conv is not None:
                y, delta = layer.mlp_conv.prepare(y, q)
            out = project(layer.mlp.down_proj, silu_mul(linear(y, w_gate_up, exact=False)), exact=False)
            if layer.mlp_conv is not None:
                out = layer.mlp_conv.finish(out, delta, q)
            x = x + out
        cache.fresh = False
        return _norm(m.norm, x)
