"""Request bodies of /v1/chat/completions and /v1/completions, validated by hand.

Validation is explicit rather than generated so every rejection names the offending field in
`param` and says what is accepted, and so fields this server cannot honour (penalties, tools,
...) are refused instead of silently ignored. Structured outputs are read by structured.py, tools by
tools/request.py. A field neither OpenAI nor this
server knows gets OpenAI's own answer (400 "Unrecognized request argument supplied").
Bodies are checked as a whole first (`parse_json`): JSON, nesting depth, and text that UTF-8
can carry (a lone surrogate escaped as "\\ud800" is valid JSON but no tokenizer takes it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from blockspec.config import MAX_LOGIT_BIAS
from blockspec.engine.grammar import OutputFormat
from blockspec.server import structured
from blockspec.server.completions_prompt import Prompt, parse_prompts
from blockspec.server.errors import bad_request, model_not_found, unknown_field
from blockspec.server.tools.request import ToolRequest, parse_tools

MAX_INT = 2**31 - 1  # larger max_tokens values are nonsense, not a context question
MAX_STOPS = 16
MAX_N = 16  # completions per request (each is a request of the engine's batch)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_DEPTH = 32  # JSON nesting; OpenAI request bodies need 6 or so
ROLES = ("system", "user", "assistant", "tool", "developer")
_MISSING = object()

# The fields each endpoint understands: OpenAI's (some refused below unless neutral) and this
# server's extensions (top_k, ignore_eos, stop_token_ids, chat_template_kwargs, ...).
_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "ignore_eos", "stop_token_ids",
    "repetition_penalty", "min_p",
})
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice", "functions",
    "function_call", "parallel_tool_calls", "store", "metadata", "service_tier", "modalities", "prediction", "audio",
    "reasoning_effort", "prompt_cache_key", "safety_identifier", "verbosity", "web_search_options",
    "chat_template_kwargs",
} | structured.FIELDS
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix", "response_format"} | structured.FIELDS
MESSAGE_FIELDS = frozenset({"role", "content", "name", "refusal", "tool_calls", "tool_call_id", "function_call",
                            "audio"})

# Names apply_chat_template and the template machinery set themselves; a client may not.
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "tokenize", "tools", "documents",
    "chat_template", "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "padding", "truncation", "max_length", "bos_token", "eos_token", "pad_token", "unk_token", "sep_token",
    "cls_token", "mask_token", "additional_special_tokens", "raise_exception", "strftime_now", "range", "loop",
    "namespace", "joiner", "cycler", "lipsum", "dict", "true", "false", "none",
})
# Switches that clients send to any model (Qwen3-style thinking); accepted even where the
# template does not read them, where they change nothing.
COMMON_TEMPLATE_SWITCHES = frozenset({"enable_thinking", "thinking", "reasoning_effort"})


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request. Exactly one of `messages` (chat) and `prompt` (completion) is set;
    `prompt` is text or token ids, the first of `prompts` (a completion's batch of prompts).
    `max_tokens` None means "up to the end of the context"; 0 only with `echo`."""

    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    n: int = 1
    logprobs: bool = False  # return each chosen token's log-probability
    top_logprobs: int = 0  # ... and this many most likely alternatives per position
    prompts: tuple[Prompt, ...] = ()  # completion: every prompt (choice i * n + j: prompt i, sample j)
    echo: bool = False  # completion: the prompt (and with logprobs its scores) before each choice's text
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    output_format: OutputFormat | None = None  # structured output (server/structured.py)
    tools: ToolRequest | None = None  # chat only (server/tools/)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 naming what is wrong with it: not JSON, nested deeper
    than MAX_DEPTH, or holding a string UTF-8 cannot encode (a lone surrogate)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", None,
                          "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Walks the parsed body without recursion: nesting depth and encodable strings."""
    stack: list[tuple[object, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", None,
                              "invalid_json")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path)
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        else:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"'{path or 'body'}' holds invalid Unicode (a lone surrogate {text[e.start]!a} at "
                          f"character {e.start}); send text UTF-8 can encode", path or None, "invalid_unicode") from None


# ---- field readers: each raises a 400 naming the field -------------------------------------

def _type_name(value: object) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    # JSON has one number type; 5.0 is accepted as 5, 5.5 and booleans are not integers.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {_type_name(value)} {value!r:.60}", name, "invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {bounds}, got {value}", name, "invalid_value")
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {_type_name(value)} {value!r:.60}", name, "invalid_type")
    if value < lo or value > hi or (open_lo and value == lo):
        bounds = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise bad_request(f"'{name}' must be in {bounds}, got {value}", name, "invalid_value")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {_type_name(value)} {value!r:.60}", name, "invalid_type")
    return value


