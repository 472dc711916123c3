"""Malformed and hostile requests: each is a 4xx in OpenAI's error shape, on a connection that stays
open, and none of them stalls the event loop or leaves the server unhealthy."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import HELLO, MODEL, assert_error, pipe, post, server  # noqa: F401 (fixtures)

from blockspec.config import SpecConfig
from blockspec.engine import EngineConfig
from blockspec.server.app import create_app
from blockspec.server.launch import BackgroundServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def local_port(response: httpx.Response) -> int:
    """The client-side port of the connection a response came on (same port: same connection)."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def good(max_tokens: int = 2) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": max_tokens, "temperature": 0}


@pytest.mark.parametrize("bad,param,code", [
    (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "messages[0].content", "invalid_unicode"),
    (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "ok \\udfff tail"}]}',
     "messages[0].content", "invalid_unicode"),
    (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]}',
     "stop[0]", "invalid_unicode"),
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model", "invalid_unicode"),
    (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "\\udc00": 1}', None,
     "invalid_unicode"),
    (b"[" * 100_000, None, "invalid_json"),
    (b'{"model": "tiny-llama", "messages": ' + b"[" * 50 + b"]" * 50 + b"}", None, "invalid_json"),
    (json.dumps({**good(), "chat_template_kwargs": {"add_generation_prompt": False}}).encode(),
     "chat_template_kwargs.add_generation_prompt", "invalid_value"),
    (json.dumps({**good(), "chat_template_kwargs": {"tokenize": True}}).encode(),
     "chat_template_kwargs.tokenize", "invalid_value"),
    (json.dumps({**good(), "chat_template_kwargs": {"messages": []}}).encode(),
     "chat_template_kwargs.messages", "invalid_value"),
    (json.dumps({**good(), "chat_template_kwargs": {"no_such_switch": 1}}).encode(),
     "chat_template_kwargs.no_such_switch", "invalid_value"),
    (json.dumps({**good(), "chat_template_kwargs": {"enable_thinking": {"deep": [1]}}}).encode(),
     "chat_template_kwargs.enable_thinking", "invalid_type"),
    (json.dumps({**good(), "max_tokens": [1] * 10}).encode(), "max_tokens", "invalid_type"),
])
def test_malformed_chat_is_4xx_and_the_connection_stays_open(server, bad, param, code):
    with httpx.Client(timeout=30) as http:
        first = post(server, CHAT, raw=bad, http=http)
        err = assert_error(first, 400, param=param, code=code)
        assert "Traceback" not in err["message"] and "File \"" not in err["message"]
        second = post(server, CHAT, good(), http=http)
        assert second.status_code == 200, second.text
        assert local_port(first) == local_port(second)  # the bad request did not cost the connection


@pytest.mark.parametrize("bad,param,code", [
    (b'{"model": "tiny-llama", "prompt": "abc \\ud800", "max_tokens": 2}', "prompt", "invalid_unicode"),
    (b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "suffixx": "y"}', "suffixx", "unknown_parameter"),
    (b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "messages": []}', "messages", "unknown_parameter"),
    (b'{"model": "tiny-llama", "prompt": "x", "best_of": 3}', "best_of", "unsupported_parameter"),
    (b'{"model": "tiny-llama", "prompt": "x", "logprobs": true}', "logprobs", "invalid_type"),
    (b'{"model": "tiny-llama", "prompt": "x", "logprobs": 21}', "logprobs", "invalid_value"),
])
def test_malformed_completion_is_4xx(server, bad, param, code):
    with httpx.Client(timeout=30) as http:
        first = post(server, COMPLETIONS, raw=bad, http=http)
        assert_error(first, 400, param=param, code=code)
        second = post(server, COMPLETIONS, {"model": MODEL, "prompt": "Janet", "max_tokens": 2}, http=http)
        assert second.status_code == 200 and local_port(first) == local_port(second)


