"""A pooled connection idle longer than uvicorn's default keep-alive (5 s) is still served.

What lm-eval's `local-completions` saw as "Server disconnected": its aiohttp pool keeps idle
connections for 15 s, uvicorn closed them after 5 s, and a POST written on a connection whose
close the client had not processed yet (its event loop busy) failed; aiohttp does not retry a
POST. The server's keep-alive now outlasts the clients' pools (launch.KEEP_ALIVE_S)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from fastapi import FastAPI
from server_support import MODEL, pipe, server  # noqa: F401 (fixtures)

from blockspec.server.launch import BackgroundServer

UVICORN_DEFAULT_S = 5.0
IDLE_S = UVICORN_DEFAULT_S + 1.0


def test_a_connection_idle_past_the_old_keep_alive_is_reused(server):
    old = FastAPI()

    @old.post("/v1/completions")
    async def answer() -> dict:
        return {"ok": True}

    body = {"model": MODEL, "prompt": "Janet has", "max_tokens": 2, "temperature": 0}

    async def twice(url: str) -> tuple[int, str | None]:
        """Two POSTs on one pooled connection, the event loop blocked in between (as a client
        busy tokenising is); the second's status, or the error it met."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            async with session.post(url + "/v1/completions", json=body) as r:
                await r.read()
            time.sleep(IDLE_S)  # blocking on purpose: the loop cannot see the server's close meanwhile
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, None
            except aiohttp.ClientError as e:
                return -1, f"{type(e).__name__}: {e}"

    async def both(urls: list[str]) -> list:
        return await asyncio.gather(*(twice(u) for u in urls))

    with BackgroundServer(old, keep_alive_s=UVICORN_DEFAULT_S) as control:
        ours, theirs = asyncio.run(both([server.url, control.url]))
    assert ours == (200, None)
    # the control shows the test reproduces the failure with uvicorn's default
    assert theirs[0] == -1 and "Server disconnected" in theirs[1], theirs
