"""Quick acceptance-length (tau) evaluation with real speculative decoding.

Greedy decoding through `SpecDecoder`, so the numbers are the ones inference will see: tau =
tokens committed per draft/verify step (accepted + 1), averaged over all steps of all prompts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from blockspec.config import SamplingParams, SpecConfig


@torch.no_grad()
def quick_tau(
    target: object,
    drafter: object,
    prompts: Sequence[Sequence[int]],
    *,
    block_size: int | None = None,
    max_new_tokens: int = 128,
    batch_size: int = 8,
) -> dict:
    """Greedy speculative decoding of token-id prompts; returns mean tau and details."""
    from blockspec.engine.decoder import SpecDecoder

    block = block_size or drafter.block_size
    was_training = drafter.training
    drafter.eval()
    decoder = SpecDecoder(target, drafter, SpecConfig(block_size=block))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    lengths: list[int] = []
    per_prompt: list[float] = []
    generated = 0
    t0 = time.perf_counter()
    try:
        for i in range(0, len(prompts), batch_size):
            for res in decoder.generate([list(p) for p in prompts[i : i + batch_size]], params):
                lengths.extend(res.stats.acceptance_lengths)
                per_prompt.append(res.stats.mean_tau)
                generated += len(res.token_ids)
    finally:
        drafter.train(was_training)
    return {
        "tau": sum(lengths) / max(1, len(lengths)),
        "tau_prompt_mean": sum(per_prompt) / max(1, len(per_prompt)),
        "steps": len(lengths),
        "generated_tokens": generated,
        "prompts": len(prompts),
        "seconds": round(time.perf_counter() - t0, 2),
    }
