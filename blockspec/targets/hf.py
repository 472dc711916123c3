"""The Hugging Face adapter: any transformers causal LM as a DFlash target."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.errors import CheckpointError, ConfigError
from blockspec.targets.base import DTYPES, Target, TargetCache, TargetInfo, greedy_forward
from blockspec.targets.gated_delta import DeltaState, delta_forward, is_gated_delta
from blockspec.targets.slots import EMPTY, SlotTable, gather_slots
from blockspec.targets.tree_mask import check_tree_pass, tree_visibility

# Layer kinds the adapter decodes exactly: attention through per-slot masks, Gated DeltaNet
# linear attention through states it rolls back (targets/gated_delta.py).
ATTENTION_KINDS = ("full_attention", "sliding_attention")
LINEAR_KIND = "linear_attention"
# Attention implementations that take an explicit [b, 1, q, S] mask: a boolean one (SDPA) or an
# additive one (eager). Flash and flex attention take other forms and cannot express per-slot masks.
MASK_FORMS = {"sdpa": "bool", "eager": "additive"}


class HFCache:
    """A transformers DynamicCache whose slots follow a SlotTable (see targets/slots.py), plus
    the rolled-back states of a hybrid target's linear-attention layers (layer index -> state)."""

    def __init__(self, batch: int, device: torch.device | str, linear: dict[int, DeltaState] | None = None) -> None:
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self.slots = SlotTable(batch, device)
        self.linear = linear or {}

    def lengths(self) -> torch.Tensor:
        return self.slots.lengths()

    def reserve(self, n: int, capacity: int = 0) -> None:
        """Nothing to do: the DynamicCache grows as forwards append to it."""

    def reject(self, keep: torch.Tensor) -> None:
        """keep [b, n] over the last forward's n tokens; linear-attention states go back to the
        last kept token of each row."""
        self.slots.reject(keep)
        for state in self.linear.values():
            state.commit(keep)

    def _layers(self) -> list:
        return [layer for layer in self.kv.layers if getattr(layer, "keys", None) is not None]

    def compact(self, ratio: float) -> None:
        index = self.slots.compaction_plan(ratio)
        if index is None:
            return
        self.slots.apply(index)
        for layer in self._layers():
            layer.keys = gather_slots(layer.keys, index)
            layer.values = gather_slots(layer.values, index)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.slots.select_rows(rows)
        for layer in self._layers():
            layer.keys = layer.keys[rows]
            layer.values = layer.values[rows]
        for state in self.linear.values():
            state.select_rows(rows)

    def spawn(self, batch: int) -> HFCache:
        """A new, empty cache for `batch` rows (the same as the target's `new_cache`)."""
        linear = {i: state.spawn(batch) for i, state in self.linear.items()}
        return HFCache(batch, self.slots.positions.device, linear)

    def merge(self, other: HFCache) -> None:
        """Appends other's rows (requests joining a running batch); the table with fewer slots
        is left-padded with empty slots."""
        width = max(self.slots.num_slots, other.slots.num_slots)

        def pad(t: torch.Tensor, dim: int, value: float) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([torch.full(shape, value, dtype=t.dtype, device=t.device), t], dim=dim)

        self.slots.positions = torch.cat([pad(self.slots.positions, 1, EMPTY), pad(other.slots.positions, 1, EMPTY)])
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys = torch.cat([pad(mine.keys, 2, 0.0), pad(theirs.keys, 2, 0.0)])
            mine.values = torch.cat([pad(mine.values, 2, 0.0), pad(theirs.values, 2, 0.0)])
        for i, state in self.linear.items():
            state.merge(other.linear[i])


