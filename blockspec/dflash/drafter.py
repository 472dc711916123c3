"""The DFlash drafter: a block-diffusion transformer conditioned on target hidden states.

Checkpoint-compatible with the published DFlash drafters (docs/DESIGN.md section 2): a Qwen3-style
layer stack with KV injection of the target's context features in every layer, `fc` +
`hidden_norm` to fuse the chosen target layers, and no embedding table or LM head of its own.
This file holds the modules and the ways to build one (new, load, save); its config is
dflash/drafter_config.py, its files dflash/checkpoint.py.

The model is stateless: context K/V live in a cache owned by the caller (`DraftContextCache`,
dflash/draft_cache.py). `DFlashDrafter.forward` is the drafter's one layer sequence; the cache's
`DraftPass` decides where K/V are stored, which keys each query sees and which kernels run the
products: `DraftCache`'s (`ConcatPass`: the modules' own calls, for training and as the
reference) or the static drafter's slot cache on the CPU kernels (dflash/static_drafter.py),
which parity tests hold equal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.errors import ConfigError
from blockspec.cpu.argmax import argmax_and_peak, greedy_ids
from blockspec.cpu.int8 import Int8Weight, int8_linear, quantize_weight
from blockspec.cpu.linear import linear, project
from blockspec.cpu.top_k import top_logprobs
from blockspec.dflash.checkpoint import (
    CONFIG_NAME,
    DRAFT_VOCAB_NAME,
    check_tensors,
    compact_codebooks,
    read_draft_vocab,
    read_drafter_config,
    read_tensors,
    write_tensors,
)
from blockspec.dflash.conv import BlockConv
from blockspec.dflash.draft_cache import ConcatPass, DraftCache, DraftContextCache, DraftPass
from blockspec.dflash.drafter_config import (
    DFLASH,
    DFLASH2,
    DFLASH2_DEFAULTS,
    DrafterConfig,
    check_compatible,
    default_target_layer_ids,
)
from blockspec.dflash.selector import CandidateSelector, Pick, pick_best
from blockspec.dflash.sampling import spread
from blockspec.targets.rope import Rotary, apply_rope, rope_inv_freq


@dataclass(frozen=True)
class Candidates:
    """DFlash 2's candidate sets: per position the top-K token ids [.., K] of the unary draft
    distribution, their logits [.., K] (float32, descending) and the distribution's log
    normaliser [..] (float32; None where not asked for)."""

    ids: torch.Tensor
    logits: torch.Tensor
    logsumexp: torch.Tensor | None


def keep_scores(t: int, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy walk's pick that keeps each position's scores (for the proposals' confidence)."""
    return pick_best(t, scores)[0], scores


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.causal = cfg.block_causal
        self.sliding_window = cfg.sliding_window if sliding else None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_ctx: tuple[torch.Tensor, torch.Tensor],
        attend: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """x [b, q, H] normed block input, ctx [b, c, H] fused context features -> [b, q, H].

        `attend(q [b, h, q, d], k_ctx, v_ctx [b, kvh, c, d], k_blk, v_blk [b, kvh, q, d])` is the
        cache's part (`ConcatPass`): it stores the context K/V and returns [b, h, q, d].
        """
        b, q, _ = x.shape
        qh = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        k_ctx = self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads)).transpose(1, 2)
        k_blk = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v_ctx = self._heads(self.v_proj(ctx), self.num_kv_heads).transpose(1, 2)
        v_blk = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        qh = apply_rope(qh, *rope_block)
        k_ctx = apply_rope(k_ctx, *rope_ctx)
        k_blk = apply_rope(k_blk, *rope_block)
        out = attend(qh, k_ctx, v_ctx, k_blk, v_blk)  # [b, h, q, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, q, self.num_heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self.gate_proj, x, exact=False), project(self.up_proj, x, exact=False)
        return project(self.down_proj, F.silu(gate) * up, exact=False)  # proposals: no need of batch invariance


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DFlash 2: a convolution inside the block around each sublayer (dflash/conv.py)
        self.attention_conv = self.mlp_conv = None
        if cfg.dflash2:
            self.attention_conv = BlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = BlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)


