"""Shapes and options of a native Llama-family target, read from a Hugging Face config.

One config covers Llama (and SmolLM2, which is a Llama), Qwen2 (q/k/v biases) and Qwen3
(per-head q_norm/k_norm). Anything the native code does not implement is refused here with a
message, so `backend="auto"` can route that model through the Hugging Face adapter instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.errors import ConfigError

# model_type -> (q/k/v bias by default, per-head q/k norm)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
# RoPE variants whose frequencies do not depend on the sequence length seen so far.
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class NativeConfig:
    """What the native model needs; `hf_config` is kept only for scaled-RoPE tables."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"native config: {name} must be positive, got {getattr(self, name)}")

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def unsupported_reason(hf_config: object) -> str | None:
    """Why the native backend cannot run this config, or None when it can."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    model_type = str(getattr(cfg, "model_type", ""))
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} is not a native family ({', '.join(sorted(FAMILIES))})"
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"hidden_act {act!r} (native targets implement SiLU-gated MLPs only)"
    layer_types = tuple(getattr(cfg, "layer_types", None) or ())
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in layer_types:
        return "sliding-window attention layers (use the Hugging Face backend)"
    rope = _rope_parameters(cfg)[1] or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE:
        return f"rope type {rope_type!r} depends on the sequence length (use the Hugging Face backend)"
    return None


def _rope_parameters(cfg: object) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from transformers 4 (rope_theta/rope_scaling) or 5
    (rope_parameters) configs."""
    params = getattr(cfg, "rope_parameters", None)
    theta = getattr(cfg, "rope_theta", None)
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def native_config(hf_config: object) -> NativeConfig:
    """Builds a NativeConfig, raising ConfigError for configs the native code does not cover."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    reason = unsupported_reason(cfg)
    if reason is not None:
        raise ConfigError(f"the native backend does not support this model: {reason}; use backend='hf'")
    model_type = str(cfg.model_type)
    default_bias, qk_norm = FAMILIES[model_type]
    heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    theta, scaling = _rope_parameters(cfg)
    attention_bias = getattr(cfg, "attention_bias", None)
    qkv_bias = default_bias if attention_bias is None else bool(attention_bias) or default_bias
    return NativeConfig(
        model_type=model_type,
        vocab_size=int(cfg.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(cfg.intermediate_size),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
        qkv_bias=qkv_bias,
        # Llama's and Qwen3's attention_bias also covers o_proj; Qwen2 has biases on q/k/v only.
        o_bias=bool(attention_bias) and model_type != "qwen2",
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=qk_norm,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
