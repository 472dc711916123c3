"""Structured outputs: the request fields that constrain an answer to a grammar, read into one
OutputFormat (engine/grammar.py), which the engine enforces inside speculative decoding.

- OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}};
- vLLM's extra fields: `guided_json` (a schema, or its JSON text), `guided_regex`,
  `guided_choice` (strings), `guided_grammar` (EBNF/GBNF, or Lark), and the newer
  `structured_outputs` object with one of the keys `json`, `regex`, `choice`, `grammar`,
  `json_object`.

At most one of them per request. Every mistake is a 400 naming the field.
"""

from __future__ import annotations

import json

from blockspec.engine.grammar import OutputFormat
from blockspec.errors import ConfigError
from blockspec.server.errors import bad_request

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
FIELDS = frozenset({*GUIDED_FIELDS, "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern"})
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


def output_format(body: dict) -> OutputFormat | None:
    """The one output format a request body asks for, or None."""
    found: list[tuple[str, OutputFormat]] = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    for name in GUIDED_FIELDS:
        value = body.get(name)
        if value is not None:
            found.append((name, _format(name, name.removeprefix("guided_"), value)))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(("structured_outputs", _structured(structured)))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"give at most one output constraint; this request has {names}", found[1][0],
                          "invalid_value")
    return found[0][1] if found else None


def _response_format(value: object) -> OutputFormat | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type': 'text', 'json_object' or "
                          "'json_schema'", param, "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_object")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          f"{param}.type", "invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object like "
                          "{'name': 'answer', 'schema': {...}, 'strict': true}", f"{param}.json_schema", "invalid_type")
    if spec.get("schema") is None:
        raise bad_request("response_format.json_schema.schema is required: the JSON schema of the answer",
                          f"{param}.json_schema.schema", "missing_required_parameter")
    schema = spec["schema"]
    return _format(f"{param}.json_schema.schema", "json", schema)


def _structured(value: object) -> OutputFormat:
    param = "structured_outputs"
    keys = [k for k in _STRUCTURED_KEYS if isinstance(value, dict) and value.get(k) not in (None, False)]
    if not isinstance(value, dict) or len(keys) != 1:
        raise bad_request(f"'structured_outputs' must be an object with exactly one of "
                          f"{', '.join(_STRUCTURED_KEYS)}", param, "invalid_value")
    key = keys[0]
    if key == "json_object":
        return OutputFormat("json_object")
    return _format(f"{param}.{key}", key, value[key])


def _format(param: str, kind: str, value: object) -> OutputFormat:
    """kind: json | regex | choice | grammar."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad_request(f"'{param}' is not valid JSON: {e}", param, "invalid_value") from None
        if isinstance(value, bool):  # JSON Schema's `true` accepts anything: any JSON object here
            value = {"type": "object"}
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema (an object)", param, "invalid_type")
        return _checked(param, "json_schema", value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"'{param}' must be a non-empty array of non-empty strings", param, "invalid_type")
        return _checked(param, "choice", tuple(value))
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{param}' must be a non-empty string", param, "invalid_type")
    return _checked(param, kind, value)


def _checked(param: str, kind: str, value: object) -> OutputFormat:
    try:
        return OutputFormat(kind, value)
    except ConfigError as e:
        raise bad_request(f"'{param}': {e}", param, "invalid_value") from None


def compile_error(e: ConfigError, fmt: OutputFormat) -> Exception:
    """The 400 for a format the grammar engine refused (a bad schema, pattern or grammar)."""
    return bad_request(str(e), "response_format" if fmt.kind in ("json_object", "json_schema") else "guided_" + fmt.kind,
                       "invalid_value")
