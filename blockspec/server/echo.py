"""`echo` on /v1/completions: the prompt returned before the completion, with its logprobs.

As OpenAI (and vLLM) answer it: the choice's text starts with the prompt (a text prompt as sent,
a token-id prompt decoded); with `logprobs`, the prompt's tokens come first in `tokens`,
`token_logprobs` (the first one null: nothing predicts it), `top_logprobs` (null there too) and
`text_offset`, then the completion's, whose offsets go on after the prompt's text. The prompt's
scores come from the engine (`SamplingParams.prompt_logprobs`, engine/scoring.py). Usage counts
the echoed tokens as OpenAI bills them: once as prompt tokens and again as completion tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.dflash.results import TokenLogprob
from blockspec.server.logprobs import TokenTexts


def echo_text(tokenizer: object, prompt: str | Sequence[int]) -> str:
    """The text a choice echoes for its prompt."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(list(prompt), skip_special_tokens=False)


def echo_logprobs(texts: TokenTexts, ids: Sequence[int], entries: Sequence[TokenLogprob | None], top: int) -> dict:
    """The prompt's part of `choices[i].logprobs`: entries [None, TokenLogprob, ...], one per id."""
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(ids, entries):
        text, _ = texts.get(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        alternatives: dict[str, float] = {}
        for alt_id, alt_lp in entry.top[:top]:
            alternatives.setdefault(texts.get(alt_id)[0], alt_lp)
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if top else None, "text_offset": offsets}


def joined(first: dict, then: dict | None) -> dict:
    """Two parts of completion logprobs (the echoed prompt's, then the completion's) as one."""
    if then is None:
        return first
    out = {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "text_offset")}
    tops = None if first["top_logprobs"] is None else first["top_logprobs"] + (then["top_logprobs"] or [])
    return {**out, "top_logprobs": tops}


__all__ = ["echo_logprobs", "echo_text", "joined"]
