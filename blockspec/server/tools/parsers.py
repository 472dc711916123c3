"""Generated text -> OpenAI tool calls, for each family of formats.py: whole (`parse_calls`) or
as a stream (`ToolStream`: text deltas in, content deltas and completed calls out).

Text that looks like a call but does not parse as one (a small model's broken JSON) stays
content: the client sees what the model wrote rather than losing it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from blockspec.server.tools.formats import CALL_CLOSE, CALL_OPEN

PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj: object, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments' JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _tagged(body: str) -> ToolCall | None:
    try:
        return _call(json.loads(body), "arguments")
    except json.JSONDecodeError:
        return None


def _json_calls(text: str) -> list[ToolCall] | None:
    """Llama 3.1's calls: JSON objects separated by ';' (after an optional <|python_tag|>)."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return calls or None


def parse_calls(family: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; content None when the answer is only calls."""
    stream = ToolStream(family)
    content, calls = stream.push(text, final=True)
    return (content if content.strip() else None), calls


class ToolStream:
    """Splits a stream of text deltas into content and tool calls. `push` returns (content
    delta, calls completed by this delta); with final=True it flushes what it held back."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.buf = ""
        self.in_call = False
        self.mode: str | None = None  # llama3_json: "json" (a call is being written) or "text"
        self.calls: list[ToolCall] = []
        self.after_call = False  # whitespace right after a call is the calls' separator, not content

    def push(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        new: list[ToolCall] = []
        content = self._json(final, new) if self.family == "llama3_json" else self._tagged(final, new)
        if new and not content.strip():
            content = ""
        self.calls.extend(new)
        return content, new

    def _json(self, final: bool, new: list[ToolCall]) -> str:
        if self.mode is None:
            head = self.buf.lstrip()
            if not head:
                return ""
            if head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
                self.mode = "json"
            else:
                self.mode = "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return out
        if not final:
            return ""
        calls, text = _json_calls(self.buf), self.buf
        self.buf = ""
        if calls is None:
            return text
        new.extend(calls)
        return ""

    def _tagged(self, final: bool, new: list[ToolCall]) -> str:
        out = []
        while True:
            if not self.in_call and self.after_call:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.after_call = False
            if not self.in_call:
                i = self.buf.find(CALL_OPEN)
                if i >= 0:
                    out.append(self.buf[:i])
                    self.buf, self.in_call = self.buf[i + len(CALL_OPEN):], True
                    continue
                keep = 0 if final else _partial(self.buf, CALL_OPEN)
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j = self.buf.find(CALL_CLOSE)
            if j < 0 and not final:
                break
            body = self.buf if j < 0 else self.buf[:j]
            self.buf = "" if j < 0 else self.buf[j + len(CALL_CLOSE):]
            self.in_call = False
            call = _tagged(body.strip())
            if call is None:
                out.append(CALL_OPEN + body + ("" if j < 0 else CALL_CLOSE))
            else:
                new.append(call)
                self.after_call = True
            if j < 0:
                break
        return "".join(out)


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (held back: it may become one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