def _unsupported(body: dict, name: str, neutral: tuple = (), why: str = "") -> None:
    """Refuses a field this server does not implement unless it has a no-op value."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None or any(value == n and type(value) is type(n) for n in neutral):
        return
    raise bad_request(f"'{name}' = {value!r:.60} is not supported by this server{why}", name, "unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"'stop' must be a string or an array of strings, got {value!r:.60}", "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", "stop", "invalid_value")
    return tuple(s for s in stops if s)  # an empty stop string would end every answer at once


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad_request("'stop_token_ids' must be an array of token ids (integers >= 0)", "stop_token_ids",
                          "invalid_type")
    return tuple(value)


def _model(body: dict) -> str:
    value = body.get("model")
    if value is None:
        raise bad_request("'model' is required; GET /v1/models lists the served model", "model",
                          "missing_required_parameter")
    if not isinstance(value, str):
        raise bad_request(f"'model' must be a string, got {_type_name(value)}", "model", "invalid_type")
    return value


def _known(body: dict, fields: frozenset[str]) -> None:
    for name in body:
        if name not in fields:
            raise unknown_field(name)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} -> sorted (id, bias) pairs; ids are checked against the vocabulary
    where the model is known (app.py)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers, e.g. {\"50256\": -100}; "
                          f"got {_type_name(value)}", "logit_bias", "invalid_type")
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers), got {key!r:.40}",
                              "logit_bias", "invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias[{key!r}] must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                              f"got {bias!r:.40}", "logit_bias", "invalid_value")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


def _common(body: dict, *, least_tokens: int = 1) -> dict:
    """Fields shared by both endpoints; `least_tokens`: the smallest max_tokens accepted."""
    _unsupported(body, "presence_penalty", (0, 0.0), "")
    _unsupported(body, "frequency_penalty", (0, 0.0), "")
    _unsupported(body, "repetition_penalty", (1, 1.0), "")
    _unsupported(body, "min_p", (0, 0.0), "")
    _string(body, "user")
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = _int(body, "max_completion_tokens", None, least_tokens, MAX_INT)
    else:
        max_tokens = _int(body, "max_tokens", None, least_tokens, MAX_INT)
    top_k = _int(body, "top_k", 0, -1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object like {'include_usage': true}", "stream_options",
                          "invalid_type")
    return dict(
        model=_model(body),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        top_k=max(0, top_k),  # -1 (the vLLM spelling) and 0 both mean "off"
        seed=_int(body, "seed", None, 0, 2**63 - 1),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=_bool(body, "stream", False),
        include_usage=_bool(options or {}, "include_usage", False),
        n=_int(body, "n", 1, 1, MAX_N),
        logit_bias=_logit_bias(body),
    )


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {_type_name(value)}", name, "invalid_type")
    return value


def _no_legacy(body: dict) -> None:
    """The deprecated `functions` / `function_call` (use `tools`) and non-text modalities are
    refused with a 400 saying so."""
    _unsupported(body, "functions", ([],), " (send 'tools' instead)")
    _unsupported(body, "function_call", ("none", "auto"), " (send 'tool_choice' instead)")
    _unsupported(body, "modalities", (["text"],), " (text only)")
    _unsupported(body, "audio", (), " (text only)")
    _unsupported(body, "prediction", (), "")
    _unsupported(body, "web_search_options", (), "")


def _content(i: int, message: dict) -> str:
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is understood by a text-only model
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{i}].content: part of type {kind!r} is not supported (text only)",
                                  f"messages[{i}].content", "unsupported_content")
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or an array of text parts, got {_type_name(content)}",
                      f"messages[{i}].content", "invalid_type")


def _messages(body: dict) -> list[dict]:
    value = body.get("messages")
    if value is None:
        raise bad_request("'messages' is required: an array of {'role': ..., 'content': ...}", "messages",
                          "missing_required_parameter")
    if not isinstance(value, list):
        raise bad_request(f"'messages' must be an array, got {_type_name(value)}", "messages", "invalid_type")
    if not value:
        raise bad_request("'messages' is empty; give at least one {'role': 'user', 'content': ...}", "messages",
                          "invalid_value")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object, got {_type_name(m)}", f"messages[{i}]", "invalid_type")
        for key in m:
            if key not in MESSAGE_FIELDS:
                raise bad_request(f"messages[{i}]: unrecognized field {key!r}", f"messages[{i}].{key}",
                                  "unknown_parameter")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                              f"messages[{i}].role", "invalid_value")
        message = {"role": role, "content": _content(i, m)}
        if m.get("tool_calls"):
            if role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                  f"messages[{i}].tool_calls", "invalid_value")
            message["tool_calls"] = _tool_calls(i, m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}", "invalid_type")
                message[key] = m[key]
        out.append(message)
    return out


def _tool_calls(i: int, calls: object) -> list[dict]:
    """An assistant message's tool calls, as OpenAI sends them back: [{'id', 'type': 'function',
    'function': {'name', 'arguments' (JSON text)}}]."""
    param = f"messages[{i}].tool_calls"
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", "{}"), (str, dict)) for c in calls)
    if not ok:
        raise bad_request(f"{param} must be an array of {{'id': ..., 'type': 'function', 'function': "
                          "{'name': ..., 'arguments': '<JSON text>'}}", param, "invalid_type")
    return [{"id": c.get("id"), "type": "function", "function": {"name": c["function"]["name"],
                                                               "arguments": c["function"].get("arguments", "{}")}}
            for c in calls]


def _template_kwargs(body: dict, switches: frozenset[str]) -> dict:
    """Variables a client may set in the chat template: the `switches` the template reads (see
    `template_switches`) and the common ones, each a JSON scalar. What the server sets itself
    (add_generation_prompt, tokenize, messages, ...) is refused, as is what the template ignores."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'chat_template_kwargs' must be an object, e.g. {'enable_thinking': false}",
                          "chat_template_kwargs", "invalid_type")
    allowed = (switches | COMMON_TEMPLATE_SWITCHES) - RESERVED_TEMPLATE_NAMES
    for key, v in value.items():
        param = f"chat_template_kwargs.{key}"
        if key in RESERVED_TEMPLATE_NAMES:
            raise bad_request(f"chat_template_kwargs may not set {key!r}: the server sets it", param, "invalid_value")
        if key not in allowed:
            raise bad_request(f"chat_template_kwargs: {key!r} is not a switch of this model's chat template; "
                              f"accepted: {', '.join(sorted(allowed))}", param, "invalid_value")
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise bad_request(f"chat_template_kwargs.{key} must be a boolean, number or string, got "
                              f"{_type_name(v)}", param, "invalid_type")
    return dict(value)


