"""GLM-4.5 / 4.6 / 4.7 tool calls: `<tool_call>NAME` then one `<arg_key>KEY</arg_key>` and
`<arg_value>VALUE</arg_value>` pair per argument, then `</tool_call>`. 4.5 and 4.6 put a newline
after the name and after each tag pair ("glm45"); 4.7 writes them back to back ("glm47").

A value is written raw when the argument is a string and as JSON otherwise (the templates'
`v if v is string else v | tojson`), so turning a call back into JSON arguments needs the tool's
schema: a string argument keeps its text, any other is read as JSON (its text when that fails).
"""

from __future__ import annotations

import json
import re

from blockspec.server.tools.calls import ToolCall, call_of
from blockspec.server.tools.request import Tool

KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
_NAME = re.compile(r"[\w.\-]+")
# A forced string argument: any text without "</" (which would begin the closing tag).
_FREE_TEXT = r"([^<]|<[^/])*"
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/-")


def is_compact(chat_template: str) -> bool:
    """Whether the template writes GLM-4.7's calls, without newlines between the tags."""
    return KEY_CLOSE + VALUE_OPEN in chat_template


def _is_string(schema: object) -> bool:
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return bool(choices) and all(isinstance(c, str) for c in choices)


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
        key, value = m.group(1).strip(), m.group(2)
        if _is_string(properties.get(key)):
            args[key] = value
        else:
            try:
                args[key] = json.loads(value.strip())
            except json.JSONDecodeError:
                args[key] = value
    if rest[pos:].strip():
        return None
    return call_of(name, args)


def forced_pieces(tool: Tool, compact: bool) -> tuple[tuple[str, object], ...]:
    """The pieces (engine/grammar.py's sequence) of one call of `tool` with every argument of its
    schema, in the schema's order, each value matching its own schema."""
    nl = "" if compact else "\n"
    defs = {k: tool.parameters[k] for k in ("$defs", "definitions") if k in tool.parameters}
    pieces: list[tuple[str, object]] = [("text", f"<tool_call>{tool.name}{nl}")]
    for key, schema in (tool.parameters.get("properties") or {}).items():
        pieces.append(("text", f"{KEY_OPEN}{key}{KEY_CLOSE}{nl}{VALUE_OPEN}"))
        pieces.append(_value(schema, defs))
        pieces.append(("text", f"{VALUE_CLOSE}{nl}"))
    pieces.append(("text", "</tool_call>"))
    merged: list[tuple[str, object]] = []
    for kind, value in pieces:  # adjacent literals as one: fewer grammars to join
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return tuple(merged)


def _value(schema: object, defs: dict) -> tuple[str, object]:
    if not isinstance(schema, dict):
        return ("json", {})
    if _is_string(schema):
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices:
            return ("regex", "|".join(_escape(c) for c in choices))
        pattern = schema.get("pattern") if isinstance(schema.get("pattern"), str) else ""
        pattern = pattern.removeprefix("^")
        pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
        if pattern:  # the whole value matches it: stricter than JSON Schema's search, never looser
            return ("regex", pattern)
        if "minLength" in schema or "maxLength" in schema:
            low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
            return ("regex", "[^<]{%d,%s}" % (low, "" if high is None else int(high)))
        return ("regex", _FREE_TEXT)
    return ("json", {**schema, **defs})


def _escape(literal: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in literal)
