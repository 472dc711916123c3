"""A parsed tool call (`ToolCall`), what every family's parser yields, and the small text helpers
the streamed parsers share."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def call_of(name: object, args: object) -> ToolCall | None:
    """A call of `name` with `args` (an object, or its JSON text), or None when either is not one."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):  # some models write the arguments' JSON text
        try:
            args = json.loads(args)
        except ValueError:  # not JSON (or an integer too long to convert)
            return None
    if not isinstance(args, dict):
        return None
    try:
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    except ValueError:  # a value JSON cannot write (an integer too long to convert)
        return None


def partial_marker(text: str, *markers: str) -> int:
    """The length of the longest end of text that begins one of the markers (held back: it may
    become one)."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0
