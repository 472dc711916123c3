"""Helpers of the server tests: the served name, a prompt, HTTP shortcuts, error checks, and the
fixtures of one tiny served model (tests/conftest.py `tiny_model_dir`, float64 so greedy text is
exact) that a test module imports to use: `pipe`, `server` (started once per module), `client`.
They live here, not in a conftest.py of this folder, because a second module named `conftest`
would shadow tests/conftest.py for the modules that import helpers from it."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from openai import OpenAI

import blockspec.api
from blockspec.config import SpecConfig
from blockspec.engine import Engine, EngineConfig
from blockspec.server.app import create_app
from blockspec.server.launch import BackgroundServer

MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Janet has 16 ducks. How much does she make?"}]


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def post(server, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None,
         http: httpx.Client | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    send = http.post if http is not None else httpx.post
    return send(f"{server.url}{path}", content=content, timeout=30,
                headers={"Content-Type": "application/json", **(headers or {})})


def assert_error(response: httpx.Response, status: int, *, param: str | None = "any", code: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    # One intra-op thread: on a small shared CPU, thread contention makes tiny models 5x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield blockspec.api.load(str(tiny_model_dir), "fresh", dtype="float64", block_size=4)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(pipe):
    engine = Engine(pipe.target, pipe.drafter, EngineConfig(SpecConfig(block_size=4), max_batch=8, max_queue=64),
                    tokenizer=pipe.tokenizer)
    app = create_app(pipe, engine=engine, served_model_name=MODEL)
    try:
        with BackgroundServer(app) as srv:
            srv.engine = engine
            srv.state = app.state.blockspec
            yield srv
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60) as c:
        yield c
