"""Running the app with uvicorn: in the foreground (the CLI) or in a background thread (tests).

The listening socket is bound here, before uvicorn starts, so the real port is known at once
(port 0 picks a free one) and a port already in use fails with a clear message.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from blockspec.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


CLOSE_S = 5.0  # after the drain, how long idle keep-alive connections get to close
# How long an idle keep-alive connection stays open. It must outlast the idle time of the
# clients' connection pools (aiohttp 15 s, httpx 5 s, Go 90 s, load balancers 60 s): a server
# that closes first races the client's next request on that connection, which then fails with
# "Server disconnected" (aiohttp does not retry a POST). uvicorn's own default is 5 s.
KEEP_ALIVE_S = 120.0


class DrainingServer(uvicorn.Server):
    """uvicorn that drains instead of stopping at once (see `drain`); a second SIGTERM/SIGINT
    during the drain exits at once. Apps without a blockspec ServerState stop as uvicorn does."""

    def __init__(self, config: uvicorn.Config, drain_s: float) -> None:
        super().__init__(config)
        self.drain_s = drain_s
        self.draining = False

    @property
    def state(self) -> object | None:
        return getattr(getattr(self.config.app, "state", None), "blockspec", None)

    def drain(self) -> None:
        """Stops admitting while still listening (generation requests and /health get 503
        `shutting_down`), lets running requests finish for up to `drain_s` seconds, then ends the
        open ones (streams with a final chunk and [DONE]) and exits. Safe in a signal handler."""
        state = self.state
        if state is None:
            self.should_exit = True
            return
        self.draining = True
        state.begin_drain(self.drain_s)

    def handle_exit(self, sig: int, frame: object) -> None:
        # uvicorn would also re-raise the signal after a clean exit; the drain is the clean exit
        if self.draining or self.state is None:
            self.should_exit = self.force_exit = True
        else:
            self.drain()

    async def on_tick(self, counter: int) -> bool:
        if self.draining and not self.should_exit and self.state.drain_tick():
            self.should_exit = True  # everything answered: close the listener and exit
        return await super().on_tick(counter)


def serve_forever(app: object, sock: socket.socket, *, log_level: str = "info",
                  drain_s: float = 25.0, keep_alive_s: float = KEEP_ALIVE_S) -> None:
    """Serves until SIGTERM/SIGINT, then drains for up to `drain_s` seconds (see DrainingServer);
    idle keep-alive connections are closed after `keep_alive_s` seconds (see KEEP_ALIVE_S)."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=CLOSE_S, lifespan="on",
                            timeout_keep_alive=keep_alive_s)
    DrainingServer(config, drain_s).run(sockets=[sock])


class BackgroundServer:
    """uvicorn in a daemon thread on a loopback port; use as a context manager.

        with BackgroundServer(app) as server:
            OpenAI(base_url=server.url + "/v1", api_key="EMPTY")
    """

    def __init__(self, app: object, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 drain_s: float = 5.0, keep_alive_s: float = KEEP_ALIVE_S) -> None:
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=CLOSE_S, lifespan="on",
                                timeout_keep_alive=keep_alive_s)
        self.server = DrainingServer(config, drain_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="blockspec-http")

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the HTTP server thread exited during startup (see its log)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the HTTP server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def drain(self) -> None:
        """What SIGTERM does to `blockspec serve` (DrainingServer.drain); the thread ends after it."""
        self.server.drain()

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        if self.thread.is_alive():
            raise TimeoutError(f"the HTTP server did not stop within {timeout} s")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
