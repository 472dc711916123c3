"""gpt-oss's "harmony" format. An answer is a run of messages, each a header, `<|message|>`, a
body and `<|end|>` (`<|call|>` after a call, `<|return|>` after the last one); the prompt ends in
`<|start|>assistant`, so the first header follows at once and later ones start with
`<|start|>assistant`. The header names the channel (`<|channel|>analysis`, `commentary` or
`final`) and, for a call, the recipient: `to=functions.NAME`, before or after the channel, with
the arguments' type (`<|constrain|>json`, or `json`). A call is one message whose body is the
arguments' JSON; the model stops after it (`<|call|>` is one of gpt-oss's end tokens), so a turn
holds one call.

Content is the `final` channel and recipient-less `commentary` (a preamble for the user);
`analysis` (the chain of thought) is not shown. The markers are special tokens, so this parser
reads text decoded with special tokens kept (formats.py `keeps_special_tokens`); the model's own
end tokens, which that text keeps too, end a message like `<|return|>`. Output that does not
follow the format (no header within HEADER_LIMIT characters) is content as written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from blockspec.server.tools.calls import ToolCall, call_of, partial_marker
from blockspec.server.tools.request import Tool

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN, "<|endoftext|>")  # the last: gpt-oss's third end token, kept in the text too
HEADER_LIMIT = 256  # characters: a real header (role, channel, recipient, type) is far shorter
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."


def call_header(name: str) -> str:
    """The header a model writes before the arguments of a call of `name`."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def forced_pieces(tool: Tool) -> tuple[tuple[str, object], ...]:
    """The pieces (engine/grammar.py's sequence) of one call of `tool`; the end token follows."""
    return (("text", call_header(tool.name)), ("json", tool.parameters))


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as gpt-oss's template takes them: it renders one call per assistant message and
    names each tool result after the call just before it, so an assistant message with several
    calls becomes one message per call, each followed by its result (matched by tool_call_id)."""
    results = {m["tool_call_id"]: m for m in messages if m["role"] == "tool" and m.get("tool_call_id")}
    placed: set[int] = set()
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool" and id(m) in placed:
            continue
        calls = m.get("tool_calls") or []
        if len(calls) < 2:
            out.append(m)
            continue
        for k, call in enumerate(calls):
            out.append({**m, "content": m.get("content") if k == 0 else "", "tool_calls": [call]})
            result = results.get(call.get("id"))
            if k < len(calls) - 1 and result is not None and id(result) not in placed:
                out.append(result)
                placed.add(id(result))
    return out


class HarmonyStream:
    """Splits harmony text deltas into content and calls (see the module docstring)."""

    def __init__(self, ends: Sequence[str] = ()) -> None:
        self.ends = tuple(dict.fromkeys(ENDS + tuple(e for e in ends if e)))  # the model's own end tokens too
        self.buf = ""
        self.state = "header"  # header | body | between | raw
        self.header = ""
        self.written = ""  # the current message as the model wrote it (a broken call becomes content)

    def push(self, delta: str, final: bool, new: list[ToolCall]) -> str:
        self.buf += delta
        out: list[str] = []
        while self.buf or (final and self.written):  # at the end, a message cut off after its header too
            if self.state == "raw":
                out.append(self.buf)
                self.buf = ""
            elif self.state == "between":
                head = self.buf.lstrip()
                if not head:
                    self.buf = ""
                elif head.startswith(START):
                    self.buf, self.state, self.written = head[len(START):], "header", START
                elif START.startswith(head) and not final:
                    break
                else:
                    self.state = "raw"
            elif self.state == "header":
                i = self.buf.find(MESSAGE)
                if i < 0:
                    if len(self.buf) > HEADER_LIMIT or final:
                        self.state, self.buf = "raw", self.written + self.buf
                        self.written = ""
                        continue
                    break
                self.header = self.buf[:i]
                self.written += self.buf[: i + len(MESSAGE)]
                self.buf, self.state = self.buf[i + len(MESSAGE):], "body"
            else:
                if not self._body(final, new, out):
                    break
        return "".join(out)

    def _body(self, final: bool, new: list[ToolCall], out: list[str]) -> bool:
        """Consumes body text; False when it must wait for more."""
        hits = [(i, e) for e in self.ends if (i := self.buf.find(e)) >= 0]
        i, end = min(hits) if hits else (len(self.buf), "")
        recipient = _RECIPIENT.search(self.header)
        channel = _CHANNEL.search(self.header)
        channel = channel.group(1) if channel else ""
        if recipient is not None:  # a call: all of it or nothing
            if not hits and not final:
                return False
            body = self.buf[:i]
            name = recipient.group(1)
            call = call_of(name[len(FUNCTIONS):], body.strip()) if name.startswith(FUNCTIONS) else None
            if call is None:
                out.append(self.written + body + end)
            else:
                new.append(call)
        else:
            keep = 0 if hits or final else partial_marker(self.buf, *self.ends)
            if channel != "analysis":
                out.append(self.buf[: i - keep])
            if not hits and not final:
                self.buf = self.buf[i - keep:]
                return False
        self.buf = self.buf[i + len(end):]
        self.state, self.header, self.written = "between", "", ""
        return True
