"""Log-probabilities in OpenAI's two shapes (chat: `content` entries; completions: parallel lists).

The engine gives, per generated token, its log-probability under the target's own distribution
(log-softmax of the target's logits, before temperature, top-k and top-p: what OpenAI returns)
and the most likely alternatives (`TokenLogprob`). Here ids become token texts and bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from blockspec.dflash.results import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The printable stand-ins byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) write
    bytes as, mapped back to the bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TokenTexts:
    """Text and UTF-8 bytes of single tokens, cached (at most the vocabulary)."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(raw, str) and raw and all(ch in table for ch in raw):
                data = [table[ch] for ch in raw]  # byte-level: the token's exact bytes, even a partial character
            else:
                data = list(text.encode("utf-8", "replace"))
            hit = self._cache[token_id] = (text, data)
        return hit


def chat_logprobs(texts: TokenTexts, ids: Sequence[int], entries: Sequence[TokenLogprob], top: int) -> dict:
    """`choices[i].logprobs` of a chat answer (or of one stream chunk)."""
    content = []
    for token_id, entry in zip(ids, entries):
        text, data = texts.get(token_id)
        alternatives = []
        for alt_id, alt_lp in entry.top[:top]:
            alt_text, alt_data = texts.get(alt_id)
            alternatives.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_data})
        content.append({"token": text, "logprob": entry.logprob, "bytes": data, "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, ids: Sequence[int], entries: Sequence[TokenLogprob], top: int,
                        offset: int = 0) -> dict:
    """`choices[i].logprobs` of a completion (or of one stream chunk); text offsets count from
    `offset` characters into the completion."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(ids, entries):
        text, _ = texts.get(token_id)
        tokens.append(text)
        values.append(entry.logprob)
        alternatives: dict[str, float] = {}
        for alt_id, alt_lp in entry.top[:top]:
            alternatives.setdefault(texts.get(alt_id)[0], alt_lp)
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if top else None,
            "text_offset": offsets}
