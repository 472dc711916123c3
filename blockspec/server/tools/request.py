"""The `tools`, `tool_choice` and `parallel_tool_calls` fields of a chat request, validated."""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.server.errors import bad_request

MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    """One function the model may call; `parameters` is its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict

    def as_openai(self) -> dict:
        """The tool as OpenAI clients send it (and chat templates read it)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """choice: "auto" (the model decides), "none" (no calls: the tools are not shown), "required"
    (at least one call: exactly one is generated) or "function" (a call of `name`)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def called(self) -> tuple[Tool, ...]:
        """The tools a forced call may be of."""
        return tuple(t for t in self.tools if self.choice != "function" or t.name == self.name)


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and choice; None when it has no tools (a 400 for what is malformed)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools': give the functions the model may call", "tool_choice",
                              "invalid_value")
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be an array of {'type': 'function', 'function': {...}}", "tools", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' takes at most {MAX_TOOLS} functions, got {len(raw)}", "tools", "invalid_value")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools", "invalid_value")
    kind, name = _choice(choice, names)
    return ToolRequest(tools, kind, name, True if parallel is None else parallel)


def _tool(i: int, t: object) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        raise bad_request(f"{param} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                          param, "invalid_type")
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
        raise bad_request(f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'", f"{param}.function.name",
                          "invalid_value")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise bad_request(f"{param}.function.description must be a string", f"{param}.function.description",
                          "invalid_type")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters",
                          "invalid_type")
    return Tool(name, description, parameters)


def _choice(choice: object, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not one of the tools ({', '.join(names)})",
                              "tool_choice", "invalid_value")
        return "function", name
    raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice", "invalid_value")
