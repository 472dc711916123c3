"""The OpenAI-compatible server over real HTTP on loopback, with the official `openai` client and
a tiny random Llama (tests/server/conftest.py)."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from server_support import client, pipe, server  # noqa: F401 (fixtures)
from server_support import HELLO, MODEL, assert_error, post, sse_events, wait_for

from blockspec.config import SpecConfig
from blockspec.engine import Engine, EngineConfig
from blockspec.server.app import create_app, default_model_name
from blockspec.server.launch import BackgroundServer

# ---- the published model-card snippet and text equality -------------------------------------

def test_model_card_snippet_matches_in_process_generation(server, pipe):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY")
    response = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0.0)
    expected = pipe.generate(HELLO, max_new_tokens=12, temperature=0.0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.model == MODEL and response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(pipe.encode(HELLO))
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    dflash = response.usage.model_extra["dflash"]
    assert dflash["block_size"] == 4 and dflash["steps"] >= 1
    # the first token comes from the prefill; every decode step commits tau tokens on average
    assert dflash["tau"] == pytest.approx((response.usage.completion_tokens - 1) / dflash["steps"], abs=1e-3)


def test_streaming_equals_non_streaming_and_usage_last(server, client, pipe):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    expected = pipe.generate(messages, max_new_tokens=20, temperature=0.0)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.model_extra["dflash"]["tau"] >= 1.0
    assert len({c.id for c in chunks}) == 1


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" not in c or c["usage"] is None for c in chunks)  # not asked for


def test_completions_endpoint_text_and_stream(server, client, pipe):
    prompt = "from typing import List\n"
    expected = pipe.generate(prompt, chat=False, max_new_tokens=10, temperature=0.0)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0)
    assert full.object == "text_completion"
    assert full.choices[0].text == expected.text
    assert full.usage.prompt_tokens == len(pipe.encode(prompt))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0, stream=True))
    assert streamed == expected.text
    by_ids = client.completions.create(model=MODEL, prompt=pipe.encode(prompt), max_tokens=10, temperature=0.0)
    assert by_ids.choices[0].text == expected.text


def test_stop_strings_cut_text_in_both_modes(server, client, pipe):
    base = pipe.generate(HELLO, max_new_tokens=24, temperature=0.0, ignore_eos=True).text
    assert len(base) >= 6, "the tiny model should produce some text"
    stop = base[3:6]
    cut = base[: base.find(stop)]
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=24, temperature=0.0, stop=[stop],
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == cut and full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut


def test_thinking_switch_through_chat_template_kwargs(server, client, pipe):
    on = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0.0)
    off = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0.0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == len(pipe.encode(HELLO, enable_thinking=False))
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_seeded_sampling_is_reproducible(server, client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                  extra_body={"top_k": 50})
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b
    # between sampled batch mates that join and leave (so the steps' sizes and rows differ)
    mates = [dict(kwargs, seed=100 + i, max_tokens=3 + 4 * i, messages=[{"role": "user", "content": "Hi " * i}])
             for i in range(6)]
    with ThreadPoolExecutor(max_workers=7) as pool:
        busy = [pool.submit(client.chat.completions.create, **m) for m in mates[:3]]
        again = pool.submit(client.chat.completions.create, **kwargs)
        busy += [pool.submit(client.chat.completions.create, **m) for m in mates[3:]]
        assert again.result().choices[0].message.content == a
        assert all(f.result().choices for f in busy)


def test_the_server_takes_requests_once_its_adaptive_engine_is_calibrated(pipe):
    engine = Engine(pipe.target, pipe.drafter, EngineConfig(SpecConfig(block_size=4, adaptive=True), max_batch=4),
                    tokenizer=pipe.tokenizer)
    app = create_app(pipe, engine=engine, served_model_name=MODEL)
    try:
        with BackgroundServer(app) as srv:
            assert engine.ready  # start-up waited for the step timings; no request pays for them
            assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    finally:
        engine.stop()


def test_models_health_and_metrics(server, client, pipe):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve(MODEL).model_extra["compute"] == pipe.compute  # the target's compute mode
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert_error(httpx.get(f"{server.url}/v1/models/nope"), 404, code="model_not_found")
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0.0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("blockspec_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"}",
                 "blockspec_generation_tokens_total", "blockspec_prompt_tokens_total", "blockspec_tau ",
                 "blockspec_request_latency_seconds_bucket", "blockspec_time_to_first_token_seconds_count",
                 "blockspec_engine_queue_depth", "blockspec_engine_requests_running", "blockspec_engine_mean_tau"):
        assert name in text, name
    assert text.count("time_to_first_token_seconds_count") == 1  # one definition: from arrival
    assert default_model_name(pipe) == pipe.target_source.rstrip("/").rsplit("/", 1)[-1]


# ---- continuous batching, disconnects, queue bound -------------------------------------------

def test_32_concurrent_streams_all_correct(server, pipe):
    prompts = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(8)]
    expected = [pipe.generate(p, max_new_tokens=8, temperature=0.0).text for p in prompts]
    client = OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)

    def one(i: int) -> str:
        stream = client.chat.completions.create(model=MODEL, messages=prompts[i % 8], max_tokens=8,
                                                temperature=0.0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = [pool.submit(one, i) for i in range(32)]
        texts = [f.result(timeout=60) for f in futures]
    assert texts == [expected[i % 8] for i in range(32)]
    wait_for(lambda: server.engine.metrics.requests_running == 0, what="the batch to drain")


def test_disconnect_mid_stream_frees_the_slot(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    cancelled = server.engine.metrics.cancelled_total
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        while got < 3:  # the role chunk plus two with text
            if next(lines).startswith("data: "):
                got += 1
        assert server.engine.metrics.requests_running == 1
    tokens_at_close = server.engine.metrics.tokens_generated_total
    wait_for(lambda: server.engine.metrics.requests_running == 0, timeout=3.0, what="the slot to be freed")
    assert server.engine.metrics.tokens_generated_total - tokens_at_close < 200  # it did not run to 3000
    assert server.engine.metrics.cancelled_total == cancelled + 1


def test_non_streaming_disconnect_cancels_the_request(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    cancelled = server.engine.metrics.cancelled_total
    with pytest.raises(httpx.ReadTimeout):
        post_timeout = httpx.Timeout(30, read=0.5)
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=post_timeout)
    # (on a busy machine the client may leave before its prompt is even tokenised: the request is
    # then admitted and cancelled after it, so wait for the cancellation, not just an empty batch)
    def cancelled_and_freed() -> bool:
        metrics = server.engine.metrics  # a snapshot
        return metrics.cancelled_total == cancelled + 1 and metrics.requests_running == 0

    wait_for(cancelled_and_freed, timeout=10.0, what="the request to be cancelled and its slot freed")


def test_queue_full_gives_429_and_shutdown_503(pipe):
    config = EngineConfig(SpecConfig(block_size=4), max_batch=1, max_queue=1)
    app = create_app(pipe, engine_config=config, served_model_name=MODEL)
    engine = app.state.blockspec.engine
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with BackgroundServer(app) as srv, httpx.Client(timeout=30) as http:
        streams = []
        try:
            for _ in range(2):  # one decoding, one waiting: the engine is full
                cm = http.stream("POST", f"{srv.url}/v1/chat/completions", json=body)
                response = cm.__enter__()
                streams.append(cm)
                assert response.status_code == 200
            wait_for(lambda: engine.metrics.requests_running + engine.metrics.queue_depth == 2, what="admission")
            assert_error(post(srv, "/v1/chat/completions", {**body, "stream": False}), 429, code="queue_full")
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)
        wait_for(lambda: engine.metrics.requests_running + engine.metrics.queue_depth == 0, timeout=3.0,
                 what="cancelled requests to leave")
        ok = post(srv, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        app.state.blockspec.draining = True
        assert_error(post(srv, "/v1/chat/completions", {**body, "stream": False}), 503, code="shutting_down")
        assert httpx.get(f"{srv.url}/health").status_code == 503


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body,status,param,code", [
    ({"model": MODEL, "messages": "hi"}, 400, "messages", "invalid_type"),
    ({"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ({"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ({"messages": HELLO}, 400, "model", "missing_required_parameter"),
    ({"model": "gpt-4o", "messages": HELLO}, 404, "model", "model_not_found"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 2.5}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 10**15}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "max_completion_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "ducks " * 5000}]}, 400, "messages",
     "context_length_exceeded"),
    ({"model": MODEL, "messages": HELLO, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "temperature": -0.5}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "stop": 3}, 400, "stop", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "seed": True}, 400, "seed", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "n": 0}, 400, "n", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "n": 17}, 400, "n", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "logprobs": "yes"}, 400, "logprobs", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "top_logprobs": 3}, 400, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400,
     "tools[0].function.name", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "response_format": {"type": "xml"}}, 400, "response_format.type",
     "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ({"model": MODEL, "messages": HELLO, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x", "colour": "red"}]}, 400, "messages[0].colour",
     "unknown_parameter"),
    ({"model": MODEL, "messages": HELLO, "chat_template_kwargs": "no"}, 400, "chat_template_kwargs", "invalid_type"),
    ({"model": MODEL, "messages": HELLO, "logit_bias": {"320": -100}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "messages": HELLO, "logit_bias": {"3": -100.5}}, 400, "logit_bias", "invalid_value"),
])
def test_chat_errors_have_openai_shape_and_status(server, body, status, param, code):
    assert_error(post(server, "/v1/chat/completions", body), status, param=param, code=code)


@pytest.mark.parametrize("body,param,code", [
    ({"model": MODEL}, "prompt", "missing_required_parameter"),
    ({"model": MODEL, "prompt": 7}, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": ["a", [1, 2]]}, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": []}, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": [[1, 2], []]}, "prompt[1]", "invalid_type"),
    ({"model": MODEL, "prompt": ["a"] * 65}, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": [1] * 5000, "max_tokens": 1}, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": [10**6]}, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": [[1, 2], [10**6]]}, "prompt[1]", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, "echo", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"320": 1}}, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": [5, 1]}, "logit_bias", "invalid_type"),
])
def test_completion_errors(server, body, param, code):
    assert_error(post(server, "/v1/completions", body), 400, param=param, code=code)


def test_malformed_bodies_and_routes(server):
    assert_error(post(server, "/v1/chat/completions", raw=b'{"model": "x", "messages": ['), 400, code="invalid_json")
    assert_error(post(server, "/v1/chat/completions", raw=b"\xff\xfe"), 400, code="invalid_json")
    assert_error(post(server, "/v1/chat/completions", [1, 2]), 400, code="invalid_json")
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{server.url}/v1/chat/completions"), 405)


def test_bad_requests_do_not_disturb_a_running_stream(server, pipe):
    expected = pipe.generate(HELLO, max_new_tokens=30, temperature=0.0, ignore_eos=True).text
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 30, "temperature": 0, "stream": True,
            "ignore_eos": True}
    pieces: list[str] = []

    def consume() -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
            for e in sse_events(r):
                if e != "[DONE]":
                    pieces.extend(c["delta"].get("content") or "" for c in json.loads(e)["choices"])

    worker = threading.Thread(target=consume)
    worker.start()
    for bad in ({"model": MODEL, "messages": HELLO, "max_tokens": -5}, {"model": MODEL, "messages": 3}):
        assert post(server, "/v1/chat/completions", bad).status_code == 400
    assert post(server, "/v1/chat/completions", raw=b"nonsense").status_code == 400
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert "".join(pieces) == expected


# ---- API key ---------------------------------------------------------------------------------

def test_api_key_is_enforced_everywhere_but_health(pipe):
    app = create_app(pipe, engine_config=EngineConfig(SpecConfig(block_size=4), max_batch=2), served_model_name=MODEL,
                     api_key="s3cret")
    with BackgroundServer(app) as srv:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0}
        assert_error(post(srv, "/v1/chat/completions", body), 401, code="invalid_api_key")
        assert_error(post(srv, "/v1/chat/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(post(srv, "/v1/chat/completions", body, headers={"Authorization": "s3cret"}), 401)
        assert_error(httpx.get(f"{srv.url}/v1/models"), 401)
        assert_error(httpx.get(f"{srv.url}/metrics"), 401)
        assert httpx.get(f"{srv.url}/health").status_code == 200
        with OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0) as good:
            reply = good.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0.0)
            assert reply.usage.completion_tokens >= 1
        with OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0) as bad:
            with pytest.raises(Exception) as info:
                bad.models.list()
            assert getattr(info.value, "status_code", None) == 401


# ---- the endpoint benchmark runner and the CLI -----------------------------------------------

def test_endpoint_bench_against_the_server(server, pipe):
    from blockspec.bench.http import run_endpoint_bench

    prompts = ["Janet has 16 ducks.", [{"role": "user", "content": "def add(a, b):"}], "What is 2 + 2?"]
    levels = run_endpoint_bench(server.url, MODEL, prompts, concurrency_levels=[1, 3], max_tokens=6,
                                temperature=0.0, api_key=None, warmup=0)
    assert [lv.concurrency for lv in levels] == [1, 3]
    for lv in levels:
        assert lv.errors == 0 and len(lv.requests) == 3
        for r in lv.requests:
            assert r.ok and 1 <= r.output_tokens <= 6 and r.latency_s > 0 and r.tokens_per_s > 0
            assert r.ttft_s is not None and r.ttft_s <= r.latency_s and r.tau is not None
        assert lv.throughput_tok_s > 0 and lv.tau >= 1.0
        assert lv.as_dict()["per_request"][0]["index"] == 0
    expected = pipe.generate(prompts[2], chat=True, max_new_tokens=6, temperature=0.0).text
    assert levels[1].requests[2].text == expected


def test_endpoint_bench_fails_early_with_the_fix(server):
    from blockspec.bench.http import run_endpoint_bench
    from blockspec.errors import ConfigError

    with pytest.raises(ConfigError, match="does not serve model"):
        run_endpoint_bench(server.url + "/v1/", "other-model", ["hi"], [1], 4, 0.0, None)


def test_bench_cli_endpoint_writes_the_table(server, tmp_path):
    import json

    from blockspec.cli import main

    out = tmp_path / "bench"
    code = main(["bench", "--endpoint", server.url, "--model", MODEL, "--datasets", "gsm8k",
                 "--limit", "2", "--concurrency", "1,2", "--max-new-tokens", "4", "--out", str(out)])
    assert code == 0
    report = (out / "report.md").read_text()
    assert "| Task | Concurrency | Throughput (tok/s)" in report
    assert "| gsm8k | 1 |" in report and "| gsm8k | 2 |" in report
    data = json.loads((out / "results.json").read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    assert all(lv["errors"] == 0 and lv["output_tokens"] >= 2 for lv in data["levels"])


def test_serve_cli_refuses_a_busy_port_before_loading(capsys):
    from blockspec.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code = main(["serve", "--target", "/nonexistent/model", "--port", str(port)])
    assert code == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_a_tree_server_reports_acceptance_by_depth_and_rank(tiny_model_dir):
    """--tree-nodes on the Hugging Face backend: the answer is plain greedy decoding's, and the
    usage and /metrics count tree steps and acceptance by depth and rank."""
    import torch

    import blockspec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tree = blockspec.api.load(str(tiny_model_dir), "fresh", dtype="float64", block_size=4, backend="hf",
                                  tree_nodes=3)
        assert tree.tree_nodes == 3
        expected = tree.generate(HELLO, max_new_tokens=6, temperature=0.0, block_size=1).text
        with BackgroundServer(create_app(tree, served_model_name=MODEL)) as srv:
            client = OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY")
            response = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0.0)
            text = httpx.get(f"{srv.url}/metrics").text
    finally:
        torch.set_num_threads(threads)
    assert response.choices[0].message.content == expected
    dflash = response.usage.model_extra["dflash"]
    assert dflash["tree_steps"] > 0 and isinstance(dflash["accepted_by_rank"], list)
    steps = next(line for line in text.splitlines() if line.startswith("blockspec_spec_tree_steps_total "))
    assert int(steps.split()[1]) == dflash["tree_steps"]
    assert 'blockspec_spec_accepted_by_depth_total{depth="1"}' in text
    assert "# TYPE blockspec_spec_accepted_by_rank_total counter" in text