def test_unknown_fields_answered_as_openai_does(server):
    err = assert_error(post(server, CHAT, {**good(), "temprature": 0.5}), 400, param="temprature")
    assert err["message"] == "Unrecognized request argument supplied: temprature"
    assert err["type"] == "invalid_request_error"
    # what OpenAI accepts and this server can honour or safely ignore is accepted
    ok = post(server, CHAT, {**good(), "user": "u1", "store": False, "metadata": {"k": "v"}, "parallel_tool_calls": True,
                             "tool_choice": "none", "service_tier": "auto", "n": 1})
    assert ok.status_code == 200, ok.text


def test_template_switches_the_template_reads_are_accepted(server, pipe):
    assert "enable_thinking" in server.state.switches  # read from the tiny model's chat template
    off = post(server, CHAT, {**good(1), "chat_template_kwargs": {"enable_thinking": False}})
    assert off.status_code == 200, off.text
    assert off.json()["usage"]["prompt_tokens"] == len(pipe.encode(HELLO, enable_thinking=False))


def test_a_bug_is_a_500_without_internals_on_a_live_connection(server, monkeypatch):
    import blockspec.server.request_input as request_input

    def broken(*_args, **_kwargs):
        raise TypeError("TextEncodeInput must be Union[...] (secret internals)")

    monkeypatch.setattr(request_input, "encode_prompt", broken)
    with httpx.Client(timeout=30) as http:
        first = post(server, CHAT, good(), http=http)
        err = assert_error(first, 500, code="internal_error")
        assert "TextEncodeInput" not in err["message"] and "reference" in err["message"]
        monkeypatch.undo()
        second = post(server, CHAT, good(), http=http)
        assert second.status_code == 200 and local_port(first) == local_port(second)


