"""Qwen3-Coder's tool calls, which Qwen3.5 and Qwen3.6 write too ("qwen3_xml"): inside
`<tool_call>`, `<function=NAME>`, one `<parameter=KEY>` block per argument with its value on the
lines between, then `</function>`. A value is written raw when the argument is a string and as
JSON otherwise (arguments.py):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import re

from blockspec.server.tools.arguments import merge_text, read_value, tool_defs, value_piece
from blockspec.server.tools.calls import ToolCall, call_of
from blockspec.server.tools.request import Tool

FUNCTION = "<function="
_CALL = re.compile(r"\s*<function=([\w.\-]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.DOTALL)


def parse_call(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    """The call written between `<tool_call>` and `</tool_call>`, or None when it is not one."""
    m = _CALL.fullmatch(body)
    if m is None:
        return None
    name, inner = m.group(1), m.group(2)
    tool = tools.get(name)
    properties = (tool.parameters.get("properties") or {}) if tool is not None else {}
    args, pos = {}, 0
    for p in _PARAMETER.finditer(inner):
        if p.start() != pos:  # text between the parameters that is not one: not a call
            return None
        pos = p.end()
        key = p.group(1).strip()
        text = p.group(2).removeprefix("\n").removesuffix("\n")  # the template's own line breaks
        args[key] = read_value(text, properties.get(key))
    if inner[pos:].strip():
        return None
    return call_of(name, args)


def forced_pieces(tool: Tool) -> tuple[tuple[str, object], ...]:
    """The pieces (engine/grammar.py's sequence) of one call of `tool` with every argument of its
    schema, in the schema's order, each value matching its own schema."""
    defs = tool_defs(tool.parameters)
    pieces: list[tuple[str, object]] = [("text", f"<tool_call>\n{FUNCTION}{tool.name}>\n")]
    for key, schema in (tool.parameters.get("properties") or {}).items():
        pieces.append(("text", f"<parameter={key}>\n"))
        pieces.append(value_piece(schema, defs))
        pieces.append(("text", "\n</parameter>\n"))
    pieces.append(("text", "</function>\n</tool_call>"))
    return merge_text(pieces)
