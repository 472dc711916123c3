"""`logit_bias`: per-request additive biases on the target's logits (OpenAI's parameter).

The bias is applied to the target's logits at every position a step verifies, before the
shaping (temperature, top-k, top-p) and the draw, so a biased row's committed tokens are those
plain decoding with the same bias gives: verification compares proposals with the biased
target's own tokens, whatever the drafter proposed. Logprobs stay those of the unbiased target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Bias = tuple[tuple[int, float], ...]  # SamplingParams.logit_bias: sorted (token id, value) pairs


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Bias]) -> torch.Tensor:
    """logits [b, n, V] plus row r's `biases[r]` at every position (a new fp32 tensor); logits
    themselves when no row has a bias."""
    rows = [r for r, bias in enumerate(biases) for _ in bias]
    if not rows:
        return logits
    cols = [t for bias in biases for t, _ in bias]
    vals = [v for bias in biases for _, v in bias]
    d = logits.device
    dense = torch.zeros(logits.shape[0], logits.shape[-1], dtype=torch.float32, device=d)  # [b, V]
    dense[torch.tensor(rows, device=d), torch.tensor(cols, device=d)] = torch.tensor(vals, device=d)
    return logits.float() + dense[:, None, :]