def test_oversized_bodies_get_413_at_once(pipe):
    app = create_app(pipe, engine_config=EngineConfig(SpecConfig(block_size=4), max_batch=2), served_model_name=MODEL,
                     max_request_bytes=64 * 1024)
    with BackgroundServer(app) as srv:
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
        assert_error(post(srv, CHAT, raw=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield big[:50_000]
            yield big[50_000:]

        r = httpx.post(f"{srv.url}{CHAT}", content=chunks(), timeout=30, headers={"Content-Type": "application/json"})
        assert_error(r, 413, code="request_too_large")
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
        small = post(srv, CHAT, {**good(), "messages": [{"role": "user", "content": "x" * 30_000}]})
        assert small.status_code in (200, 400), small.text  # under the limit: judged on its merits


def test_health_answers_while_a_huge_prompt_is_tokenised(server, monkeypatch):
    """Template rendering and tokenising run off the event loop: while a 200 KB prompt is being
    tokenised (held up here to make the window wide), /health still answers."""
    import blockspec.server.request_input as request_input

    started, release = threading.Event(), threading.Event()
    real = request_input.encode_prompt

    def slow(*args, **kwargs):
        started.set()
        release.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(request_input, "encode_prompt", slow)
    monkeypatch.setattr(server.state, "max_token_bytes", None)  # no early bound: it must be tokenised
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ducks and eggs " * 15_000}], "max_tokens": 1}
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", post(server, CHAT, body)))
    worker.start()
    assert started.wait(30), "the prompt never reached the tokenizer"
    health = [httpx.get(f"{server.url}/health", timeout=5) for _ in range(3)]
    assert all(h.json() == {"status": "ok"} for h in health)
    assert "r" not in result  # the huge request is still being processed
    release.set()
    worker.join(60)
    assert_error(result["r"], 400, code="context_length_exceeded")


def test_a_prompt_far_over_the_context_is_refused_before_tokenising(server, monkeypatch):
    import blockspec.server.request_input as request_input

    def never(*_args, **_kwargs):
        raise AssertionError("tokenised a prompt that cannot fit")

    monkeypatch.setattr(request_input, "encode_prompt", never)
    assert server.state.max_token_bytes is not None
    content = "ducks " * (server.state.context_length * server.state.max_token_bytes // 5)
    r = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert_error(r, 400, param="messages", code="context_length_exceeded")


# ---- fuzzing both endpoints --------------------------------------------------------------------

def _weird(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value, biased to what breaks parsers: odd numbers, odd text, nesting."""
    kind = rng.randrange(11 if depth < 4 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, -(2**70), 3])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e308, -1e-308, 0.5, 2.5, 1.0])
    if kind in (4, 5, 6):
        pieces = ["", "a", "\x00", "\ud800", "\udfff", "é", "😀", "<|im_end|>", "{{ x }}", "{% if %}", "\n" * 3,
                  "duck " * rng.randrange(1, 50)]
        return "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 4)))
    if kind in (7, 8):
        return [_weird(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(["role", "content", "type", "text", "x", "\ud800"]): _weird(rng, depth + 1)
            for _ in range(rng.randrange(0, 3))}


FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
          "stream", "stream_options", "logprobs", "top_logprobs", "chat_template_kwargs", "response_format",
          "tools", "stop_token_ids", "ignore_eos", "best_of", "echo", "unknown_field"]


def _mutant(rng: random.Random, endpoint: str) -> bytes:
    body: dict = {"model": MODEL, "max_tokens": 2, "temperature": rng.choice([0, 0.7])}
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": "duck"}]
    else:
        body["prompt"] = "duck"
    for _ in range(rng.randrange(1, 4)):
        name = rng.choice(FIELDS)
        if name in ("max_tokens", "n"):  # keep answers short: any value but a large count
            body[name] = rng.choice([0, -1, "2", 2.5, None, [], 1, 3])
        else:
            body[name] = _weird(rng)
    raw = json.dumps(body).encode()
    cut = rng.randrange(8)
    if cut == 0:
        return raw[: rng.randrange(len(raw))]  # truncated
    if cut == 1:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]  # one byte changed
    return raw


def test_fuzzed_requests_never_get_5xx_and_the_server_stays_healthy(server):
    rng = random.Random(20240531)
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60) as http:
        for i in range(240):
            endpoint = CHAT if i % 2 else COMPLETIONS
            r = post(server, endpoint, raw=_mutant(rng, endpoint), http=http)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text)
            if r.status_code != 200:
                assert_error(r, r.status_code)
            elif "text/event-stream" not in r.headers.get("content-type", ""):
                assert r.json()["choices"]
    assert statuses.get(400, 0) > 50 and statuses.get(200, 0) > 5, statuses  # both kinds were exercised
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert post(server, CHAT, good()).status_code == 200
    assert server.engine.metrics.errors_total == 0


ODD_TEXT = st.sampled_from(["\ud800", "\udfff", "\x00", "<|im_end|>", "{{ messages }}", "{% raw %}", "😀", "é"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | ODD_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | ODD_TEXT, inner, max_size=4),
    max_leaves=12)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """(endpoint, raw body): a valid request with fields replaced or added by arbitrary JSON
    (names OpenAI knows and others), sometimes as raw bytes instead."""
    endpoint = draw(st.sampled_from([CHAT, COMPLETIONS]))
    if draw(st.integers(0, 9)) == 0:
        return endpoint, draw(st.binary(max_size=200))
    body: dict = {"model": MODEL, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "duck"}]} if endpoint == CHAT else {"prompt": "duck"})
    body.update(draw(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSON_VALUES, max_size=4)))
    for name, most in (("max_tokens", 3), ("n", 3)):  # keep accepted answers short
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > most:
            body[name] = most
    return endpoint, json.dumps(body).encode()


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=bodies())
def test_property_any_body_is_answered_below_500(server, case):
    """Hypothesis: arbitrary JSON in any field (surrogates, deep values, wrong types, unknown
    names) or arbitrary bytes, on both endpoints: never a 5xx, errors in OpenAI's shape."""
    endpoint, raw = case
    r = post(server, endpoint, raw=raw)
    assert r.status_code < 500, (r.status_code, r.text, raw[:300])
    if r.status_code != 200:
        assert_error(r, r.status_code)


def test_healthy_after_the_property_test(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert post(server, CHAT, good()).status_code == 200
    assert server.engine.metrics.errors_total == 0
