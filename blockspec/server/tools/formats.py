"""How each chat-template family shows tools to the model and how the model writes a call.

- "hermes" (Qwen2.5, Qwen3, Hermes; a template that writes `<tool_call>`): the template renders
  the tools; a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call, several in a row for parallel calls.
- "llama3_json" (Llama 3.1 / 3.2 templates, which know `<|python_tag|>` and `ipython`): the
  template renders the tools; a call is the JSON object `{"name": ..., "parameters": {...}}`
  (several separated by `;`).
- "qwen3_xml" (Qwen3-Coder, Qwen3.5, Qwen3.6: a template that writes `<function=` inside
  `<tool_call>`): the template renders the tools; a call is `<tool_call>`, `<function=NAME>`, a
  `<parameter=KEY>` block per argument, `</function>`, `</tool_call>` (qwen_xml.py).
- "glm45" / "glm47" (GLM-4.5 and 4.6 / GLM-4.7 templates, which write `<arg_key>`): the template
  renders the tools; a call is `<tool_call>NAME`, `<arg_key>`/`<arg_value>` pairs, `</tool_call>`
  (glm.py).
- "harmony" (gpt-oss: a template that writes `<|channel|>`, or model_type gpt_oss): the template
  renders the tools; a call is a commentary message to `functions.NAME` (harmony.py).
- "generic" (a template that knows no tools, SmolLM2's for one, or one whose format is none of
  the above): GENERIC_INSTRUCTIONS, in a system message, lists the tools; calls are written as
  in "hermes"; assistant calls fed back become that text, `role: tool` results become user
  messages `<tool_response>...</tool_response>`.

The family is chosen once from the served model's chat template and model_type (`detect_family`)
and named in every answer that had tools (`tool_call_format`, docs/SERVING.md).
"""

from __future__ import annotations

import json

from blockspec.engine.grammar import OutputFormat
from blockspec.server.tools import glm, harmony, qwen_xml
from blockspec.server.tools.request import Tool, ToolRequest
from blockspec.text import encode_prompt

FAMILIES = ("hermes", "qwen3_xml", "llama3_json", "glm45", "glm47", "harmony", "generic")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

GENERIC_INSTRUCTIONS = (
    "You can call these tools. Each line is one tool: its name, description and parameters "
    "(a JSON schema).\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, answer with <tool_call>\n{{\"name\": <tool name>, \"arguments\": <the arguments as a JSON "
    "object>}}\n</tool_call>{parallel} Tool results come back as <tool_response>...</tool_response>. "
    "When no tool is needed, answer normally."
)


def detect_family(chat_template: object, model_type: str | None = None) -> str:
    """The tool-call family of a chat template (see the module docstring)."""
    text = chat_template if isinstance(chat_template, str) else ""
    if model_type == "gpt_oss" or (harmony.CHANNEL in text and "tools" in text):
        return "harmony"  # gpt-oss speaks harmony whatever its template says
    if "tools" not in text:
        return "generic"
    if glm.KEY_OPEN in text:
        return "glm47" if glm.is_compact(text) else "glm45"
    if CALL_OPEN in text:
        return "qwen3_xml" if qwen_xml.FUNCTION in text else "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "generic"


def keeps_special_tokens(family: str) -> bool:
    """Whether the family's calls are written with special tokens, which the answer's text must
    then keep to be parsed (harmony's markers)."""
    return family == "harmony"


def render_prompt(tokenizer: object, messages: list[dict], tools: ToolRequest | None, family: str,
                  chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat with tools (or with tool calls and results in its history)."""
    shown = tools.tools if tools is not None and tools.active else ()
    if family == "generic":
        return encode_prompt(tokenizer, _generic_messages(messages, shown, tools), chat=True,
                             chat_template_kwargs=chat_template_kwargs or None)
    if family == "harmony":
        messages = harmony.template_messages(messages)
    text = tokenizer.apply_chat_template([_template_message(m) for m in messages],
                                         tools=[t.as_openai() for t in shown] or None, add_generation_prompt=True,
                                         tokenize=False, **(chat_template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def forced_format(tools: ToolRequest, family: str) -> OutputFormat:
    """The grammar of one call of the tools a forced choice allows, in the family's format."""
    if family in ("glm45", "glm47"):
        return OutputFormat("sequence", tuple(glm.forced_pieces(t, family == "glm47") for t in tools.called()))
    if family == "harmony":
        return OutputFormat("sequence", tuple(harmony.forced_pieces(t) for t in tools.called()))
    if family == "qwen3_xml":
        return OutputFormat("sequence", tuple(qwen_xml.forced_pieces(t) for t in tools.called()))
    key = "parameters" if family == "llama3_json" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"enum": [t.name]}, key: t.parameters},
              "required": ["name", key], "additionalProperties": False} for t in tools.called()]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if family == "llama3_json":
        return OutputFormat("json_schema", schema)
    return OutputFormat("json_schema", schema, prefix=CALL_OPEN + "\n", suffix="\n" + CALL_CLOSE)


def call_text(name: str, arguments: object) -> str:
    """A call as the generic and hermes formats write it."""
    return f'{CALL_OPEN}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{CALL_CLOSE}'


def _arguments(raw: object) -> object:
    """Arguments as chat templates take them: a JSON object rather than its text."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _template_message(m: dict) -> dict:
    out = dict(m)
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"].get("arguments", "{}"))}}
                             for c in m["tool_calls"]]
    return out


def _generic_messages(messages: list[dict], shown: tuple[Tool, ...], tools: ToolRequest | None) -> list[dict]:
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], _arguments(c["function"].get("arguments", "{}")))
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if shown:
        listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                       ensure_ascii=False) for t in shown)
        parallel = ", one block per call." if tools.parallel else ". Call at most one tool at a time."
        instructions = GENERIC_INSTRUCTIONS.format(tools=listing, parallel=parallel)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
