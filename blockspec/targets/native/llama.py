"""Native Llama-family target (Llama, SmolLM2, Qwen2, Qwen3) over a position-indexed KV cache.

Numerically the same computation as the Hugging Face modeling code (RMSNorm in fp32, RoPE angles
in fp32, SDPA attention), arranged for speed: q/k/v projections are fused into one matmul, one-token
forwards and blocks of tokens project through cpu/linear.py (oneDNN on a CPU; where that is
missing, one-token forwards use transposed [in, out] copies of the widest matrices), K/V go
straight into the preallocated cache (targets/native/cache.py), and grouped query heads attend
as [kv_heads, groups * q] so the cache is never repeated per query head. Greedy steps ask for
the argmax ids only (`forward_greedy`), which an fp32 head on a CPU finds by screening in bf16
(cpu/greedy_head.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.cpu.argmax import greedy_ids
from blockspec.cpu.greedy_head import GreedyHead
from blockspec.targets.native.cache import KVStore, StaticCache, attention_mask
from blockspec.targets.native.config import NativeConfig
from blockspec.cpu.program import LayerProgram, target_program
from blockspec.cpu.qkv import QKVPlacement, block_places
from blockspec.cpu import kernels
from blockspec.cpu.linear import fast_cpu_single_row, project
from blockspec.cpu.packed_cache import pack_cached
from blockspec.cpu.packed_weights import BF16_MAX_ROWS
from blockspec.targets.native.attention import cached_attention, visible_keys
from blockspec.targets.rope import Rotary, rope_inv_freq
from blockspec.targets.slots import EMPTY
from blockspec.targets.base import TargetInfo


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, cast back, then scale. On a CPU through the
    native kernel (one call where PyTorch's runs ~10 small operators: 4 us a row against 10)."""
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


def _matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x @ weight_t
    return out if bias is None else out + bias


PACKED_HEAD_ROWS = 6  # greedy rows whose ids come from a packed head's logits (`_packed_head_takes`)


