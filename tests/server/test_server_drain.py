"""Graceful drain of `blockspec serve` on real signals, in a real server process: new requests get
503 `shutting_down` while the listener stays open, running requests finish until the deadline,
then every open stream ends with a finish_reason chunk and [DONE], and the process exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

DRAIN_S = 3.0
LONG = 4000  # tokens: far more than a tiny model decodes in DRAIN_S seconds on a busy CPU


def start_server(model_dir, drafter_dir) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockspec.cli", "serve", "--target", str(model_dir), "--drafter", str(drafter_dir),
         "--port", "0", "--served-model-name", "tiny", "--no-adaptive-block", "--max-batch", "8",
         "--drain-timeout", str(DRAIN_S), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # "serving 'tiny' (...) at http://127.0.0.1:PORT/v1"
    found = re.search(r"(http://[\d.]+:\d+)/v1", line)
    if not found:
        proc.kill()
        raise AssertionError(f"no URL in {line!r}; stderr: {proc.stderr.read()[-2000:]}")
    url = found.group(1)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not come up: {proc.stderr.read()[-2000:]}")
        time.sleep(0.1)


def stream(url: str, max_tokens: int, out: dict) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Janet has 16 ducks."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    events = out.setdefault("events", [])
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
    except httpx.TransportError as e:  # a stream cut off (what the drain must not do)
        out["error"] = repr(e)


def summary(out: dict) -> tuple[int, list[str], str | None]:
    """(tokens streamed, finish reasons, last event) of a stream's events."""
    chunks = [json.loads(e) for e in out.get("events", []) if e != "[DONE]"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return len(text), reasons, (out.get("events") or [None])[-1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_then_exits(tiny_model_dir, tiny_drafter_dir, sig):
    proc, url = start_server(tiny_model_dir, tiny_drafter_dir)
    try:
        long_runs = [{} for _ in range(3)]
        threads = [threading.Thread(target=stream, args=(url, LONG, out)) for out in long_runs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(len(out.get("events", [])) >= 3 for out in long_runs):  # all three are decoding
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.02)
        short: dict = {}
        short_thread = threading.Thread(target=stream, args=(url, 8, short))
        short_thread.start()
        while not short.get("events"):
            assert time.monotonic() < deadline, "the short stream did not start"
            time.sleep(0.01)

        signalled = time.monotonic()
        proc.send_signal(sig)
        time.sleep(0.3)
        # still listening, but turning work away
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "shutting_down"}

        short_thread.join(60)
        assert "error" not in short and short["status"] == 200
        assert summary(short)[1:] == (["length"], "[DONE]")  # it ran to its max_tokens inside the deadline

        for t in threads:
            t.join(60)
        for out in long_runs:  # cut at the deadline, properly ended
            assert "error" not in out and out["status"] == 200
            n, reasons, last = summary(out)
            assert reasons == ["length"] and last == "[DONE]"
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - signalled
        assert code == 0, proc.stderr.read()[-2000:]
        assert DRAIN_S - 0.5 <= elapsed < DRAIN_S + 20, elapsed
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_signal_ends_the_drain_at_once(tiny_model_dir, tiny_drafter_dir):
    proc, url = start_server(tiny_model_dir, tiny_drafter_dir)
    try:
        out: dict = {}
        t = threading.Thread(target=stream, args=(url, LONG, out), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while len(out.get("events", [])) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None  # draining
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
