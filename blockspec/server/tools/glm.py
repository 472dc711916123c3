"""GLM-4.5 / 4.6 / 4.7 tool calls: `<tool_call>NAME` then one `<arg_key>KEY</arg_key>` and
`<arg_value>VALUE</arg_value>` pair per argument, then `</tool_call>`. 4.5 and 4.6 put a newline
after the name and after each tag pair ("glm45"); 4.7 writes them back to back ("glm47"). A value
is written raw when the argument is a string and as JSON otherwise (arguments.py).
"""

from __future__ import annotations

import re

from blockspec.server.tools.arguments import merge_text, read_value, tool_defs, value_piece
from blockspec.server.tools.calls import ToolCall, call_of
from blockspec.server.tools.request import Tool

KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
_NAME = re.compile(r"[\w.\-]+")


def is_compact(chat_template: str) -> bool:
    """Whether the template writes GLM-4.7's calls, without newlines between the tags."""
    return KEY_CLOSE + VALUE_OPEN in chat_template


def parse_call(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    """The call written between `<tool_call>` and `</tool_call>`, or None when it is not one."""
    ends = [i for i in (body.find("\n"), body.find(KEY_OPEN)) if i >= 0]
    cut = min(ends) if ends else len(body)
    name = body[:cut].strip()
    if not _NAME.fullmatch(name):
        return None
    tool = tools.get(name)
    properties = (tool.parameters.get("properties") or {}) if tool is not None else {}
    args, pos, rest = {}, 0, body[cut:]
    for m in _PAIR.finditer(rest):
        if m.start() != pos:  # text between the pairs that is not a pair: not a call
            return None
        pos = m.end()
        key = m.group(1).strip()
        args[key] = read_value(m.group(2), properties.get(key))
    if rest[pos:].strip():
        return None
    return call_of(name, args)


def forced_pieces(tool: Tool, compact: bool) -> tuple[tuple[str, object], ...]:
    """The pieces (engine/grammar.py's sequence) of one call of `tool` with every argument of its
    schema, in the schema's order, each value matching its own schema."""
    nl = "" if compact else "\n"
    defs = tool_defs(tool.parameters)
    pieces: list[tuple[str, object]] = [("text", f"<tool_call>{tool.name}{nl}")]
    for key, schema in (tool.parameters.get("properties") or {}).items():
        pieces.append(("text", f"{KEY_OPEN}{key}{KEY_CLOSE}{nl}{VALUE_OPEN}"))
        pieces.append(value_piece(schema, defs))
        pieces.append(("text", f"{VALUE_CLOSE}{nl}"))
    pieces.append(("text", "</tool_call>"))
    return merge_text(pieces)