class NativeLayer(nn.Module):
    """One decoder layer's weights; q/k/v fused into qkv [(h + 2 kvh) d, H], gate and up into
    gate_up [2 I, H]. One product instead of two: each output column is the same dot product
    either way (the same bits), and the CPU kernel's call and thread start-up are paid once
    (SmolLM2-135M, 2 cores: 4.5 against 4.7 ms for 30 layers' gate and up at 1 token, 4.9 against
    5.2 at 6)."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        d, h, kvh, hidden = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, (h + 2 * kvh) * d, bias=cfg.qkv_bias)
        self.q_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.o = nn.Linear(h * d, hidden, bias=cfg.o_bias)
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, hidden, bias=cfg.mlp_bias)


class NativeLlama(nn.Module):
    """The network. Stateless: K/V live in the StaticCache passed to `forward`."""

    def __init__(self, cfg: NativeConfig, hf_config: object | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NativeLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        inv_freq, scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, hf_config)
        self.rotary = Rotary(inv_freq, scaling)
        self.scale = cfg.head_dim**-0.5
        # Transposed [in, out] copies of the widest matrices, used for single-token forwards where
        # the CPU kernel of cpu/linear.py is MKL's: it streams x @ W through memory faster than
        # linear(x, W) for one row (measured ~1.4x), while the [out, in] originals stay faster for
        # blocks of tokens. Costs memory; see `prepare_single_token_weights`.
        self.single: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
        self.single_head: torch.Tensor | None = None
        self._greedy_head: GreedyHead | None = None  # built at the first greedy forward that can use it
        self._program: LayerProgram | None = None  # the layer loop in one call, built at the first forward it fits
        self._program_tried = False
        self._split = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)

    def prepare_single_token_weights(self, enabled: bool = True) -> None:
        """Keeps transposed copies of qkv, gate|up and the LM head for one-token forwards, unless
        cpu/linear.py's kernel is faster for one row already (oneDNN)."""
        if not enabled or fast_cpu_single_row():
            self.single, self.single_head = None, None
            return
        with torch.no_grad():
            self.single = [
                (layer.qkv.weight.t().contiguous(), layer.gate_up.weight.t().contiguous(), layer.gate_up.bias)
                for layer in self.layers
            ]
            self.single_head = self.lm_head.weight.t().contiguous()

    def pack_weights(self, sources: dict[str, torch.Tensor] | None = None, *, cache: Path | None = None,
                     key: dict | None = None) -> int:
        """Packs the projections and the LM head whose fp32 weights a 4- or 8-bit GGUF left
        (cpu/packed_weights.py); the outputs keep their bits and a decoding step streams a fifth of the
        bytes (SmolLM2-135M from its GGUF file, 2 cores: the 120 Q4_1 projections at 1 token 3.1 ms
        against 9.0, at 6 tokens 5.1 against 10.6; its Q8_0 head's logits at 1 token 0.6 ms against
        2.8). Greedy steps of more than PACKED_HEAD_ROWS tokens keep the
        bf16 screen of the head (cpu/greedy_head.py), which is faster there. A bf16 model packs
        the fp32 `sources` it was rounded from (its native state dict before the cast), where their
        packed values round to its weights. `cache`: a file that keeps the packed forms for the next
        load with the same `key` (cpu/packed_cache.py). Returns how many were packed."""
        pairs = self._packable()
        self._program, self._program_tried = None, False  # its table points at what gets packed now
        return pack_cached(pairs, None if sources is None else [sources.get(n) for n, _ in pairs], cache, key)

    def _packable(self) -> list[tuple[str, nn.Linear]]:
        """(name of its weight in the native state dict, module) of each matrix `pack_weights` tries."""
        names = [f"layers.{i}.{n}" for i in range(len(self.layers)) for n in ("qkv", "o", "gate_up", "down")]
        head = "embed" if self.lm_head.weight is self.embed.weight else "lm_head"
        return [(n + ".weight", self.get_submodule(n)) for n in names] + [(head + ".weight", self.lm_head)]

    def _horizon(self, positions: torch.Tensor, cache: StaticCache) -> int:
        """Slots [0, horizon) hold every key this forward's queries may see."""
        return cache.horizon if cache.fresh else int(positions.max()) + 1

    def _sdpa_masks(self, positions: torch.Tensor, cache: StaticCache,
                    horizon: int) -> tuple[torch.Tensor | None, bool | tuple[tuple[int, int], ...]]:
        """(mask, causal) for PyTorch's attention, shared by the layers of one forward (built only
        when a layer runs it: on a CPU, passes of more than attention.MAX_TOKENS tokens).

        Whole prompts from position 0 attend under the causal rule as [h, q] (`_sdpa`): PyTorch's
        kernel then skips the keys above the diagonal and reads no mask (a 3,460-token SmolLM2
        prompt on 2 cores: 250 -> 100 ms a layer). causal True: every token sits at its own
        column's position (padding after the prompts), one call for the batch; a tuple: each
        row's (first column, length), its prompt somewhere in the row (the engine's joins pad on
        the left), one call per row over its own tokens, so a prompt attends alike alone or
        beside others. Padding queries get zeros (a forward that skips padding drops them). Otherwise
        (tokens after some context) the grouped boolean mask [b, 1, g * q, horizon].
        """
        b, q = positions.shape
        groups = self.cfg.groups
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

    def _sdpa(self, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, horizon: int,
              mask: torch.Tensor | None, causal: bool | tuple[tuple[int, int], ...]) -> torch.Tensor:
        """PyTorch's attention -> [b, kvh, g * q, d], qg's layout (see `_sdpa_masks`)."""
        if causal is False:
            return F.scaled_dot_product_attention(qg, k_cache[:, :, :horizon], v_cache[:, :, :horizon],
                                                  attn_mask=mask, scale=self.scale)
        b, kvh, gq, d = qg.shape
        g = self.cfg.groups
        q = gq // g
        qh = qg.reshape(b, kvh * g, q, d)

        def attend(rows: slice, cols: slice, n: int) -> torch.Tensor:
            return F.scaled_dot_product_attention(qh[rows, :, cols], k_cache[rows, :, :n], v_cache[rows, :, :n],
                                                  is_causal=True, scale=self.scale, enable_gqa=g > 1)

        if causal is True:
            return attend(slice(None), slice(None), q).view(b, kvh, gq, d)
        out = qh.new_zeros(b, kvh * g, q, d)
        for r, (first, n) in enumerate(causal):
            if n:
                out[r : r + 1, :, first : first + n] = attend(slice(r, r + 1), slice(first, first + n), n)
        return out.view(b, kvh, gq, d)

    def _placement(self, b: int, q: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rows: torch.Tensor, write: torch.Tensor, real: torch.Tensor | None) -> QKVPlacement | None:
        """Where this forward's tokens put their queries and K/V, for the one-call CPU kernel
        (cpu/qkv.py); None where PyTorch's operators run instead."""
        if not QKVPlacement.available(x.dtype, x.device):
            return None
        cfg = self.cfg
        d = cfg.head_dim
        if real is not None:  # T real tokens: rows, write [T], cos, sin [T, 1, d]
            q_rows, q_cols, kv_rows, kv_slots = rows, real % q, rows, write
        else:
            q_rows, q_cols = block_places(b, q)  # [b q]
            kv_rows, kv_slots = q_rows, write.reshape(-1)
        return QKVPlacement.build(x.dtype, x.device, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=d,
                                  cos=cos.reshape(-1, d), sin=sin.reshape(-1, d), kv_rows=kv_rows,
                                  kv_slots=kv_slots, q_from=0, q_rows=q_rows, q_cols=q_cols, batch=b, q_len=q)

    def _queries_and_cache(self, layer: NativeLayer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, write: torch.Tensor,
                           real: torch.Tensor | None, b: int, q: int) -> torch.Tensor:
        """PyTorch's operators for what QKVPlacement does in one call: q/k norms, rope, the K/V
        writes -> queries [b, kvh, g * q, d]."""
        cfg = self.cfg
        h, kvh, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.groups, cfg.head_dim
        lead = qkv.shape[:-1]  # [b, q], or [T] without padding
        qs, ks, vs = qkv.split(self._split, dim=-1)
        qs = qs.view(*lead, h, d)
        ks = ks.view(*lead, kvh, d)
        vs = vs.view(*lead, kvh, d)
        if layer.q_norm is not None:
            qs = rms_norm(qs, layer.q_norm, cfg.rms_norm_eps)
            ks = rms_norm(ks, layer.k_norm, cfg.rms_norm_eps)
        qs = rope_bqhd(qs, cos, sin)
        ks = rope_bqhd(ks, cos, sin)
        k_cache[rows, :, write] = ks
        v_cache[rows, :, write] = vs
        if real is not None:
            qs = _spread(qs.reshape(-1, h * d), real, b, q).view(b, q, h, d)
        return qs.view(b, q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * q, d)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
        real: torch.Tensor | None = None,
        resume: tuple[int, torch.Tensor] | None = None,
        greedy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [b, q] (EMPTY = padding) -> logits [b, q|1, V], features [b, q, L*H].

        greedy: the greedy ids [b, q|1] (int64, the argmax of each position's logits, the first of
        ties) in place of the logits; an fp32 head on a CPU is then screened in bf16 and computes
        only the near-maximal logits exactly (cpu/greedy_head.py), the same ids.

        real [T]: flat indices (into b * q) of the tokens that are not padding. The projections,
        norms, rope, K/V writes and the LM head then run on those T tokens only, and attention on
        the [b, q] layout (the kernel skips padding queries); padding positions get zero logits
        and features. What a ragged verify (rows verifying different lengths) or a batch of
        unequal prompts saves: on a CPU the matmuls cost by rows.

        resume (start, x [b, q, H]): x is the output of layer start - 1 (a captured feature), and
        the pass runs layers start.. only; the skipped layers leave no K/V in the cache.
        """
        cfg = self.cfg
        b, q = ids.shape
        h, kvh, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.groups, cfg.head_dim
        # x: [b, q, H], or [T, H] without padding
        start, x = resume if resume is not None else (0, None)
        if x is None:
            x = self.embed(ids if real is None else ids.reshape(-1)[real])
        elif real is not None:
            x = x.reshape(b * q, -1)[real]
        horizon = self._horizon(positions, cache)
        sdpa: tuple | None = None  # `_sdpa_masks`' (mask, causal), at the first layer that needs it
        visible = visible_keys(positions, x.dtype)  # [b, q]: the batch-invariant kernel's, or None
        write = cache.write_index(positions)  # [b, q]
        rows = torch.arange(b, device=ids.device)[:, None]
        if real is not None:  # rope and the K/V writes of the T real tokens only
            write, rows = write.reshape(-1)[real], torch.div(real, q, rounding_mode="floor")  # [T]
            cos, sin = self.rotary(positions.reshape(-1)[real][None], x.dtype)  # [1, T, d]
            cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, d]
        else:
            cos, sin = self.rotary(positions, x.dtype)  # [b, q, d]
            cos, sin = cos[:, :, None], sin[:, :, None]
        place = self._placement(b, q, x, cos, sin, rows, write, real)
        wanted = set(layer_ids)
        captured: dict[int, torch.Tensor] = {}
        last = cfg.num_layers - 1
        single = self.single if b * q == 1 else None
        ran = None
        if real is None and start == 0 and single is None and visible is not None:
            ran = self._run_program(x, place, visible, horizon, cache, layer_ids)
        for i, layer in enumerate(self.layers):
            if i < start or ran is not None:
                continue
            y = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = project(layer.qkv, y) if single is None else _matmul(y, single[i][0], layer.qkv.bias)
            k_cache, v_cache = cache.layer(i)  # [b, kvh, cap + 1, d]
            # Query heads of one KV head attend together: [b, kvh, g * q, d], no K/V repeat.
            qg = None
            if place is not None:
                norms = ((layer.q_norm, cfg.rms_norm_eps), (layer.k_norm, cfg.rms_norm_eps)) \
                    if layer.q_norm is not None else (None, None)
                qg = place(qkv.reshape(-1, qkv.shape[-1]), k_cache, v_cache, *norms)
            if qg is None:
                qg = self._queries_and_cache(layer, qkv, cos, sin, k_cache, v_cache, rows, write, real, b, q)
            out = None if visible is None else cached_attention(qg, k_cache, v_cache, visible, horizon, self.scale)
            if out is None:
                sdpa = sdpa or self._sdpa_masks(positions, cache, horizon)
                out = self._sdpa(qg, k_cache, v_cache, horizon, *sdpa)
            out = out.view(b, kvh, g, q, d).permute(0, 3, 1, 2, 4).reshape(b, q, h * d)
            if real is not None:
                out = out.reshape(b * q, h * d)[real]  # [T, h * d]
            x = project(layer.o, out, residual=x)
            y = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate_up = project(layer.gate_up, y) if single is None else _matmul(y, single[i][1], single[i][2])
            x = project(layer.down, silu_mul(gate_up), residual=x)
            if i in wanted and i != last:
                captured[i] = x
        if ran is not None:
            x, features = ran
        cache.note_written(positions)
        x = rms_norm(x, self.norm, cfg.rms_norm_eps)
        if ran is None:
            if last in wanted:
                captured[last] = x  # HF's hidden_states[-1] is taken after the final norm
            features = torch.cat([captured[i] for i in layer_ids], dim=-1) if layer_ids else None
        elif last in wanted:  # the one-call loop filled the other captured layers' columns
            at = layer_ids.index(last) * cfg.hidden_size
            features[..., at : at + cfg.hidden_size] = x
        if real is not None:
            features = _spread(features, real, b, q) if features is not None else None
            if last_logits_only:  # the last column of every row, padding or not
                x = _spread(x, real, b, q)
        x = x[:, -1:] if last_logits_only else x
        if greedy:
            head = None if self._packed_head_takes(x) else self._screened_head()
            best = None if head is None else head.ids(x)  # [b, q|1], or [T] without padding
            if best is not None:
                return (_spread(best[:, None], real, b, q)[..., 0] if real is not None and not last_logits_only
                        else best), features
        if self.single_head is not None and x.shape[0] * x.shape[1] == 1:
            logits = x @ self.single_head
        else:
            logits = project(self.lm_head, x)
        if real is not None and not last_logits_only:
            logits = _spread(logits, real, b, q)
        return (greedy_ids(logits) if greedy else logits), features

    def _run_program(self, x: torch.Tensor, place: QKVPlacement | None, visible: torch.Tensor, horizon: int,
                     cache: StaticCache, layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The layer loop as one kernel call (cpu/program.py) -> (last layer's output
        [b, q, H], features with every captured layer but the last filled), or None where the
        program does not take this pass (the Python loop then runs: same bits)."""
        b, q, hidden = x.shape
        fn = kernels.kernel()
        if (place is None or not place.full or fn is None or b * q > fn.max_rows.get(x.dtype, 0)
                or len(set(layer_ids)) != len(layer_ids) or torch.is_grad_enabled() and x.requires_grad):
            return None
        program = self._program
        if program is None or not program.fits():
            if program is None and self._program_tried:
                return None
            self._program_tried = True
            program = self._program = target_program(self)
            if program is None:
                return None
        if program.dtype != x.dtype:
            return None
        last = self.cfg.num_layers - 1
        capture = [-1] * self.cfg.num_layers
        for j, i in enumerate(layer_ids):
            if i != last:
                capture[i] = j * hidden
        features = torch.empty(b, q, len(layer_ids) * hidden, dtype=x.dtype) if layer_ids else None
        out = program.run(x.clone(), place, visible, horizon, cache, inter=self.cfg.intermediate_size,
                          scale=self.scale, capture=capture, features=features,
                          packed_max=BF16_MAX_ROWS)  # x.clone(): x stays for a rerun
        return None if out is None else (out, features)

    def packed_summary(self) -> str | None:
        """What `pack_weights` packed, e.g. "120 matrices in 4 bits, 1 in 8 bits", or None."""
        bits = Counter(p.bits for _, m in self._packable() if (p := m.__dict__.get("packed")) is not None)
        if not bits:
            return None
        return ", ".join(f"{n} {'matrices' if n > 1 else 'matrix'} in {b} bits" for b, n in sorted(bits.items()))

    def _packed_head_takes(self, x: torch.Tensor) -> bool:
        """Whether greedy ids of x [..., H] come faster from all the logits of the head's packed
        copy (cpu/packed_weights.py) than from the bf16 screen: up to PACKED_HEAD_ROWS rows (SmolLM2's
        8-bit head after a forward's weights left the cache: 0.76 / 1.02 / 1.26 ms at 1 / 4 / 6
        rows against the screen's 1.30-1.40, 1.70 against 1.46 at 8; with the one-call layer loop,
        held-out DFlash at batch 1 ran 2.4% faster with 6 than with 3).
        The ids are the same either way: both are the argmax of the same fp32 logits, the first of
        ties."""
        packed = self.lm_head.__dict__.get("packed")
        return (packed is not None and x.dtype == torch.float32 and x.numel() <= PACKED_HEAD_ROWS * x.shape[-1]
                and packed.matches(self.lm_head.weight))

    def _screened_head(self) -> GreedyHead | None:
        """The LM head's bf16 screen (cpu/greedy_head.py), rebuilt if the weight changed; None
        where it does not apply (not fp32 on a CPU, no kernel) and the logits are computed."""
        w = self.lm_head.weight
        if not GreedyHead.available(w):
            return None
        if self._greedy_head is None or not self._greedy_head.fits(w):
            self._greedy_head = GreedyHead(w)
        return self._greedy_head


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2 I] -> [..., I]: the CPU kernel's (the same bits as the
    one-call layer loop) where it takes it, else PyTorch's."""
    out = kernels.silu_mul(gate_up)
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def _spread(t: torch.Tensor, real: torch.Tensor, b: int, q: int) -> torch.Tensor:
    """Rows t [T, n] of the tokens at flat indices `real` -> [b, q, n], zero at padding."""
    out = t.new_zeros(b * q, t.shape[-1])
    out[real] = t
    return out.view(b, q, t.shape[-1])


