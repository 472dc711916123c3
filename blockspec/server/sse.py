"""OpenAI response objects (whole answers and stream chunks) and server-sent-event framing.

One `Shapes` per request builds every object of its answer, so the id, creation time and model
name are the same on all chunks, as OpenAI clients expect.
"""

from __future__ import annotations

import json
import time
import uuid

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, stats: object | None) -> dict:
    """The OpenAI usage object plus DFlash statistics under the extension key `dflash`.

    tau is the mean acceptance length: tokens committed per decode step (accepted drafts + 1).
    """
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if stats is not None:
        steps = len(getattr(stats, "acceptance_lengths", []) or [])
        out["dflash"] = {
            "tau": round(float(stats.mean_tau), 4),
            "steps": steps,
            "block_size": int(getattr(stats, "block_size", 1)),
            "accepted_by_position": list(getattr(stats, "accepted_by_position", []) or []),
            "prefill_s": round(float(getattr(stats, "prefill_s", 0.0)), 6),
            "decode_s": round(float(getattr(stats, "decode_s", 0.0)), 6),
        }
    return out


class Shapes:
    """Builds the objects of one answer; `kind` is "chat" or "completion"."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage_obj: dict) -> dict:
        """The whole (non-streamed) answer."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base(False), "choices": [choice], "usage": usage_obj}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        """A stream chunk with a text delta (chat: the first one also carries the role)."""
        if self.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, usage_obj: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, only usage."""
        return {**self._base(True), "choices": [], "usage": usage_obj}