def template_switches(chat_template: object) -> frozenset[str]:
    """The variables a chat template reads that the caller does not set (Qwen3's enable_thinking,
    ...): what `chat_template_kwargs` may carry. Empty when the template cannot be parsed."""
    if not isinstance(chat_template, str):
        return frozenset()
    try:
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        names = meta.find_undeclared_variables(env.parse(chat_template))
    except Exception:  # a template jinja cannot parse here: only the common switches
        return frozenset()
    return frozenset(names) - RESERVED_TEMPLATE_NAMES


def _chat_logprobs(body: dict) -> dict:
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    return dict(logprobs=logprobs, top_logprobs=top)


def parse_chat(body: dict, switches: frozenset[str] = frozenset()) -> GenerationRequest:
    """A chat request; `switches`: the chat template's own variables (`template_switches`)."""
    _known(body, CHAT_FIELDS)
    _no_legacy(body)
    common = _common(body)
    output_format = structured.output_format(body)
    tools = parse_tools(body)
    if tools is not None and tools.active and output_format is not None:
        raise bad_request("a request with tools (tool_choice other than 'none') takes no response_format or "
                          "guided_* constraint: a forced tool call is itself constrained", "response_format",
                          "invalid_value")
    return GenerationRequest(kind="chat", messages=_messages(body),
                             chat_template_kwargs=_template_kwargs(body, switches), **common, **_chat_logprobs(body),
                             output_format=output_format, tools=tools)


def parse_completion(body: dict) -> GenerationRequest:
    _known(body, COMPLETION_FIELDS)
    echo = _bool(body, "echo", False)
    common = _common(body, least_tokens=0 if echo else 1)  # max_tokens 0 with echo: score the prompt alone
    _unsupported(body, "suffix", ("",), "")
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != common["n"]:
        raise bad_request(f"'best_of' = {best_of} is not supported by this server (only best_of == n)", "best_of",
                          "unsupported_parameter")
    # Completions take logprobs as the number of alternatives to list (0: the chosen token only).
    top = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad_request("'prompt' is required: a string, an array of strings, an array of token ids or an "
                          "array of token-id arrays", "prompt", "missing_required_parameter")
    prompts = parse_prompts(prompt)
    first = prompts[0] if isinstance(prompts[0], str) else list(prompts[0])
    return GenerationRequest(kind="completion", prompt=first, prompts=prompts, echo=echo, logprobs=top is not None,
                             top_logprobs=top or 0, output_format=structured.output_format(body), **common)


def check_model(request: GenerationRequest, served: str) -> None:
    """404 for a model name this server does not serve."""
    if request.model != served:
        raise model_not_found(request.model, served)


__all__ = ["GenerationRequest", "check_model", "parse_chat", "parse_completion", "parse_json", "template_switches"]
