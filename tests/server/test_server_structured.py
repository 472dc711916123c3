"""Structured outputs and tool calling through the HTTP API with the official `openai` client:
the tiny random model (whose free text is garbage, so the grammar decides every structural
token) and the real SmolLM2 (slow). The lossless property itself is tested below the server,
in tests/dflash/test_constrained.py."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from server_support import HELLO, MODEL, client, pipe, post, server  # noqa: F401 (fixtures)

from blockspec.server.tools import ToolStream, detect_family, parse_calls, render_prompt
from blockspec.server.tools.request import ToolRequest, parse_tools

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "days", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris",
                                                                                                        "Rome"]}},
                                                        "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def _json_answer(client, **kw) -> tuple[dict, object]:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    return json.loads(choice.message.content), r


def test_json_schema_output_parses_and_matches(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    value, _ = _json_answer(client, response_format=fmt)
    jsonschema.validate(value, SCHEMA)
    sampled = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=1.0, seed=3, n=2,
                                             response_format=fmt)
    for c in sampled.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_and_the_free_text_is_not_json(client):
    free = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0).choices[0]
    with pytest.raises(ValueError):
        json.loads(free.message.content)
    # any object: the random model may never close its first key, but what it writes is one
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"}).choices[0]
    assert r.message.content.startswith('{"')
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)


def test_streamed_constrained_answer_equals_the_whole_one(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    whole, _ = _json_answer(client, response_format=fmt)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                            response_format=fmt, stream=True)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)) == whole


def test_vllm_extra_fields(client):
    def answer(**extra) -> str:
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, extra_body=extra)
        return r.choices[0].message.content

    assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{2}", answer(guided_regex=r"[A-Z][a-z]{2,6}-[0-9]{2}"))
    assert answer(guided_choice=["sunny", "rainy", "snow"]) in ("sunny", "rainy", "snow")
    jsonschema.validate(json.loads(answer(guided_json=SCHEMA)), SCHEMA)
    jsonschema.validate(json.loads(answer(guided_json=json.dumps(SCHEMA))), SCHEMA)
    assert answer(guided_grammar='root ::= "yes" | "no" | "maybe"') in ("yes", "no", "maybe")
    assert answer(structured_outputs={"choice": ["a", "b"]}) in ("a", "b")
    assert re.fullmatch(r"[0-9]{3}", answer(structured_outputs={"regex": "[0-9]{3}"}))
    completion = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=0,
                                           extra_body={"guided_choice": ["left", "right"]})
    assert completion.choices[0].text in ("left", "right")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "[unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
])
def test_bad_constraints_and_tools_are_400s(server, body, param):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def _call_args(call) -> dict:
    assert call.type == "function" and call.id
    return json.loads(call.function.arguments)


def test_forced_tool_calls_in_the_generic_format(client):
    """The tiny model's chat template knows no tools: the generic system-prompt format, named in
    the answer; a forced call parses and matches the tool's schema."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert r.model_extra["tool_call_format"] == "generic"
    (call,) = choice.message.tool_calls
    schema = SCHEMA if call.function.name == "get_weather" else TIME["function"]["parameters"]
    jsonschema.validate(_call_args(call), schema)
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0.8, seed=1)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and _call_args(call)["city"] in ("Paris", "Rome")


def test_streamed_tool_call_deltas(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=0, stream=True)
    calls, reasons, formats = {}, [], set()
    for chunk in stream:
        formats.add(chunk.model_extra.get("tool_call_format"))
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                slot["id"] = slot["id"] or d.id
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and formats == {"generic"}
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA)


