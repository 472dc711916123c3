"""Arguments written one by one as text, a tag pair per argument (GLM's `<arg_key>`/`<arg_value>`,
Qwen3-Coder's `<parameter=KEY>`): the templates write a string argument raw and any other as
JSON, so reading a value back needs the tool's schema, and so does the grammar of a forced value.
"""

from __future__ import annotations

import ast
import json

# A forced string argument: any text without "</" (which would begin the closing tag).
FREE_TEXT = r"([^<]|<[^/])*"
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/-")


def is_string(schema: object) -> bool:
    """Whether an argument's schema makes it a string (written raw by the templates)."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return bool(choices) and all(isinstance(c, str) for c in choices)


def read_value(text: str, schema: object) -> object:
    """An argument's value from its text: a string argument's text as it is, any other read as
    JSON, or as the Python literal some templates write (`True`, `None`), or else its text."""
    if is_string(schema):
        return text
    try:
        return json.loads(text.strip())
    except ValueError:  # not JSON (or an integer too long to convert)
        pass
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
    return value if isinstance(value, (bool, int, float, type(None), str, list, dict)) else text


def value_piece(schema: object, defs: dict) -> tuple[str, object]:
    """The grammar piece (engine/grammar.py's sequence) of one argument's value: a string as raw
    text (its enum, its pattern matching the whole value, or its length bounds with no '<';
    else any text without '</'), any other as JSON matching the schema (with the tool's $defs)."""
    if not isinstance(schema, dict):
        return ("json", {})
    if is_string(schema):
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
        return ("regex", FREE_TEXT)
    return ("json", {**schema, **defs})


def tool_defs(parameters: dict) -> dict:
    """The definitions a tool's argument schemas may refer to."""
    return {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}


def merge_text(pieces: list[tuple[str, object]]) -> tuple[tuple[str, object], ...]:
    """Adjacent literal pieces as one (fewer grammars to join)."""
    merged: list[tuple[str, object]] = []
    for kind, value in pieces:
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return tuple(merged)


def _escape(literal: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in literal)