INT8_WEIGHT_BITS = (4, 8)  # a drafter's weight forms in the int8 mode; the first is the default
INT8_BITS_ENV = "BLOCKSPEC_DRAFTER_BITS"


def int8_weight_bits() -> int:
    """The int8 mode's drafter weight bits a new drafter takes: $BLOCKSPEC_DRAFTER_BITS (4 or 8),
    else 4. Why 4 by default: a drafting step reads the drafter's layers and draft head (~24 MB
    in 8 bits) cold after every target pass, and the 4-bit forms (~14 MB) cost fewer accepted
    proposals than the time they save (BENCHMARKS.md, "The drafter's weights in 4 bits")."""
    value = os.environ.get(INT8_BITS_ENV, "").strip()
    if not value:
        return INT8_WEIGHT_BITS[0]
    if value not in {str(bits) for bits in INT8_WEIGHT_BITS}:
        raise ConfigError(f"{INT8_BITS_ENV} must be 4 or 8 (the drafter's weight bits in the int8 mode), got {value!r}")
    return int(value)


class DFlashDrafter(nn.Module):
    """Stateless DFlash draft network. Use `load_drafter` / `new_drafter` to build one."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hf = cfg.hf_rope_config() if cfg.rope_scaling else None
        inv_freq, scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, hf)
        self.rotary = Rotary(inv_freq, scaling)
        self.candidate_selector = None
        if cfg.dflash2:
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        self.register_buffer("draft_vocab", None, persistent=False)  # [Vd] sorted token ids, or None
        self._head_rows: tuple | None = None  # (key, weight [Vd, H], bias [Vd] | None, Int8Weight | None)
        self.compute = "exact"  # how the static pass and the restricted draft head compute (`use_compute`)
        self.int8_bits = int8_weight_bits()  # the int8 mode's weight forms: 4 or 8 bits (`use_compute`)

    def use_compute(self, compute: str, bits: int | None = None) -> str:
        """Computes the static pass's products (dflash/static_drafter.py) and the restricted draft
        head as `compute` says: "int8" (8-bit activations times integer weights, cpu/int8.py: the
        target's int8 mode; an fp32 drafter on the CPU only, else it stays exact) or "exact".
        `bits`: the int8 mode's weight forms, 4 (Q4_1's, the default: 0.6 of the bytes of a pass
        that reads its weights cold after every target pass) or 8 (Q8_0's); None keeps them.
        Proposals change with it, never the output (the target verifies). Returns the mode taken."""
        if compute not in ("exact", "int8"):
            raise ConfigError(f"a drafter computes 'exact' or 'int8', got {compute!r}")
        if bits is not None:
            if bits not in INT8_WEIGHT_BITS:
                raise ConfigError(f"a drafter's int8 weight forms have 4 or 8 bits, got {bits!r}")
            self.int8_bits = bits
        w = self.fc.weight
        fits = w.dtype == torch.float32 and w.device.type == "cpu" and w.shape[1] % 32 == 0
        self.compute = "int8" if compute == "int8" and fits else "exact"
        return self.compute

    def set_draft_vocab(self, token_ids: torch.Tensor | list[int] | None, vocab_size: int | None = None) -> None:
        """Restricts proposals to these token ids (None: the whole vocabulary)."""
        self._head_rows = None
        if token_ids is None:
            self.draft_vocab = None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ConfigError("a draft vocabulary needs at least one token id")
        ids = torch.unique(ids)  # sorted
        if int(ids[0]) < 0 or (vocab_size is not None and int(ids[-1]) >= vocab_size):
            raise ConfigError(f"draft vocabulary ids must lie in [0, {vocab_size}); got {int(ids[0])}..{int(ids[-1])}")
        self.draft_vocab = ids.to(self.fc.weight.device)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def new_cache(self, batch: int) -> DraftCache:
        return DraftCache(self.cfg.num_hidden_layers, batch, self.fc.weight.device)

    def forward(
        self,
        ctx_features: torch.Tensor,
        ctx_positions: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DraftContextCache | None = None,
        attn_mask: torch.Tensor | dict[int | None, torch.Tensor] | None = None,
        block_len: int | None = None,
    ) -> torch.Tensor:
        """One draft pass; returns the final hidden states of the block [b, q, H].

        ctx_features [b, c, L*H]: target features of tokens not yet in the cache (c may be 0),
        at ctx_positions [b, c] (EMPTY for padding); block_embeds [b, q, H] at block_positions.
        The new context K/V stay in `cache` (None: a `DraftCache` for this pass alone); block K/V
        are dropped. The cache's pass (`DraftPass`) decides how they are stored and read.
        `attn_mask` [b, 1, q, c+q] (bool) replaces the inference masks: training packs many
        blocks into one pass and says itself who sees whom, with one tensor for every layer or
        one per sliding window (None: full attention layers) of the drafter's layers.
        `block_len`: the q block tokens are blocks of this many laid end to end (training), which
        DFlash 2's convolutions never cross; None: one block.
        """
        b, q, _ = block_embeds.shape
        ctx_features, block_embeds = self.own_dtype(ctx_features), self.own_dtype(block_embeds)
        cache = self.new_cache(b) if cache is None else cache  # then it holds this pass's K/V only
        run = cache.open_pass(self, ctx_positions, block_positions, attn_mask)
        ctx = run.norm(self.hidden_norm, run.linear(self.fc, run.context(ctx_features)))
        h = run.layers(block_embeds, ctx)
        if h is None:
            h = block_embeds
            block_len = q if block_len is None else block_len
            for i, layer in enumerate(self.layers):
                x = run.norm(layer.input_layernorm, h)
                if layer.attention_conv is not None:  # DFlash 2 (dflash/conv.py): q/k/v read conv(x)
                    x, delta = layer.attention_conv.prepare(x, block_len)
                out = run.attention(i, layer.self_attn, ctx, x)
                if layer.attention_conv is not None:
                    out = layer.attention_conv.finish(out, delta, block_len)
                h = h + out
                x = run.norm(layer.post_attention_layernorm, h)
                if layer.mlp_conv is not None:
                    x, delta = layer.mlp_conv.prepare(x, block_len)
                out = run.mlp(i, layer.mlp, x)
                if layer.mlp_conv is not None:
                    out = layer.mlp_conv.finish(out, delta, block_len)
                h = h + out
        run.close()
        return run.norm(self.norm, h)

    def own_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """x in this drafter's dtype: the target may run in another one (e.g. fp32 target, bf16
        drafter on a CPU with bf16 units: drafting is cheaper, verification stays exact)."""
        dtype = self.fc.weight.dtype
        return x if x.dtype == dtype else x.to(dtype)

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Draft logits from hidden states with the target's output head [.., V], in the head's
        dtype; -inf outside the draft vocabulary when one is set (only those head rows are computed)."""
        if self.draft_vocab is None:
            if isinstance(head, nn.Linear):  # the full head is the target's: never copied
                return self._shape_logits(project(head, hidden.to(head.weight.dtype), exact=False))
            return self._shape_logits(head(hidden))
        sub, support = self.draft_logits(hidden, head)  # [.., Vd]
        return spread(sub, support, head.weight.shape[0])

    def draft_logits(self, hidden: torch.Tensor, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logits` without the -inf: with a draft vocabulary its tokens' logits [.., Vd] (the
        head's dtype) and their ids [Vd] (ascending), else the full logits [.., V] and None."""
        if self.draft_vocab is None:
            return self.logits(hidden, head), None
        return self._draft_vocab_logits(hidden, head).to(head.weight.dtype), self.draft_vocab

    def greedy_tokens(self, hidden: torch.Tensor, head: nn.Module, anchor: torch.Tensor | None = None,
                      forced: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy proposals for hidden [b, n, H] (block positions 1..n): the argmax of
        `logits(hidden, head)` [b, n] without building full-vocabulary logits, or for DFlash 2 the
        selector's greedy walk from `anchor` [b] (see `walk`; `forced` as there)."""
        if self.candidate_selector is not None:
            return self.greedy_with_confidence(hidden, head, anchor, forced, confidence=False)[0]
        if self.draft_vocab is None:
            return greedy_ids(self.logits(hidden, head))
        # draft_vocab is sorted, so ties break towards the lower token id as a full argmax would.
        return self.draft_vocab[greedy_ids(self._draft_vocab_logits(hidden, head))]

    def greedy_with_confidence(self, hidden: torch.Tensor, head: nn.Module, anchor: torch.Tensor | None = None,
                               forced: torch.Tensor | None = None, *, confidence: bool = True,
                               cands: Candidates | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`greedy_tokens` [b, n] and the draft probability of each [b, n] (float32): how likely
        the drafter thinks its proposal is, which is what an adaptive step trims its verify by.
        DFlash 2: the walk's choice within the unary distribution whose candidates' logits are
        replaced by the selector's scores (the tokens outside the candidates keep their mass);
        `cands`: `candidates(hidden, head)` computed already (with the normaliser where
        `confidence`), which saves the head pass."""
        if self.candidate_selector is None:
            logits, support = self.greedy_logits(hidden, head)
            top, conf = argmax_and_peak(logits)
            ids = support[top] if support is not None else top
            return ids, conf
        if cands is None:
            cands = self.candidates(hidden, head, normaliser=confidence)
        ids, scores = self.walk(hidden, cands, anchor, keep_scores if confidence else pick_best, forced)
        if not confidence:
            return ids, None
        outside = cands.logsumexp + torch.log1p(-torch.exp(cands.logits.logsumexp(-1) - cands.logsumexp).clamp(max=1.0))
        total = torch.logaddexp(scores.logsumexp(-1), outside)  # [b, n]
        return ids, torch.exp(scores.max(dim=-1).values - total)

    def greedy_logits(self, hidden: torch.Tensor, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits a greedy proposal and its confidence are read from (`greedy_with_confidence`
        without a selector): with a draft vocabulary its tokens' logits [.., Vd] as the restricted
        head computes them and their ids [Vd] (ascending), else the full logits [.., V] and None."""
        if self.draft_vocab is not None:
            return self._draft_vocab_logits(hidden, head), self.draft_vocab
        return self.logits(hidden, head), None

    def top_logprobs(self, hidden: torch.Tensor, head: nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely proposals at each position of hidden [.., H]: their draft
        log-probabilities [.., k] (float32, descending) and token ids [.., k], the greedy
        distribution `logits` gives, computed over the draft vocabulary alone when one is set
        (the rest has probability 0) instead of over full-vocabulary logits. Equal logits rank the
        lower token id first (cpu/top_k.py), as `greedy_tokens` breaks ties: the first column is
        the greedy proposal (draft_vocab is sorted, so its order is the token ids')."""
        if self.draft_vocab is None:
            logits = self.logits(hidden, head)  # [.., V]
        else:
            logits = self._draft_vocab_logits(hidden, head)  # [.., Vd]
        top, index = top_logprobs(logits, min(k, logits.shape[-1]))  # [.., k]
        return top, (index if self.draft_vocab is None else self.draft_vocab[index])

    def candidates(self, hidden: torch.Tensor, head: nn.Module, *, normaliser: bool = True) -> Candidates:
        """DFlash 2: the K = selector_top_k most likely tokens of the unary draft distribution
        at each position of hidden [.., H] (within the draft vocabulary when one is set), with
        the distribution's normaliser unless `normaliser` is False."""
        if self.draft_vocab is None:
            logits = self.logits(hidden, head)  # [.., V]
        else:
            logits = self._draft_vocab_logits(hidden, head)  # [.., Vd]
        top, index = logits.topk(min(self.cfg.selector_top_k, logits.shape[-1]), dim=-1)  # [.., K], descending
        ids = index if self.draft_vocab is None else self.draft_vocab[index]
        top = top.float()
        lse = None
        if normaliser:  # log sum e^x = max - log softmax(max): the peak kernel's one pass over the logits
            lse = top[..., 0] - argmax_and_peak(logits)[1].log()
        return Candidates(ids, top, lse)

    def selector_scores(self, hidden: torch.Tensor, prev: torch.Tensor, cands: Candidates) -> torch.Tensor:
        """DFlash 2: S(prev, c) for the candidates c of each position [.., K] (float32), with the
        predecessor prev [..] given (training: the true previous token)."""
        return self.candidate_selector.scores(hidden, prev, cands.ids, cands.logits)

    def walk(self, hidden: torch.Tensor, cands: Candidates, anchor: torch.Tensor | None, pick: Pick,
             forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DFlash 2: proposals for hidden [b, n, H] by the selector's walk over `cands` from
        anchor [b] (the last verified token); `pick` chooses at each position (dflash/selector.py).
        forced [b, n]: token ids fixed in advance (-1 where free), which the walk goes on from.
        Returns (ids [b, n], what `pick` kept [b, n, K] or None)."""
        if anchor is None:
            raise ValueError("a DFlash 2 drafter's proposals need the anchor (the last verified token of each row)")
        return self.candidate_selector.walk(hidden, cands.ids, cands.logits, anchor, pick, forced)

    def _draft_vocab_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        weight, bias, integer = self._restricted_head(head)
        if integer is not None:  # the int8 mode: the head's rows in 8 bits read a quarter of fp32's bytes
            return self._shape_logits(int8_linear(hidden.float(), integer, bias))  # [.., Vd] fp32
        return self._shape_logits(linear(hidden.to(weight.dtype), weight, bias, exact=False))  # [.., Vd]

    def _restricted_head(self, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, Int8Weight | None]:
        """The head's draft-vocabulary rows [Vd, H] and bias [Vd] in the drafter's dtype, and in
        the int8 mode their integer form (else None)."""
        w = head.weight
        dtype = self.fc.weight.dtype  # the rows are a copy anyway: keep them in the drafter's dtype
        key = (w.data_ptr(), w.dtype, w.device, self.draft_vocab.data_ptr(), dtype, self.compute, self.int8_bits)
        if self._head_rows is None or self._head_rows[0] != key:  # the target head is frozen
            bias = getattr(head, "bias", None)
            rows = w.detach()[self.draft_vocab].to(dtype).contiguous()
            integer = quantize_weight(rows, self.int8_bits) if self.compute == "int8" else None
            self._head_rows = (key, rows, None if bias is None else bias.detach()[self.draft_vocab].to(dtype),
                               integer)
        return self._head_rows[1:]

    def _shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None and float(cap) > 0:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits


def init_drafter_weights(model: DFlashDrafter, std: float = 0.02, seed: int | None = None) -> None:
    """Normal(0, std) linear weights and unit norms, as Hugging Face initialises Qwen3. DFlash 2:
    identity convolutions, Normal(0, std) selector codebooks."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def normal(t: torch.Tensor) -> None:
        t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                normal(module.weight)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, CandidateSelector):
                normal(module.predecessor_codebook)
                normal(module.successor_codebook)
        for module in model.modules():
            if isinstance(module, BlockConv):
                module.reset_identity()


def new_drafter(
    *,
    hidden_size: int,
    vocab_size: int,
    num_target_layers: int,
    mask_token_id: int,
    num_layers: int = 1,
    block_size: int = 16,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    rms_norm_eps: float = 1e-6,
    rope_theta: float = 1_000_000.0,
    max_position_embeddings: int = 40960,
    input_embedding_scale: float = 1.0,
    architecture: str = DFLASH,
    dflash2: dict | None = None,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A freshly initialised drafter with explicit shapes (see `new_drafter_for_target`).
    architecture DFLASH2: a DFlash 2 drafter, its keys (DFLASH2_DEFAULTS) overridden by `dflash2`."""
    heads = num_attention_heads or max(1, hidden_size // 64)
    extra = {}
    if architecture == DFLASH2:
        extra = {"architecture": DFLASH2, **DFLASH2_DEFAULTS, **(dflash2 or {})}
    elif dflash2:
        raise ConfigError(f"DFlash 2 settings {sorted(dflash2)} given for a {architecture} drafter")
    cfg = DrafterConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or heads,
        head_dim=head_dim or hidden_size // heads,
        vocab_size=vocab_size,
        num_target_layers=num_target_layers,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(num_target_layers, num_layers)),
        block_size=block_size,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        input_embedding_scale=input_embedding_scale,
        **extra,
    )
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=seed)
    return model.to(dtype).eval()


def new_drafter_for_target(
    target_config: object,
    *,
    mask_token_id: int,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: tuple[int, ...] | None = None,
    architecture: str = DFLASH,
    dflash2: dict | None = None,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A randomly initialised drafter shaped for a Hugging Face target config, in one call
    (architecture and dflash2 as `new_drafter` takes them).

    Attention/MLP shapes follow the target's layers, so draft layers could be initialised from
    target layers. Targets that scale their embeddings (Gemma) get `input_embedding_scale`. A
    target without a dense MLP size (a MoE such as Qwen3.5-MoE) gets 3 x hidden, the width of the
    published Qwen3.6-35B-A3B drafter.
    """
    cfg = getattr(target_config, "text_config", None) or target_config
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    rope_theta = getattr(cfg, "rope_theta", None)
    params = getattr(cfg, "rope_parameters", None)
    if rope_theta is None and isinstance(params, dict):
        rope_theta = params.get("rope_theta")
    from blockspec.targets.hf import embedding_scale_of

    scale = embedding_scale_of(cfg)
    return new_drafter(
        hidden_size=hidden,
        vocab_size=int(cfg.vocab_size),
        num_target_layers=int(cfg.num_hidden_layers),
        mask_token_id=mask_token_id,
        num_layers=num_layers,
        block_size=block_size,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
        intermediate_size=int(getattr(cfg, "intermediate_size", None) or 3 * hidden),
        target_layer_ids=target_layer_ids,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta or 10000.0),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 40960)),
        input_embedding_scale=scale,
        architecture=architecture,
        dflash2=dflash2,
        seed=seed,
        dtype=dtype,
    )


def save_drafter(model: DFlashDrafter, path: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes config.json and safetensors weights (sharded with an index when large)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    state = model.state_dict()
    sel = model.candidate_selector
    if sel is not None and sel.token_ids is not None and not (
            model.draft_vocab is not None and torch.equal(sel.token_ids.cpu(), model.draft_vocab.cpu())):
        # compact codebooks are stored over the draft vocabulary saved beside them: any other
        # vocabulary gets the published [V, r] layout
        state |= {f"candidate_selector.{k}": v for k, v in sel.published().items()}
    write_tensors(state, path, max_shard_bytes=max_shard_bytes)
    (path / DRAFT_VOCAB_NAME).unlink(missing_ok=True)  # an earlier save's, for another vocabulary
    if model.draft_vocab is not None:
        save_file({"token_ids": model.draft_vocab.detach().cpu().contiguous()}, str(path / DRAFT_VOCAB_NAME))
    return path


def load_drafter(
    path: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu", draft_vocab: bool = True
) -> DFlashDrafter:
    """Loads a drafter in the published DFlash format from a local directory; `draft_vocab`
    False ignores a draft_vocab.safetensors beside it (propose from the whole vocabulary)."""
    path = Path(path)
    cfg = read_drafter_config(path)
    state = read_tensors(path)
    ids = read_draft_vocab(path, cfg.vocab_size)
    check_tensors(cfg, state, path, draft_vocab=ids)
    model = DFlashDrafter(cfg)
    stored = next(iter(state.values())).dtype
    if compact_codebooks(cfg, state):  # codebook rows over the draft vocabulary, read even when unused
        model.candidate_selector.use_rows(ids)
    model.load_state_dict(state)
    if draft_vocab and ids is not None:
        model.set_draft_vocab(ids, cfg.vocab_size)
    return model.to(device=device, dtype=dtype or stored).eval()


# The drafter's public names, with those of its config, cache and files, which the package and
# its users import from here.
__all__ = [
    "DFLASH",
    "DFLASH2",
    "DFLASH2_DEFAULTS",
    "Candidates",
    "ConcatPass",
    "DFlashDrafter",
    "DraftAttention",
    "DraftCache",
    "DraftContextCache",
    "DraftLayer",
    "DraftMLP",
    "DraftPass",
    "DrafterConfig",
    "RMSNorm",
    "check_compatible",
    "default_target_layer_ids",
    "init_drafter_weights",
    "keep_scores",
    "load_drafter",
    "new_drafter",
    "new_drafter_for_target",
    "read_drafter_config",
    "save_drafter",
]