def test_auto_and_none_and_results_fed_back(client):
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=20, temperature=0)
    assert auto.model_extra["tool_call_format"] == "generic"
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=20, temperature=0)
    assert none.choices[0].message.tool_calls is None and "tool_call_format" not in none.model_extra
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    fed = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=10, temperature=0)
    assert fed.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the client's own response message, sent back as it came
    forced = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=0).choices[0].message
    (call,) = forced.tool_calls
    again = ASK + [forced, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert client.chat.completions.create(model=MODEL, messages=again, tools=[WEATHER], max_tokens=5,
                                          temperature=0).choices[0].finish_reason


def test_generic_prompt_shows_tools_calls_and_results(pipe):
    tools = parse_tools({"tools": [WEATHER], "parallel_tool_calls": False})
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    text = pipe.tokenizer.decode(render_prompt(pipe.tokenizer, history, tools, "generic"))
    assert '"name": "get_weather"' in text and "<tools>" in text and "at most one tool" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert "<tools>" not in pipe.tokenizer.decode(render_prompt(pipe.tokenizer, ASK, ToolRequest(tools.tools, "none"),
                                                                "generic"))


QWEN_LIKE = ("{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
             "<|im_end|>\n{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
             "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
             "{% endfor %}{% endif %}<|im_end|>\n{%- endfor %}<|im_start|>assistant\n")
LLAMA_LIKE = "{%- if tools %}Environment: ipython{% endif %}{{ '<|python_tag|>' }}"


def test_families_are_chosen_from_the_chat_template(pipe):
    assert detect_family(pipe.tokenizer.chat_template) == "generic"
    assert detect_family(QWEN_LIKE) == "hermes"
    assert detect_family(LLAMA_LIKE) == "llama3_json"
    assert detect_family(None) == "generic"


def test_parsers_whole_and_streamed():
    text = ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": "z"}}\n</tool_call>')
    content, calls = parse_calls("hermes", text)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"y": "z"})]
    stream, pieces, got = ToolStream("hermes"), [], []
    for i in range(0, len(text), 3):  # tiny deltas split the markers
        piece, new = stream.push(text[i:i + 3])
        pieces.append(piece)
        got.extend(new)
    piece, new = stream.push("", final=True)
    # the content streamed is what came before the calls, not the newlines between them
    assert "".join(pieces + [piece]) == "Let me check.\n" and [c.name for c in got + new] == ["a", "b"]
    assert parse_calls("hermes", "<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert parse_calls("generic", "no calls < here") == ("no calls < here", [])
    content, calls = parse_calls("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"q": 2}}; '
                                                '{"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"q": 2}), ("g", {})]
    assert parse_calls("llama3_json", "Paris is sunny.") == ("Paris is sunny.", [])
    assert parse_calls("llama3_json", '{"city": "Paris"}') == ('{"city": "Paris"}', [])


@pytest.mark.slow
def test_smollm2_json_schema_and_forced_call_with_the_openai_client(smollm2_dir):
    """The real small model through `blockspec serve`'s app: a JSON-schema answer and a forced
    tool call (SmolLM2's template knows no tools: the generic format) parse and match."""
    import blockspec.api
    from blockspec.server.app import create_app
    from blockspec.server.launch import BackgroundServer

    drafter = blockspec.api.default_drafter_for("smollm2-135m-instruct")
    pipe = blockspec.api.load(str(smollm2_dir), str(drafter))
    app = create_app(pipe, served_model_name="smol")
    with BackgroundServer(app) as srv, OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300) as c:
        fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
        r = c.chat.completions.create(model="smol", messages=ASK, max_tokens=100, temperature=0, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.usage.model_extra["dflash"]["tau"] > 1.0  # decoded speculatively
        r = c.chat.completions.create(model="smol", messages=ASK, max_tokens=100, temperature=0,
                                      response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
        r = c.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                      max_tokens=100, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls" and r.model_extra["tool_call_format"] == "generic"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        with pytest.raises(BadRequestError):
            c.chat.completions.create(model="smol", messages=ASK, max_tokens=5, extra_body={"guided_regex": "("})


@pytest.mark.parametrize("family,template", [("hermes", QWEN_LIKE), ("llama3_json", None)])
def test_each_family_renders_tools_and_forces_a_parsable_call(pipe, family, template):
    """Per family: the template (given the tools and a call fed back) renders them, and a forced
    call generated on the tiny model under the family's grammar parses back into a call whose
    arguments match the schema, whole and streamed."""
    import copy

    from blockspec.config import SamplingParams
    from blockspec.engine.grammar import Grammars
    from blockspec.server.tools import forced_format

    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    if template is not None:
        tok = copy.deepcopy(pipe.tokenizer)
        tok.chat_template = template
        history = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_time", "arguments": '{"city": "Rome"}'}}]}]
        text = tok.decode(render_prompt(tok, history, tools, family))
        assert '"name": "get_weather"' in text and '{"name": "get_time", "arguments": {"city": "Rome"}}' in text
    info = pipe.target.info
    grammars = Grammars(pipe.tokenizer, info.vocab_size, info.eos_token_ids)
    fmt = forced_format(tools, family)
    prompt = pipe.encode(ASK)
    for seed in (0, 1):
        r = pipe.decoder.generate([prompt], SamplingParams(max_new_tokens=120, temperature=1.0, seed=seed),
                                  constraints=[grammars.matcher(fmt)])[0]
        assert r.finish_reason == "stop"
        out = pipe.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        content, calls = parse_calls(family, out)
        assert content is None and len(calls) == 1, out
        schema = {t.name: t.parameters for t in tools.tools}[calls[0].name]
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        stream = ToolStream(family)
        streamed = [c for i in range(0, len(out), 5) for c in stream.push(out[i:i + 5])[1]]
        streamed += stream.push("", final=True)[1]
        assert [(c.name, c.arguments) for c in streamed] == [(calls[0].name, calls[0].arguments)]
