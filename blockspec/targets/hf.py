"""The Hugging Face adapter: any transformers causal LM as a DFlash target."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.errors import CheckpointError, ConfigError
from blockspec.targets.base import DTYPES, Target, TargetCache, TargetInfo, greedy_forward
from blockspec.targets.slots import EMPTY, SlotTable, gather_slots


class HFCache:
    """A transformers DynamicCache whose slots follow a SlotTable (see targets/slots.py)."""

    def __init__(self, batch: int, device: torch.device | str) -> None:
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self.slots = SlotTable(batch, device)

    def lengths(self) -> torch.Tensor:
        return self.slots.lengths()

    def reject(self, keep: torch.Tensor) -> None:
        self.slots.reject(keep)

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


def _decoder(model: nn.Module) -> nn.Module:
    """The inner decoder (the module holding `layers` and `norm`) of a CausalLM."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ConfigError(
            f"{type(model).__name__} has no decoder with .layers; only decoder-only causal LMs "
            "(Llama, Qwen2, Qwen3, Gemma3, ...) are supported"
        )
    return inner


class HFTarget:
    """Adapter for any `transformers` AutoModelForCausalLM with standard decoder layers."""

    def __init__(self, model: nn.Module, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.model = model.eval()
        self.decoder = _decoder(model)
        cfg = model.config
        text = getattr(cfg, "text_config", None) or cfg
        self.config = text
        layer_types = getattr(text, "layer_types", None) or ()
        self._sliding = "sliding_attention" in layer_types
        self._window = getattr(text, "sliding_window", None) if self._sliding else None
        embed = model.get_input_embeddings()
        self.info = TargetInfo(
            hidden_size=int(text.hidden_size),
            vocab_size=int(embed.weight.shape[0]),
            num_layers=len(self.decoder.layers),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 2048)),
            model_type=str(getattr(text, "model_type", "unknown")),
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
        return HFCache(batch, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw (unscaled) input embeddings [b, n, H]: the drafter applies its own scale."""
        return F.embedding(ids, self.model.get_input_embeddings().weight)

    def head(self) -> nn.Module:
        head = getattr(self.model, "lm_head", None)
        return head if head is not None else self.model.get_output_embeddings()

    def _masks(self, cache: HFCache, positions: torch.Tensor) -> torch.Tensor | dict:
        full = cache.slots.attention_mask(positions, causal=True)
        if not self._sliding:
            return full
        window = cache.slots.attention_mask(positions, causal=True, sliding_window=self._window)
        return {"full_attention": full, "sliding_attention": window}

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HFCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [b, q] (positions EMPTY for padding) -> logits [b, q|1, V], features.

        Features [b, q, len(layer_ids) * H] are the outputs of those decoder layers (HF's
        `hidden_states[i + 1]`; the last layer's is taken after the final norm, as HF returns it).
        """
        cache.slots.append(positions)
        mask = self._masks(cache, positions)
        self._wanted = tuple(layer_ids)
        self._captured = {}
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
    """Loads a local Hugging Face model directory (or zoo name) as target; returns (target, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES and dtype != "auto":
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(
            f"{path} is not a Hugging Face model directory (no config.json); pass a local model "
            "directory or a known zoo name (see `blockspec pull --list`)"
        )
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, attn_implementation="sdpa"
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
    return HFTarget(model, eos_token_ids=tuple(sorted(eos))), tokenizer


def embedding_scale_of(target_config: object) -> float:
    """The factor a target multiplies its input embeddings by (Gemma: sqrt(hidden))."""
    text = getattr(target_config, "text_config", None) or target_config
    return math.sqrt(text.hidden_size) if "gemma" in str(getattr(text, "model_type", "")) else 1.0


__all__ = ["EMPTY", "HFTarget", "HFCache", "Target", "TargetCache", "TargetInfo", "greedy_forward", "load_hf_target"]