def _decoder(model: nn.Module) -> nn.Module:
    """The inner decoder (the module holding `layers` and `norm`) of a CausalLM."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ConfigError(
            f"{type(model).__name__} has no decoder with .layers; only decoder-only causal LMs "
            "(Llama, Qwen2, Qwen3, Gemma3, ...) are supported"
        )
    return inner


def _layer_kinds(decoder: nn.Module, text: object, model_type: str) -> list[str]:
    """Each decoder layer's kind (see ATTENTION_KINDS, LINEAR_KIND); refuses layers whose state
    the adapter cannot roll back or whose attention it cannot mask."""
    layers = list(decoder.layers)
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * len(layers))
    if len(kinds) < len(layers):
        raise ConfigError(f"{model_type}: config.layer_types lists {len(kinds)} layers, the model has {len(layers)}")
    for i, layer in enumerate(layers):
        kind = kinds[i]
        mixers = [n for n in _STATEFUL_MIXERS if getattr(layer, n, None) is not None]
        if kind == LINEAR_KIND and mixers == ["linear_attn"] and is_gated_delta(layer.linear_attn):
            continue
        if kind in ATTENTION_KINDS and not mixers and getattr(layer, "self_attn", None) is not None:
            continue
        what = f"{kind!r} layers" if kind not in ATTENTION_KINDS + (LINEAR_KIND,) else f"layer {i} ({type(layer).__name__})"
        raise ConfigError(
            f"{model_type} is not supported as a target: blockspec cannot decode its {what} exactly (it rolls back "
            "attention K/V and Gated DeltaNet states only); supported: Llama, Qwen2/3, Qwen3-MoE, GLM-4-MoE, "
            "Gemma 3, gpt-oss, Qwen3-Next, Qwen3.5/3.6"
        )
    return kinds[: len(layers)]


# Submodule names of token mixers that keep a state other than attention K/V.
_STATEFUL_MIXERS = ("linear_attn", "mamba", "mixer", "conv", "short_conv", "ssm", "recurrent", "rwkv")


def _linear_forward(module: nn.Module, state: DeltaState, valid: torch.Tensor):
    def forward(hidden_states: torch.Tensor, cache_params: object = None, attention_mask: object = None,
                **_: object) -> torch.Tensor:
        return delta_forward(module, hidden_states, state, valid)

    return forward


class HFTarget:
    """Adapter for a `transformers` causal LM whose decoder layers attend (full or sliding
    window, with or without attention sinks) or are Gated DeltaNet linear attention; anything
    else is refused, since its state could not be rolled back after a rejection."""

    skips_padding = False  # transformers' layers compute padding rows like any other

    def __init__(self, model: nn.Module, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.model = model.eval()
        self.decoder = _decoder(model)
        cfg = model.config
        text = getattr(cfg, "text_config", None) or cfg
        self.config = text
        model_type = str(getattr(text, "model_type", "unknown"))
        self._kinds = _layer_kinds(self.decoder, text, model_type)
        self._sliding = "sliding_attention" in self._kinds
        self._window = getattr(text, "sliding_window", None) if self._sliding else None
        self._linear = {i: layer.linear_attn for i, layer in enumerate(self.decoder.layers)
                        if self._kinds[i] == LINEAR_KIND}
        impl = str(getattr(text, "_attn_implementation", None) or getattr(cfg, "_attn_implementation", None) or "eager")
        if impl not in MASK_FORMS and len(self._linear) < len(self._kinds):
            raise ConfigError(
                f"{model_type} is loaded with attn_implementation={impl!r}, which cannot take the per-slot masks "
                f"speculative decoding needs; load it with attn_implementation='sdpa' or 'eager'"
            )
        self._mask_form = MASK_FORMS.get(impl, "bool")
        embed = model.get_input_embeddings()
        self.info = TargetInfo(
            hidden_size=int(text.hidden_size),
            vocab_size=int(embed.weight.shape[0]),
            num_layers=len(self.decoder.layers),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 2048)),
            model_type=model_type,
            eos_token_ids=tuple(eos_token_ids),
        )
        self._captured: dict[int, torch.Tensor] = {}
        self._wanted: tuple[int, ...] = ()
        for i, layer in enumerate(self.decoder.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, index: int):
        def capture(_module: nn.Module, _inputs: object, output: object) -> None:
            if index in self._wanted:
                self._captured[index] = output[0] if isinstance(output, tuple) else output

        return capture

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def new_cache(self, batch: int) -> HFCache:
        linear = {i: DeltaState.zeros(m, batch, self.dtype, self.device) for i, m in self._linear.items()}
        return HFCache(batch, self.device, linear)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw (unscaled) input embeddings [b, n, H]: the drafter applies its own scale."""
        return F.embedding(ids, self.model.get_input_embeddings().weight)

    def head(self) -> nn.Module:
        head = getattr(self.model, "lm_head", None)
        return head if head is not None else self.model.get_output_embeddings()

    def _masks(self, cache: HFCache, positions: torch.Tensor, ancestors: torch.Tensor | None = None
               ) -> torch.Tensor | dict:
        """The attention mask in the form the attention implementation takes; with several layer
        kinds, one per kind (linear-attention layers take none: padding comes from positions).
        With `ancestors`, the last tokens are a token tree's nodes (targets/tree_mask.py)."""
        def visible(window: int | None) -> torch.Tensor:
            if ancestors is not None:
                return tree_visibility(cache.slots, positions, ancestors, sliding_window=window)
            return cache.slots.attention_mask(positions, causal=True, sliding_window=window)

        full = self._form(visible(None))
        if set(self._kinds) == {"full_attention"}:
            return full
        masks: dict = {"full_attention": full, LINEAR_KIND: None}
        if self._sliding:
            masks["sliding_attention"] = self._form(visible(self._window))
        return masks

    def _form(self, visible: torch.Tensor) -> torch.Tensor:
        if self._mask_form == "bool":
            return visible
        # eager attention adds the mask to the scores
        zero = torch.zeros((), dtype=self.dtype, device=visible.device)
        return torch.where(visible, zero, torch.finfo(self.dtype).min)

    @property
    def supports_trees(self) -> bool:
        """Attention-only models verify trees; Gated DeltaNet layers hold one branch's state."""
        return not self._linear

    @torch.no_grad()
    def forward_tree(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ancestors: torch.Tensor,
        cache: HFCache,
        layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One verify pass over a token tree per row: ids, positions [b, n] in node order (root
        first; a node's position is the root's plus its depth; EMPTY for padding nodes),
        ancestors [b, n, n] or [n, n] (`TokenTree.ancestor_mask`). Each node takes one slot and
        attends to the committed context and its ancestors only, so its logits and features are
        those of its root-to-node chain. Returns what `forward` does; afterwards `cache.reject`
        with the accepted path's nodes leaves exactly that chain in the cache.

        Attention-only targets: a recurrent layer's state after a node depends on the branch
        (one state per branch, and the walk picks which to keep), which the rolled-back states
        of Gated DeltaNet layers do not hold."""
        if self._linear:
            raise ConfigError(
                f"{self.info.model_type} has recurrent (Gated DeltaNet) layers, whose state after each node depends "
                "on its branch; token trees need one state per branch, so this target verifies chains only"
            )
        check_tree_pass(ids, positions, ancestors)
        return self.forward(ids, positions, cache, layer_ids, ancestors=ancestors)

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HFCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
        *,
        ancestors: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [b, q] (positions EMPTY for padding) -> logits [b, q|1, V], features.

        Features [b, q, len(layer_ids) * H] are the outputs of those decoder layers (HF's
        `hidden_states[i + 1]`; the last layer's is taken after the final norm, as HF returns it).
        `ancestors`: the q tokens are a token tree's nodes (see `forward_tree`).
        """
        cache.slots.append(positions)
        mask = self._masks(cache, positions, ancestors)
        self._wanted = tuple(layer_ids)
        self._captured = {}
        valid = positions != EMPTY
        for i, module in self._linear.items():
            # for this call only: the layer runs on the cache's rollback-able state
            module.forward = _linear_forward(module, cache.linear[i], valid)
        try:
            out = self.model(
                input_ids=ids,
                position_ids=positions.clamp_min(0),
                attention_mask=mask,
                past_key_values=cache.kv,
                use_cache=True,
                logits_to_keep=1 if last_logits_only else 0,
            )
        finally:
            self._wanted = ()
            for module in self._linear.values():
                module.__dict__.pop("forward", None)
        features = None
        if layer_ids:
            last = self.info.num_layers - 1
            parts = [
                self.decoder.norm(self._captured[i]) if i == last else self._captured[i] for i in layer_ids
            ]
            features = torch.cat(parts, dim=-1)
        self._captured = {}
        return out.logits, features


def load_hf_target(
    path: str | Path, *, dtype: str = "float32", device: str = "cpu"
) -> tuple[HFTarget, object]:
    """Loads a local Hugging Face model directory (or zoo name) as target; returns (target,
    tokenizer). The target must pass `check_exact`, or it is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from blockspec.targets.exactness import check_exact

    if dtype not in DTYPES and dtype != "auto":
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(
            f"{path} is not a Hugging Face model directory (no config.json); pass a local model "
            "directory or a known zoo name (see `blockspec pull --list`)"
        )
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    options: dict = {}
    if dtype == "float64":  # the grouped-matmul experts of MoE models take no float64
        options["experts_implementation"] = "eager"
    try:
        config = AutoConfig.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, attn_implementation=_attention_for(config), **options
        ).to(device)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the target model from {path}: {e}") from e
    eos = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(t) for t in source)
    target = HFTarget(model, eos_token_ids=tuple(sorted(eos)))
    check_exact(target)
    return target, tokenizer


def _attention_for(config: object) -> str:
    """SDPA where the model class supports it (boolean masks), else eager (additive masks):
    gpt-oss, for one, refuses SDPA because of its attention sinks."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def embedding_scale_of(target_config: object) -> float:
    """The factor a target multiplies its input embeddings by (Gemma: sqrt(hidden))."""
    text = getattr(target_config, "text_config", None) or target_config
    return math.sqrt(text.hidden_size) if "gemma" in str(getattr(text, "model_type", "")) else 1.0


__all__ = ["EMPTY", "HFTarget", "HFCache", "Target", "TargetCache", "TargetInfo", "greedy_forward", "load_hf_target"]
