"""Helpers of the server tests: the served name, a prompt, HTTP shortcuts and error checks."""

from __future__ import annotations

import json
import time

import httpx

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
