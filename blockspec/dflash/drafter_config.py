"""The drafter's config.json as a frozen, validated config (`DrafterConfig`), the two architectures
(DFlash, DFlash 2) and the check that a drafter fits a target (`check_compatible`).

Which keys the published drafters carry, and where, is in docs/DESIGN.md section 2.2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from blockspec.errors import CheckpointError, CompatibilityError, ConfigError

DFLASH = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
# What the published DFlash 2 drafters use where their config.json leaves a key out.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Evenly spread target layers, as the published drafters choose them."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's config.json: a Qwen3 config plus the DFlash keys."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention_bias: bool = False
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 (architecture DFLASH2): convolutions inside the block and the candidate selector;
    # None for a DFlash drafter.
    architecture: str = DFLASH
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # Keys of the original config.json we do not interpret, written back unchanged on save.
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"drafter config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"drafter config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.target_layer_ids:
            raise ConfigError("drafter config: target_layer_ids must name at least one layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(
                f"drafter config: target_layer_ids {list(bad)} outside the target's "
                f"{self.num_target_layers} layers (valid: 0..{self.num_target_layers - 1})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"drafter config: mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"(0..{self.vocab_size - 1}); pick a token id the target's tokenizer has"
            )
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"drafter config: block_size must be an integer >= 2, got {self.block_size!r}")
        types = tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers
        if len(types) != self.num_hidden_layers:
            raise ConfigError(
                f"drafter config: layer_types has {len(types)} entries for {self.num_hidden_layers} layers"
            )
        object.__setattr__(self, "layer_types", types)
        if "sliding_attention" in types and not self.sliding_window:
            raise ConfigError("drafter config: sliding_attention layers need a sliding_window")
        if self.architecture not in (DFLASH, DFLASH2):
            raise ConfigError(f"drafter config: architecture must be {DFLASH} or {DFLASH2}, got {self.architecture!r}")
        if self.architecture == DFLASH2:
            self._check_dflash2()

    def _check_dflash2(self) -> None:
        for name in DFLASH2_DEFAULTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"DFlash 2 drafter config: {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(f"DFlash 2 drafter config: conv_group_size {self.conv_group_size} must divide "
                              f"hidden_size {self.hidden_size}")
        if self.conv_kernel_size > self.block_size:
            raise ConfigError(f"DFlash 2 drafter config: conv_kernel_size {self.conv_kernel_size} exceeds "
                              f"block_size {self.block_size}")
        if self.selector_top_k > self.vocab_size:
            raise ConfigError(f"DFlash 2 drafter config: selector_top_k {self.selector_top_k} exceeds "
                              f"vocab_size {self.vocab_size}")

    @property
    def dflash2(self) -> bool:
        """Whether this is a DFlash 2 drafter (block convolutions and a candidate selector)."""
        return self.architecture == DFLASH2

    @property
    def block_causal(self) -> bool:
        """Whether a block attends to itself causally, in every layer alike. Bidirectionally unless
        `is_causal: true`, sliding layers included: so the serving engines run DFlash drafters and
        so the published ones were trained (Z Lab's Qwen3.6 drafters mix sliding and full layers
        and have no is_causal key)."""
        return bool(self.is_causal)

    @classmethod
    def from_dict(cls, raw: dict) -> DrafterConfig:
        """Parses a published DFlash config.json (keys may sit at top level or in dflash_config)."""
        dflash = raw.get("dflash_config") or {}

        def get(name: str, default: object = None) -> object:
            return dflash.get(name, raw.get(name, default))

        try:
            num_layers = int(raw["num_hidden_layers"])
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            num_target_layers = int(get("num_target_layers"))
        except (KeyError, TypeError) as e:
            raise CheckpointError(
                f"drafter config.json lacks a required key ({e}); is this a DFlash drafter directory?"
            ) from e
        layer_ids = get("target_layer_ids") or default_target_layer_ids(num_target_layers, num_layers)
        mask = get("mask_token_id")
        if mask is None:
            raise CheckpointError("drafter config.json has no dflash_config.mask_token_id")
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling")
        params = raw.get("rope_parameters")  # transformers >= 5 writes this instead
        if rope_theta is None and isinstance(params, dict):
            rope_theta = params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        known = {
            "hidden_size": hidden,
            "intermediate_size": int(raw["intermediate_size"]),
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
            "head_dim": int(raw.get("head_dim") or hidden // heads),
            "vocab_size": int(raw["vocab_size"]),
            "num_target_layers": num_target_layers,
            "mask_token_id": int(mask),
            "target_layer_ids": tuple(layer_ids),
            "block_size": int(get("block_size", 16)),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope_theta if rope_theta is not None else 1_000_000.0),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": int(raw.get("max_position_embeddings", 40960)),
            "layer_types": tuple(raw.get("layer_types") or ()),
            "sliding_window": raw.get("sliding_window"),
            "attention_bias": bool(raw.get("attention_bias", False)),
            "is_causal": raw.get("is_causal"),
            "input_embedding_scale": float(get("input_embedding_scale", 1.0) or 1.0),
            "output_multiplier": float(get("output_multiplier", 1.0) or 1.0),
            "final_logit_softcapping": get("final_logit_softcapping"),
        }
        if DFLASH2 in (raw.get("architectures") or ()):
            known["architecture"] = DFLASH2
            known.update({name: get(name, default) for name, default in DFLASH2_DEFAULTS.items()})
        return cls(**known, extra=dict(raw))

    def to_dict(self) -> dict:
        """The config.json content, in the published layout."""
        out = dict(self.extra)
        mine = asdict(self)
        mine.pop("extra")
        architecture = mine.pop("architecture")
        dflash = dict(out.get("dflash_config") or {})
        dflash["mask_token_id"] = mine.pop("mask_token_id")
        dflash["target_layer_ids"] = list(mine.pop("target_layer_ids"))
        for name in DFLASH2_DEFAULTS:  # DFlash 2 keys live in dflash_config
            value = mine.pop(name)
            out.pop(name, None)
            dflash.pop(name, None)
            if architecture == DFLASH2:
                dflash[name] = value
        for optional in ("input_embedding_scale", "output_multiplier"):
            if mine[optional] == 1.0 and optional not in out and optional not in dflash:
                mine.pop(optional)
        if mine["final_logit_softcapping"] is None and "final_logit_softcapping" not in out:
            mine.pop("final_logit_softcapping")
        if mine["is_causal"] is None and "is_causal" not in out:
            mine.pop("is_causal")
        for key in list(mine):  # keys that live in dflash_config in the source stay there
            if key in dflash:
                dflash[key] = mine.pop(key)
        out.pop("rope_parameters", None)
        out.update(mine)
        out["layer_types"] = list(self.layer_types)
        out["dflash_config"] = dflash
        out["architectures"] = [architecture]
        out.setdefault("model_type", "qwen3")
        out.setdefault("tie_word_embeddings", False)
        out.setdefault("hidden_act", "silu")
        out.setdefault("attention_dropout", 0.0)
        out.setdefault("initializer_range", 0.02)
        # transformers' Qwen3Config (which the reference package reads) drops the window unless this is set
        out.setdefault("use_sliding_window", self.sliding_window is not None and "sliding_attention" in self.layer_types)
        return out

    def hf_rope_config(self) -> object:
        """A transformers Qwen3Config, only needed for scaled RoPE variants."""
        from transformers import Qwen3Config

        raw = {k: v for k, v in self.to_dict().items() if k not in ("dflash_config", "architectures")}
        return Qwen3Config(**raw)


def check_compatible(cfg: DrafterConfig, *, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Raises CompatibilityError when a drafter cannot serve a target of these dimensions."""
    if cfg.hidden_size != hidden_size:
        raise CompatibilityError(
            f"drafter hidden_size {cfg.hidden_size} != target hidden_size {hidden_size}: this "
            "drafter was trained for another target; use a drafter made for this target"
        )
    if cfg.vocab_size != vocab_size:
        raise CompatibilityError(
            f"drafter vocab_size {cfg.vocab_size} != target vocab_size {vocab_size}: the drafter "
            "uses the target's embeddings and head, so both must share one vocabulary"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise CompatibilityError(
            f"drafter target_layer_ids {bad} are out of range for a target with {num_layers} "
            "layers; use a drafter made for this target"
        )
    if not 0 <= cfg.mask_token_id < vocab_size:
        raise CompatibilityError(
            f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary (size {vocab_size})"
        )
