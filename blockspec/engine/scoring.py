"""The log-probabilities of a prompt's own tokens under the target (`prompt_logprobs`).

What evaluation harnesses score with (`echo` + `logprobs`, `max_tokens: 0` on /v1/completions):
token t's log-probability given tokens 0..t-1, the first token's None (nothing predicts it).
The prompt goes through the target in chunks of `chunk` positions on a cache of its own, so at
most [chunk, vocabulary] logits exist at once, never [prompt, vocabulary]; each position's
logits are the ones a single prefill computes (exact attention over the same keys).
"""

from __future__ import annotations

import torch

from blockspec.dflash.results import TokenLogprob
from blockspec.dflash.batch import token_logprobs
from blockspec.targets.base import Target

PROMPT_CHUNK = 128  # positions per pass: [128, 49K] fp32 logits are 25 MB


@torch.inference_mode()
def prompt_logprobs(target: Target, prompt_ids: list[int], top: int, *, device: torch.device | str = "cpu",
                    chunk: int = PROMPT_CHUNK) -> list[TokenLogprob | None]:
    """Per prompt token, its TokenLogprob under the target given the tokens before it, with the
    `top` most likely alternatives; None for the first token."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = len(prompt_ids)
    out: list[TokenLogprob | None] = [None]
    if n < 2:
        return out
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, n]
    positions = torch.arange(n, device=device)[None]  # [1, n]
    cache = target.new_cache(1)
    for a in range(0, n - 1, chunk):  # positions a..b-1 predict tokens a+1..b; the last one predicts nothing asked
        b = min(n - 1, a + chunk)
        cache.reserve(b)
        logits, _ = target.forward(ids[:, a:b], positions[:, a:b], cache)  # [1, b - a, V]
        out.extend(token_logprobs(logits, ids[:, a + 1:b + 1], [top])[0])
    return out
