"""One tiny served model for every server test (tests/conftest.py `tiny_model_dir`, float64 so
greedy text is exact), started once for the folder."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from server_support import MODEL

import blockspec.api
from blockspec.engine import Engine, EngineConfig
from blockspec.server.app import create_app
from blockspec.server.launch import BackgroundServer


@pytest.fixture(scope="package")
def pipe(tiny_model_dir):
    # One intra-op thread: on a small shared CPU, thread contention makes tiny models 5x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield blockspec.api.load(str(tiny_model_dir), "fresh", dtype="float64", block_size=4)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def server(pipe):
    engine = Engine(pipe.target, pipe.drafter, EngineConfig(max_batch=8, max_queue=64, block_size=4),
                    tokenizer=pipe.tokenizer)
    app = create_app(pipe, engine=engine, served_model_name=MODEL)
    try:
        with BackgroundServer(app) as srv:
            srv.engine = engine
            srv.state = app.state.blockspec
            yield srv
    finally:
        engine.stop()


@pytest.fixture(scope="package")
def client(server):
    with OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60) as c:
        yield c
