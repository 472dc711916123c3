"""Rotary position embeddings, computed as Hugging Face computes them (fp32 angles).

The default RoPE is computed here; scaled variants (linear, dynamic, yarn, llama3, ...) take their
inverse frequencies from `transformers.modeling_rope_utils` so that published configs with
`rope_scaling` give exactly the numbers the target's own code gives.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict | None, hf_config: object | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention scaling factor applied to cos/sin."""
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (rope_theta**exponents), 1.0
    if hf_config is None:
        raise ValueError(f"rope type {rope_type!r} needs the model's Hugging Face config")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)


TABLE_MIN = 1024  # positions a first table covers (`Rotary.below`); it doubles as needed


class Rotary(nn.Module):
    """cos/sin tables for given absolute positions."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = attention_scaling
        # dtype -> (what it was built from, cos [n, d], sin [n, d]) for positions 0..n-1 (`below`)
        self._tables: dict[torch.dtype, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, n] -> cos, sin [b, n, head_dim]."""
        freqs = positions.clamp_min(0).float()[..., None] * self.inv_freq.float()  # [b, n, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def below(self, positions: torch.Tensor, dtype: torch.dtype, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s cos, sin [.., head_dim] for CPU positions [..] all below `bound`, read
        from a table of positions 0..n-1 (n >= bound) kept per dtype: the same numbers (each an
        elementwise function of its own position), in two index operations instead of ten, which
        took ~0.1 ms of every pass of a small model. Other devices compute them."""
        if positions.device.type != "cpu" or self.inv_freq.device.type != "cpu":
            return self.forward(positions, dtype)
        made_of = (self.inv_freq.data_ptr(), self.inv_freq._version, self.attention_scaling)
        table = self._tables.get(dtype)
        if table is None or table[0] != made_of or table[1].shape[0] < bound:
            n = max(TABLE_MIN, 1 << max(0, bound - 1).bit_length())
            cos, sin = self.forward(torch.arange(n)[None], dtype)
            table = self._tables[dtype] = (made_of, cos[0], sin[0])
        index = positions.clamp_min(0)
        return table[1][index], table[2][index]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, d] with cos/sin [b, n, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]