def padding_index(positions: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of the non-padding tokens of positions [b, q] (CPU), or None when there is
    no padding (or the tensor lives on a GPU, where finding it would cost a host sync and the
    kernels do not price by rows alike)."""
    if positions.device.type != "cpu" or positions.numel() <= 1:
        return None
    valid = positions.reshape(-1) != EMPTY
    if bool(valid.all()):
        return None
    return valid.nonzero()[:, 0]


class NativeTarget:
    """The Target protocol (see targets/hf.py) over a NativeLlama and StaticCaches."""

    def __init__(self, net: NativeLlama, eos_token_ids: tuple[int, ...] = (), hf_config: object | None = None) -> None:
        self.net = net.eval()
        self.config = hf_config  # the Hugging Face (text) config, e.g. to shape a fresh drafter
        cfg = net.cfg
        self.info = TargetInfo(
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers,
            max_position_embeddings=cfg.max_position_embeddings,
            model_type=cfg.model_type,
            eos_token_ids=tuple(eos_token_ids),
        )

    @property
    def device(self) -> torch.device:
        return self.net.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.embed.weight.dtype

    @property
    def skips_padding(self) -> bool:
        """Whether padding tokens (EMPTY positions) cost nothing in `forward`'s matmuls, so rows
        of a batch may verify different lengths for the price of their sum (`padding_index`)."""
        return self.device.type == "cpu"

    def new_cache(self, batch: int, capacity: int = 64) -> StaticCache:
        cfg = self.net.cfg
        store = KVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device,
                        rows=max(1, batch), capacity=capacity)
        return StaticCache(store, 0, batch)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw input embeddings [b, n, H] (Llama-family targets do not scale them)."""
        return F.embedding(ids, self.net.embed.weight)

    def head(self) -> nn.Module:
        return self.net.lm_head

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as HFTarget.forward; positions are absolute, EMPTY marks padding."""
        return self._run(ids, positions, cache, layer_ids, last_logits_only, greedy=False)

    @torch.inference_mode()
    def forward_greedy(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, but the greedy ids [b, q|1] in place of the logits (see targets/hf.py's
        `greedy_forward`): on a CPU an fp32 head computes only its near-maximal logits exactly."""
        return self._run(ids, positions, cache, layer_ids, last_logits_only, greedy=True)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, layer_ids: tuple[int, ...],
             last_logits_only: bool, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not cache.fresh:
            cache.reserve(int(positions.max()) + 1)
        return self.net(ids, positions, cache, layer_ids, last_logits_only, real=padding_index(positions),
                        greedy=greedy)

    @torch.inference_mode()
    def final_hidden(self, ids: torch.Tensor, start: int, x: torch.Tensor) -> torch.Tensor:
        """What the LM head reads (the final norm's output) [b, q, H] for whole sequences ids
        [b, q] from position 0, given x [b, q, H], the output of layer start - 1: only layers
        start.. run (a training teacher's logits from a captured late-layer feature)."""
        cfg = self.net.cfg
        if not 0 < start <= cfg.num_layers:
            raise ValueError(f"start must be in 1..{cfg.num_layers}, got {start}")
        b, q = ids.shape
        positions = torch.arange(q, device=self.device)[None].expand(b, q)
        cache = self.new_cache(b, capacity=q)
        last = cfg.num_layers - 1
        _, feats = self.net(ids.to(self.device), positions, cache, (last,), last_logits_only=True,
                            resume=(start, x.to(self.device, self.dtype)))
        return feats


__all__ = ["EMPTY", "NativeLlama", "NativeTarget", "rms_norm"]
