"""The GLM (4.5/4.6 and 4.7), Qwen3-Coder / Qwen3.5 / Qwen3.6 (qwen3_xml) and gpt-oss (harmony)
tool-call families, and Llama 3.1's streamed calls: chosen from the model, parsed from what the family's template writes (whole and streamed
token by token), bad output kept as content, forced calls under the family's grammar, and end
to end through the server with the official `openai` client."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from openai import BadRequestError, OpenAI
from server_support import pipe  # noqa: F401 (fixture)
from test_server_structured import ASK, SCHEMA, TIME, WEATHER
from tool_templates import EOS, GLM45, GLM47, HARMONY, QWEN3_XML, family_tokenizer

from blockspec.server.tools import ToolStream, detect_family, forced_format, keeps_special_tokens, parse_calls
from blockspec.server.tools.request import parse_tools
from blockspec.text import IncrementalDetokenizer, StopStrings

NOTE = {"type": "function", "function": {"name": "save_note", "description": "Saves a note.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                                     "meta": {"type": "object"}},
    "required": ["text"]}}}
CALLS = [("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"}),
         ("save_note", {"text": "if a < b:\n    say \"hi\"", "tags": ["x", "y"], "meta": {"k": 1}})]


def _history(calls, as_text: bool = True) -> list[dict]:
    """The question and an answer with `calls`: their arguments as JSON text (as OpenAI clients
    send them) or as objects (as chat templates take them)."""
    return ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a) if as_text else a}}
        for i, (n, a) in enumerate(calls)]}]


def _written(tok, calls, tools) -> str:
    """What the model writes for `calls`: the template's rendering of them as the last assistant
    turn, after the prompt that asks for them, up to its end token."""
    shown = [t.as_openai() for t in tools.tools]
    prompt = tok.apply_chat_template(ASK, tools=shown, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(_history(calls, as_text=False), tools=shown, add_generation_prompt=False,
                                   tokenize=False)
    assert full.startswith(prompt), (prompt, full)
    return full[len(prompt):].split("<|im_end|>")[0]


def _stream_tokens(family: str, tok, text: str, tools) -> tuple[str, list, list[int]]:
    """The text fed token by token through the server's detokenizer and ToolStream: (content,
    calls, the number of tokens pushed when each call came out); the content and calls equal
    those of the whole answer as the server decodes it."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    whole = parse_calls(family, tok.decode(ids, skip_special_tokens=not keeps_special_tokens(family)), tools.tools)
    detok = IncrementalDetokenizer(StopStrings(tok, (), keep_special=keeps_special_tokens(family)))
    stream, content, calls, when = ToolStream(family, tools.tools), [], [], []
    for k, t in enumerate(ids):
        piece, new = stream.push(detok.push([t]))
        content.append(piece)
        calls += new
        when += [k + 1] * len(new)
    piece, new = stream.push(detok.push([], final=True), final=True)
    content, calls = "".join(content + [piece]), calls + new
    assert (content if content.strip() else None, _pairs(calls)) == (whole[0], _pairs(whole[1]))
    return content, calls, when + [len(ids)] * len(new)


