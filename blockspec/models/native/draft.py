"""The DFlash drafter's forward over a position-indexed static context cache.

Same weights and numerics as `DFlashDrafter.forward` (models/drafter.py), different bookkeeping:
the context K/V of position p live in slot p of a StaticCache, and the block's K/V are written
into the slots of the block positions start..start+q-1 for the duration of the pass. Those slots
hold either nothing yet or context K/V of tokens a verification rejected; the block K/V are
overwritten by the real context K/V once the tokens there are committed. Queries see slots below
start + q (the committed context plus the whole block), so at batch size 1 the pass needs no
mask and no concatenation.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.models.drafter import DFlashDrafter
from blockspec.models.native.cache import KVStore, StaticCache, attention_mask
from blockspec.models.linear import project
from blockspec.models.native.llama import rope_bqhd


def has_standard_forward(drafter: nn.Module) -> bool:
    """True for DFlashDrafter instances whose forward was not replaced (e.g. by a test double)."""
    return isinstance(drafter, DFlashDrafter) and type(drafter).forward is DFlashDrafter.forward


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
        ctx = m.hidden_norm(project(m.fc, ctx_features))  # [b, c, H]
        dtype = block_embeds.dtype
        cos_b, sin_b = (t[:, :, None] for t in m.rotary(block_positions, dtype))  # [b, q, 1, d]
        cos_c, sin_c = (t[:, :, None] for t in m.rotary(ctx_positions, dtype))
        ctx_slots = cache.write_index(ctx_positions)  # [b, c]
        rows = torch.arange(b, device=block_embeds.device)[:, None]
        masks: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        x = block_embeds
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            kind = self.layer_kinds[i]
            if kind not in masks:
                masks[kind] = None if (b == 1 and self.plain) else self._mask(kind, block_positions, horizon, g)
            y = layer.input_layernorm(x)
            qs = rope_bqhd(attn.q_norm(project(attn.q_proj, y).view(b, q, h, d)), cos_b, sin_b)
            kb = rope_bqhd(attn.k_norm(project(attn.k_proj, y).view(b, q, kvh, d)), cos_b, sin_b)
            vb = project(attn.v_proj, y).view(b, q, kvh, d)
            k_cache, v_cache = cache.layer(i)
            if c:
                k_cache[rows, :, ctx_slots] = rope_bqhd(attn.k_norm(project(attn.k_proj, ctx).view(b, c, kvh, d)), cos_c, sin_c)
                v_cache[rows, :, ctx_slots] = project(attn.v_proj, ctx).view(b, c, kvh, d)
            k_cache[rows, :, block_positions] = kb  # after the context: block K/V win in their slots
            v_cache[rows, :, block_positions] = vb
            qg = qs.view(b, q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * q, d)
            out = torch.nn.functional.scaled_dot_product_attention(
                qg, k_cache[:, :, :horizon], v_cache[:, :, :horizon], attn_mask=masks[kind]
            )
            out = out.view(b, kvh, g, q, d).permute(0, 3, 1, 2, 4).reshape(b, q, h * d)
            x = x + project(attn.o_proj, out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.fresh = False
        return m.norm(x)
