"""What the server's routes share (`ServerState`), and its drain: new requests turned away, open
answers cut at the deadline."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from blockspec.engine import Engine
from blockspec.engine.grammar import Grammars
from blockspec.server.logprobs import TokenTexts
from blockspec.server.metrics import ServerMetrics

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 128K-token prompt is ~0.5 MB of text
CUT = object()  # put into a job's inbox when the drain deadline passes


@dataclass
class ServerState:
    """Everything the routes share. `draining` turns new generation requests away with 503."""

    engine: Engine
    tokenizer: object
    served_model_name: str
    context_length: int
    vocab_size: int
    api_key: str | None = None
    owns_engine: bool = True
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    fingerprint: str | None = None
    compute: str = "exact"  # the target's compute mode (`blockspec.load`'s compute), shown in /v1/models
    switches: frozenset[str] = frozenset()  # chat template variables clients may set
    max_token_bytes: int | None = None  # the longest token's UTF-8 bytes (None: unknown)
    texts: TokenTexts | None = None
    prep: ThreadPoolExecutor | None = None  # template rendering, tokenising, large JSON bodies
    jobs: set = field(default_factory=set)  # open generation requests (Job)
    drain_deadline: float | None = None  # time.monotonic() at which open answers are cut
    cut: bool = False  # the drain deadline has passed
    grammars: Grammars | None = None  # structured outputs and forced tool calls (engine/grammar.py)
    tool_family: str = "generic"  # how the chat template shows tools and writes calls (server/tools/)
    end_texts: tuple[str, ...] = ()  # the end-of-turn tokens' text (ends a call in text that keeps them)

    def begin_drain(self, grace_s: float) -> None:
        """Stops admitting; open requests may run for `grace_s` more seconds (any thread)."""
        if not self.draining or self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + max(0.0, grace_s)
        self.draining = True

    def drain_tick(self) -> bool:
        """Called on the loop while draining: cuts open answers once the deadline has passed;
        True once nothing is open any more."""
        if self.draining and not self.cut and self.drain_deadline is not None \
                and time.monotonic() >= self.drain_deadline:
            self.cut = True
            for job in list(self.jobs):
                job.inbox.put_nowait(CUT)
        return not self.jobs

    async def offload(self, fn: Callable, *args: object) -> object:
        """Runs fn(*args) on the prep pool, keeping the loop free."""
        if self.prep is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.prep, functools.partial(fn, *args))