def _pairs(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_families_are_chosen_from_the_template_and_the_model_type():
    assert detect_family(GLM45) == "glm45"
    assert detect_family(GLM47) == "glm47"
    assert detect_family(HARMONY) == "harmony"
    assert detect_family(QWEN3_XML) == "qwen3_xml"
    assert detect_family(None, "gpt_oss") == "harmony"  # gpt-oss speaks harmony whatever its template
    assert detect_family("{{ messages }}", "glm4_moe") == "generic"  # a template that knows no tools


@pytest.mark.parametrize("family", ["glm45", "glm47", "qwen3_xml"])
def test_calls_as_the_template_writes_them_whole_and_streamed(family):
    tok = family_tokenizer(family)
    tools = parse_tools({"tools": [WEATHER, NOTE]})
    text = _written(tok, CALLS, tools)
    if family != "qwen3_xml":
        assert "<arg_key>days</arg_key>" in text and ("\n<arg_value>" in text) == (family == "glm45")
    content, calls = parse_calls(family, text, tools.tools)
    # string arguments keep their text (a '<' and quotes included), the others are read as JSON
    assert _pairs(calls) == CALLS
    # GLM's empty thinking block is what the template writes before the calls
    assert (content or "").strip() in ("<think></think>", "</think>", "")
    streamed, got, when = _stream_tokens(family, tok, text, tools)
    assert _pairs(got) == CALLS and not streamed.strip()  # the tiny tokenizer's <think> tokens are special
    n_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
    assert when[0] < n_tokens  # the first call came out as soon as it closed, before the answer ended


def test_glm_bad_calls_stay_content_and_unknown_functions_are_calls():
    tools = parse_tools({"tools": [WEATHER]})
    for bad in ["<tool_call>get_weather\n<arg_key>city</arg_key>\njunk<arg_value>Paris</arg_value>\n</tool_call>",
                "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                "<tool_call>get weather now\n</tool_call>",
                "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"]:  # cut off
        assert parse_calls("glm45", bad, tools.tools) == (bad, []), bad
    content, calls = parse_calls("glm45", "<tool_call>lookup\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n"
                                          "<arg_key>q</arg_key>\n<arg_value>x y</arg_value>\n</tool_call>", tools.tools)
    assert content is None and _pairs(calls) == [("lookup", {"n": 7, "q": "x y"})]


def test_qwen3_xml_bad_calls_stay_content_and_python_literals_are_read():
    tools = parse_tools({"tools": [WEATHER]})
    for bad in ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
                "<tool_call>\n<function=get_weather>\njunk<parameter=city>\nParis\n</parameter>\n</function>\n"
                "</tool_call>",
                '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>']:  # hermes' JSON is not this
        assert parse_calls("qwen3_xml", bad, tools.tools) == (bad, []), bad
    content, calls = parse_calls("qwen3_xml", "Sure.\n\n<tool_call>\n<function=lookup>\n<parameter=ok>\nTrue\n"
                                              "</parameter>\n<parameter=n>\nNone\n</parameter>\n</function>\n"
                                              "</tool_call>", tools.tools)
    assert content == "Sure.\n\n" and _pairs(calls) == [("lookup", {"ok": True, "n": None})]


def test_harmony_call_as_the_template_writes_it_and_the_channels():
    tok = family_tokenizer("harmony")
    tools = parse_tools({"tools": [WEATHER, NOTE]})
    text = _written(tok, CALLS[:1], tools)  # one call per message in harmony
    assert text.startswith(" to=functions.get_weather<|channel|>commentary json<|message|>")
    assert parse_calls("harmony", text, tools.tools)[1] and _pairs(parse_calls("harmony", text)[1]) == CALLS[:1]
    # what gpt-oss writes: thinking (not content), a preamble (content), then the call
    answer = ('<|channel|>analysis<|message|>The user wants weather.<|end|>'
              '<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>'
              '<|start|>assistant<|channel|>commentary to=functions.save_note <|constrain|>json<|message|>'
              + json.dumps(CALLS[1][1]) + '<|call|>')
    content, calls = parse_calls("harmony", answer, tools.tools)
    assert content == "Let me check." and _pairs(calls) == CALLS[1:]
    streamed, got, _ = _stream_tokens("harmony", tok, answer, tools)
    assert streamed == content and _pairs(got) == CALLS[1:]
    final = ('<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>'
             'Sunny <|in|> Paris.<|return|>')
    assert parse_calls("harmony", final) == ("Sunny <|in|> Paris.", [])
    streamed, got, _ = _stream_tokens("harmony", tok, final, tools)
    assert streamed == "Sunny <|in|> Paris." and got == []


