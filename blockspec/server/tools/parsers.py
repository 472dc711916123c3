"""Generated text -> OpenAI tool calls, for each family of formats.py: whole (`parse_calls`) or
as a stream (`ToolStream`: text deltas in, content deltas and completed calls out). A streamed
call is given as soon as its text is complete, not at the end of the answer.

Text that looks like a call but does not parse as one (a small model's broken JSON) stays
content: the client sees what the model wrote rather than losing it. A call of a function that
is not among the request's tools is still a call, as vLLM gives it: the client decides.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from blockspec.server.tools import glm, qwen_xml
from blockspec.server.tools.calls import ToolCall, call_of, partial_marker
from blockspec.server.tools.formats import CALL_CLOSE, CALL_OPEN
from blockspec.server.tools.harmony import HarmonyStream
from blockspec.server.tools.request import Tool

PYTHON_TAG = "<|python_tag|>"


def _call(obj: object, key: str) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    return call_of(obj.get("name"), obj.get(key, obj.get("arguments", obj.get("parameters", {}))))


def _tagged(body: str) -> ToolCall | None:
    try:
        return _call(json.loads(body), "arguments")
    except ValueError:  # not JSON (or an integer too long to convert)
        return None


def parse_calls(family: str, text: str, tools: Sequence[Tool] = (),
                ends: Sequence[str] = ()) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; content None when the answer is only calls."""
    stream = ToolStream(family, tools, ends)
    content, calls = stream.push(text, final=True)
    return (content if content.strip() else None), calls


class ToolStream:
    """Splits a stream of text deltas into content and tool calls. `push` returns (content
    delta, calls completed by this delta); with final=True it flushes what it held back.
    `tools` are the request's (GLM's parser reads argument types from their schemas); `ends`, the
    text of the model's end tokens, which text decoded with special tokens kept ends with."""

    def __init__(self, family: str, tools: Sequence[Tool] = (), ends: Sequence[str] = ()) -> None:
        self.family = family
        self.tools = {t.name: t for t in tools}
        self.buf = ""
        self.in_call = False
        self.mode: str | None = None  # llama3_json: "json" (calls are being written) or "text"
        self.calls: list[ToolCall] = []
        self.after_call = False  # whitespace right after a call is the calls' separator, not content
        self.harmony = HarmonyStream(ends) if family == "harmony" else None

    def push(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        new: list[ToolCall] = []
        if self.harmony is not None:
            content = self.harmony.push(delta, final, new)
        else:
            self.buf += delta
            content = self._json(final, new) if self.family == "llama3_json" else self._tagged(final, new)
        if new and not content.strip():
            content = ""
        self.calls.extend(new)
        return content, new

    def _json(self, final: bool, new: list[ToolCall]) -> str:
        """Llama 3.1's calls: JSON objects separated by ';' (after an optional <|python_tag|>),
        each given once its closing brace arrives. An answer that does not begin with a call is
        content; so is whatever follows the calls that is not one."""
        if self.mode is None:
            head = self.buf.lstrip()
            if not head:
                return ""
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.mode = "json"
            elif PYTHON_TAG.startswith(head) and not final:
                return ""
            else:
                self.mode = "text"
        if self.mode == "json":
            decoder = json.JSONDecoder()
            while True:
                if self.calls or new:  # the separators between calls
                    text = self.buf.lstrip("; \t\r\n")
                else:
                    text = self.buf.lstrip().removeprefix(PYTHON_TAG).lstrip()
                if not text:
                    self.buf = text
                    return ""
                try:
                    obj, end = decoder.raw_decode(text)
                except ValueError:  # not complete yet, or broken
                    if not final and text.startswith("{"):
                        return ""
                    break
                call = _call(obj, "parameters")
                if call is None:
                    break
                new.append(call)
                self.buf = text[end:]
            self.mode = "text"
        out, self.buf = self.buf, ""
        return out

    def _tagged(self, final: bool, new: list[ToolCall]) -> str:
        """`<tool_call>...</tool_call>` blocks: JSON inside (hermes, generic), GLM's tags or Qwen3-Coder's."""
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
                keep = 0 if final else partial_marker(self.buf, CALL_OPEN)
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j = self.buf.find(CALL_CLOSE)
            if j < 0 and not final:
                break
            body = self.buf if j < 0 else self.buf[:j]
            self.buf = "" if j < 0 else self.buf[j + len(CALL_CLOSE):]
            self.in_call = False
            call = self._parse(body)
            if call is None:
                out.append(CALL_OPEN + body + ("" if j < 0 else CALL_CLOSE))
            else:
                new.append(call)
                self.after_call = True
            if j < 0:
                break
        return "".join(out)

    def _parse(self, body: str) -> ToolCall | None:
        if self.family in ("glm45", "glm47"):
            return glm.parse_call(body, self.tools)
        if self.family == "qwen3_xml":
            return qwen_xml.parse_call(body, self.tools)
        return _tagged(body.strip())
