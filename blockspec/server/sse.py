"""OpenAI response objects (whole answers and stream chunks) and server-sent-event framing.

One `Shapes` per request builds every object of its answer, so the id, creation time, model
name, `system_fingerprint` and `seed` are the same on all chunks, as OpenAI clients expect.
`seed` (an extension) is the client's seed, which reproduces the answer (see
`system_fingerprint`). `sampling_rule` (an extension) says how the answer's proposals were
verified: "greedy", "keyed" (a seed) or "standard" (no seed; dflash/verify.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def column_sums(rows: Sequence[Sequence[int] | None]) -> list[int]:
    """Element-wise sums of count lists of different lengths (None: none)."""
    out: list[int] = []
    for row in rows:
        row = row or ()
        out.extend([0] * (len(row) - len(out)))
        for k, n in enumerate(row):
            out[k] += n
    return out


def usage(prompt_tokens: int, completion_tokens: int, stats: Sequence[object]) -> dict:
    """The OpenAI usage object plus DFlash statistics (over all choices) under the extension key
    `dflash`. tau is the mean acceptance length: tokens committed per decode step (accepted + 1)."""
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    stats = [s for s in stats if s is not None]
    if stats:
        lengths = [n for s in stats for n in (getattr(s, "acceptance_lengths", None) or [])]
        by_position = [list(getattr(s, "accepted_by_position", None) or []) for s in stats]
        out["dflash"] = {
            "tau": round(sum(lengths) / max(1, len(lengths)), 4),
            "steps": len(lengths),
            "block_size": int(getattr(stats[0], "block_size", 1)),
            "accepted_by_position": [sum(col) for col in zip(*by_position)],
            "tree_steps": sum(int(getattr(s, "tree_steps", 0)) for s in stats),
            "accepted_by_rank": column_sums([getattr(s, "accepted_by_rank", None) for s in stats]),
            "prefill_s": round(max(float(getattr(s, "prefill_s", 0.0)) for s in stats), 6),
            "decode_s": round(max(float(getattr(s, "decode_s", 0.0)) for s in stats), 6),
        }
    return out


class Shapes:
    """Builds the objects of one answer; `kind` is "chat" or "completion"."""

    def __init__(self, kind: str, model: str, *, fingerprint: str | None = None, seed: int | None = None,
                 extra: dict | None = None) -> None:
        """extra: fields added to every object of the answer (`sampling_rule`, `tool_call_format`)."""
        self.kind = kind
        self.extra = dict(extra or {})
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.fingerprint = fingerprint
        self.seed = seed

    def _base(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": self.fingerprint}
        if self.seed is not None:
            out["seed"] = self.seed
        out.update(self.extra)
        return out

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
        """One choice of a whole (non-streamed) answer."""
        if self.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def full(self, choices: list[dict], usage_obj: dict) -> dict:
        """The whole (non-streamed) answer from its `choice`s."""
        return {**self._base(False), "choices": choices, "usage": usage_obj}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False, index: int = 0,
              logprobs: dict | None = None) -> dict:
        """A stream chunk of choice `index` with a text delta (chat: the first one also carries the role)."""
        if self.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, usage_obj: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, only usage."""
        return {**self._base(True), "choices": [], "usage": usage_obj}
