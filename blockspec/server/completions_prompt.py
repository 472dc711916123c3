"""The `prompt` of /v1/completions: one prompt or a batch, as text or token ids.

OpenAI (and vLLM, which evaluation harnesses such as lm-eval's `local-completions` target) take
a string, an array of strings, an array of token ids, or an array of token-id arrays. A batch
answers one choice per prompt and sample: prompt i, sample j is choice i * n + j.
"""

from __future__ import annotations

from blockspec.server.errors import bad_request

MAX_PROMPTS = 64  # prompts per request (each is n requests of the engine's queue)
Prompt = str | tuple[int, ...]

_SHAPES = "a string, an array of strings, an array of token ids or an array of token-id arrays"


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_prompts(value: object) -> tuple[Prompt, ...]:
    """The prompts of a `prompt` field (token-id prompts as tuples), or a 400 naming what is wrong."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise bad_request(f"'prompt' must be {_SHAPES}, non-empty", "prompt", "invalid_type")
    if all(_is_id(t) for t in value):
        return (tuple(value),)
    if all(isinstance(p, str) for p in value):
        prompts: list[Prompt] = list(value)
    elif all(isinstance(p, list) for p in value):
        for i, p in enumerate(value):
            if not p or not all(_is_id(t) for t in p):
                raise bad_request(f"prompt[{i}] must be a non-empty array of token ids (integers)", f"prompt[{i}]",
                                  "invalid_type")
        prompts = [tuple(p) for p in value]
    else:
        raise bad_request(f"'prompt' must be {_SHAPES}; an array mixing these is not accepted", "prompt",
                          "invalid_type")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request", "prompt",
                          "invalid_value")
    return tuple(prompts)


def check_ids(prompts: tuple[Prompt, ...], vocab_size: int) -> None:
    """A 400 for a token-id prompt holding an id outside the vocabulary."""
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and any(not 0 <= t < vocab_size for t in p):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise bad_request(f"prompt token ids must be in [0, {vocab_size})", param, "invalid_value")


__all__ = ["MAX_PROMPTS", "Prompt", "check_ids", "parse_prompts"]