def test_harmony_bad_output_stays_content():
    tok, tools = family_tokenizer("harmony"), parse_tools({"tools": [WEATHER]})
    broken = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par<|call|>'
    assert parse_calls("harmony", broken) == (broken, [])
    assert parse_calls("harmony", "no header at all, just text") == ("no header at all, just text", [])
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    for cut, shown in [(header, header),  # a call cut off by max_tokens right after its header
                       ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>", "<|start|>"),
                       ("<|channel|>final<|message|>Hi", "Hi")]:
        assert parse_calls("harmony", cut) == (shown, []), cut
        assert _stream_tokens("harmony", tok, cut, tools)[:2] == (shown, [])  # token by token: the same
    content, calls = parse_calls("harmony", '<|channel|>commentary to=functions.nope<|message|>{"a": 1}<|call|>')
    assert content is None and _pairs(calls) == [("nope", {"a": 1})]  # an unknown function is still a call
    builtin = "<|channel|>analysis to=python<|message|>print(1)<|call|>"  # a built-in tool we do not serve
    assert parse_calls("harmony", builtin) == (builtin, [])


def test_harmony_prompt_splits_parallel_calls_and_pairs_their_results():
    from blockspec.server.tools import render_prompt
    tok = family_tokenizer("harmony")
    tools = parse_tools({"tools": [WEATHER, NOTE]})
    history = _history(CALLS) + [{"role": "tool", "tool_call_id": "c1", "content": "saved"},
                                 {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    text = tok.decode(render_prompt(tok, history, tools, "harmony"))
    weather, note = text.index("to=functions.get_weather<|channel|>"), text.index("to=functions.save_note<|channel|>")
    sunny = text.index('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"')
    saved = text.index('<|start|>functions.save_note to=assistant<|channel|>commentary<|message|>"saved"')
    assert weather < sunny < note < saved and text.endswith("<|start|>assistant")
    assert "type get_weather" in text and "type save_note" in text


def test_llama3_json_calls_stream_as_each_one_completes():
    text = '<|python_tag|>{"name": "f", "parameters": {"q": 2}}; {"name": "g", "parameters": {"s": "}"}}'
    stream, got = ToolStream("llama3_json"), []
    for i in range(0, len(text), 3):
        content, new = stream.push(text[i:i + 3])
        assert content == ""
        got += [(i + 3, c) for c in new]
    assert [c.name for _, c in got] == ["f", "g"]
    assert got[0][0] < len(text)  # f came out before g was written
    assert got[0][0] >= text.index("}}") + 2
    assert stream.push("", final=True) == ("", [])
    content, calls = parse_calls("llama3_json", '{"name": "f", "parameters": {}} and then words')
    assert [c.name for c in calls] == ["f"] and content.strip() == "and then words"
    stream = ToolStream("llama3_json")
    assert stream.push('{"name": "f", "parameters": {"q": ') == ("", [])
    assert stream.push("oops", final=True) == ('{"name": "f", "parameters": {"q": oops', [])  # broken: content


def _accepts(grammars, fmt, tok, text: str, eos: int) -> bool:
    m = grammars.matcher(fmt)
    return all(m.accept(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and m.accept(eos)


@pytest.mark.parametrize("family", ["glm45", "glm47", "harmony", "qwen3_xml"])
def test_forced_grammar_takes_the_templates_call_and_refuses_a_wrong_one(family):
    from blockspec.engine.grammar import Grammars

    tok = family_tokenizer(family)
    eos = tok.convert_tokens_to_ids(EOS[family][-1])
    grammars = Grammars(tok, len(tok), (eos,))
    tools = parse_tools({"tools": [WEATHER, NOTE], "tool_choice": "required"})
    fmt = forced_format(tools, family)
    good = ("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"})
    if family == "harmony":
        def written(call):
            return f"<|channel|>commentary to=functions.{call[0]} <|constrain|>json<|message|>" + json.dumps(
                call[1], separators=(", ", ": "))
        text = written(good)
    else:
        text = _written(tok, [good], tools).split("</think>")[-1].lstrip("\n")
    assert _accepts(grammars, fmt, tok, text, eos), text
    wrong = {"harmony": text.replace("3", "15"), "qwen3_xml": text.replace("\n3\n", "\n15\n")}.get(
        family, text.replace(">3<", ">15<"))
    assert wrong != text and not _accepts(grammars, fmt, tok, wrong, eos)  # days > 14
    assert not _accepts(grammars, fmt, tok, text.replace("celsius", "kelvin"), eos)
    note = (CALLS[1][0], {"text": "if a < b: ok", "tags": ["x"], "meta": {"k": 1}})
    text = written(note) if family == "harmony" else _written(tok, [note], tools).split("</think>")[-1].lstrip("\n")
    assert _accepts(grammars, fmt, tok, text, eos), text


@pytest.mark.parametrize("family", ["glm45", "glm47", "harmony", "qwen3_xml"])
def test_forced_call_on_the_tiny_model_parses_and_matches(pipe, family):  # noqa: F811
    """Generated on the tiny random model (whose free text is garbage) under the family's grammar:
    one call whose arguments match its tool's schema, whole and streamed."""
    from blockspec.config import SamplingParams
    from blockspec.engine.grammar import Grammars

    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    info = pipe.target.info
    grammars = Grammars(pipe.tokenizer, info.vocab_size, info.eos_token_ids)
    fmt = forced_format(tools, family)
    for seed in (0, 1):
        r = pipe.decoder.generate([pipe.encode(ASK)], SamplingParams(max_new_tokens=300, temperature=1.0, seed=seed),
                                  constraints=[grammars.matcher(fmt)])[0]
        assert r.finish_reason == "stop"
        out = pipe.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        content, calls = parse_calls(family, out, tools.tools)
        assert content is None and len(calls) == 1, out
        jsonschema.validate(json.loads(calls[0].arguments), {t.name: t.parameters for t in tools.tools}[calls[0].name])
        stream = ToolStream(family, tools.tools)
        streamed = [c for i in range(0, len(out), 5) for c in stream.push(out[i:i + 5])[1]]
        streamed += stream.push("", final=True)[1]
        assert [(c.name, c.arguments) for c in streamed] == [(calls[0].name, calls[0].arguments)]


# ---- through the server, with a tiny model whose tokenizer carries the family's template and markers ----

@pytest.fixture(scope="module", params=["harmony", "glm45", "qwen3_xml"])
def family_server(request, tmp_path_factory):
    import blockspec.api
    from blockspec.server.app import create_app
    from blockspec.server.launch import BackgroundServer
    from conftest import build_tiny_model_dir

    family = request.param
    path = build_tiny_model_dir(tmp_path_factory.mktemp(f"{family}_model"), tokenizer=family_tokenizer(family),
                                eos_tokens=tuple(EOS[family]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = blockspec.api.load(str(path), "fresh", dtype="float64", block_size=4)
        with BackgroundServer(create_app(pipe, served_model_name="tiny")) as srv:
            srv.family = family
            yield srv
    finally:
        torch.set_num_threads(threads)


def test_tool_calls_through_the_openai_client(family_server):
    family = family_server.family
    tools = [WEATHER, TIME]  # bounded arguments: a random model's free strings could run past max_tokens
    with OpenAI(base_url=f"{family_server.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                           max_tokens=300, temperature=0)
        choice = r.choices[0]
        assert r.model_extra["tool_call_format"] == family and choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        schema = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert not (choice.message.content or "").strip()  # the call's markers never reach the content

        stream = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, max_tokens=300,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=0, stream=True)
        deltas, reasons, text = [], [], ""
        for chunk in stream:
            assert chunk.model_extra["tool_call_format"] == family
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                text += c.delta.content or ""
                reasons += [c.finish_reason] if c.finish_reason else []
        (delta,) = deltas
        assert delta.index == 0 and delta.function.name == "get_weather" and reasons == ["tool_calls"]
        jsonschema.validate(json.loads(delta.function.arguments), SCHEMA)
        assert not text.strip()

        if family == "harmony":
            # the markers as the special tokens gpt-oss writes (the grammar also lets the tiny model
            # spell them out): the answer's text must keep them for the call to be found
            tok = family_tokenizer(family)
            bias = {str(tok.convert_tokens_to_ids(t)): 100 for t in ("<|channel|>", "<|constrain|>", "<|message|>")}
            r = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, max_tokens=60, temperature=0,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               logit_bias=bias, logprobs=True)
            tokens = [t.token for t in r.choices[0].logprobs.content]
            assert {"<|channel|>", "<|constrain|>", "<|message|>"} <= set(tokens), tokens
            (timed,) = r.choices[0].message.tool_calls
            assert timed.function.name == "get_time" and json.loads(timed.function.arguments)["city"] in ("Paris", "Rome")
            # gpt-oss's template refuses a tool result with no call before it: a 400, not a crash
            with pytest.raises(BadRequestError, match="tool"):
                client.chat.completions.create(model="tiny", tools=tools, max_tokens=5, messages=ASK + [
                    {"role": "tool", "tool_call_id": "x", "content": "orphan"}])

        history = ASK + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'}]
        again = client.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=12,
                                               temperature=0)
        assert again.model_extra["tool_call_format"] == family
        assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_sequence_format_is_checked_on_construction():
    from blockspec.engine.grammar import OutputFormat
    from blockspec.errors import ConfigError

    OutputFormat("sequence", ((("text", "<a>"), ("json", {"type": "integer"}), ("regex", "[a-z]+")),))
    for bad in [(), ((),), ((("text", ""),),), ((("json", "not a schema"),),), ((("xml", "x"),),),
                [[("text", "a")]], ((("text", "a", "b"),),)]:
        with pytest.raises(ConfigError, match="sequence"):
            OutputFormat("sequence", bad)


def test_glm_forced_strings_follow_their_pattern_length_and_enum():
    from blockspec.engine.grammar import Grammars

    tok = family_tokenizer("glm47")
    eos = tok.convert_tokens_to_ids("<|user|>")
    grammars = Grammars(tok, len(tok), (eos,))
    month = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "month": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}, "code": {"type": "string", "maxLength": 3},
        "mode": {"enum": ["a.b", "c|d"]}}}}}
    fmt = forced_format(parse_tools({"tools": [month], "tool_choice": "required"}), "glm47")

    def call(m: str, c: str, mode: str) -> str:
        return (f"<tool_call>f<arg_key>month</arg_key><arg_value>{m}</arg_value><arg_key>code</arg_key>"
                f"<arg_value>{c}</arg_value><arg_key>mode</arg_key><arg_value>{mode}</arg_value></tool_call>")

    assert _accepts(grammars, fmt, tok, call("2024-05", "ab", "c|d"), eos)
    for bad in [call("2024-5", "ab", "c|d"), call("2024-05", "abcd", "c|d"), call("2024-05", "ab", "a")]:
        assert not _accepts(grammars, fmt, tok, bad, eos), bad
    content, calls = parse_calls("glm47", call("2024-05", "ab", "a.b"), parse_tools({"tools": [month]}).tools)
    assert content is None and _pairs(calls) == [("f", {"month": "2024-05", "code": "ab", "mode": "a.b"})]


@pytest.mark.parametrize("family,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": BIG}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": BIG}}'),
    ("harmony", '<|channel|>commentary to=functions.f<|message|>{"x": BIG}<|call|>'),
    ("glm45", "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>BIG</arg_value>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=x>\nBIG\n</parameter>\n</function>\n</tool_call>")])
def test_an_integer_python_will_not_convert_is_not_a_crash(family, text):
    """Python refuses to read integers of over 4300 digits (a ValueError, not a JSON error): a call
    with one is content, or for the formats that keep unreadable values as text, a string."""
    big = "9" * 5000
    content, calls = parse_calls(family, text.replace("BIG", big))
    if family in ("glm45", "qwen3_xml"):
        assert content is None and _pairs(calls) == [("f", {"x": big})]
    else:
        assert calls == [] and content == text.replace("BIG", big)
