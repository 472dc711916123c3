"""A request as the engine sees it: token ids in, token events out (see engine.py)."""

from __future__ import annotations

import asyncio
import operator
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import torch

from blockspec.config import SamplingParams
from blockspec.dflash.results import GenerationResult, RequestStats, TokenLogprob
from blockspec.dflash.constraint import TokenConstraint
from blockspec.errors import ConfigError, ContextLengthError
from blockspec.targets.base import TargetInfo

# Given the generated ids so far, the number to keep when a stop string occurred, else None.
StopCheck = Callable[[list[int]], int | None]
# Hears a request's newly committed ids, on the decoding thread.
OnTokens = Callable[[list[int]], None]


def check_prompt(info: TargetInfo, prompt: list[int], params: SamplingParams) -> list[int]:
    """The prompt as Python ints; raises ConfigError for a prompt that is not token ids of the
    target's vocabulary (or a logit_bias outside it), and ContextLengthError when prompt +
    max_new_tokens exceeds the target's context."""
    if len(prompt) < 1:
        raise ConfigError("the prompt is empty; give at least one token")
    ids = []
    for t in prompt:
        try:
            if isinstance(t, (bool, str, bytes)):
                raise TypeError
            ids.append(operator.index(t))  # ints of numpy and torch too, never a float or a string
        except TypeError:
            raise ConfigError("a prompt must be a list of int token ids (tokenize text first); "
                              f"got {type(t).__name__} {t!r:.40}") from None
    prompt = ids
    limit = info.max_position_embeddings
    if len(prompt) + params.max_new_tokens > limit:
        raise ContextLengthError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"target's context of {limit} tokens; shorten the prompt or lower max_new_tokens "
            f"to at most {max(0, limit - len(prompt))}"
        )
    if any(not 0 <= t < info.vocab_size for t in prompt):
        raise ConfigError(f"prompt token ids must be in [0, {info.vocab_size}); got one outside")
    outside = [t for t, _ in params.logit_bias if t >= info.vocab_size]
    if outside:
        raise ConfigError(f"logit_bias token ids must be in [0, {info.vocab_size}); got {outside[0]}")
    return prompt


@dataclass(frozen=True)
class TokenEvent:
    """Newly committed ids of one request; the last event of a request has finished=True.
    With SamplingParams.logprobs set, `logprobs` holds one entry per id of `token_ids`. With
    SamplingParams.prompt_logprobs set, the first event (token_ids empty) carries
    `prompt_logprobs`: one entry per prompt token, the first None (engine/scoring.py)."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error"
    stats: RequestStats | None
    error: str | None = None
    # The final event of a request decoded with capture_layer_ids: target features [n, L*H].
    features: torch.Tensor | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Request:
    """Engine-side state of one request (the handle is the caller's side).

    The engine thread hands events over with `emit`: into `events` for threads that block on
    them, or straight onto an asyncio loop once a coroutine listens (`RequestHandle.aevents`),
    so no worker thread is parked per waiting request.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_check: StopCheck | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    events: queue.Queue = field(default_factory=queue.Queue)
    on_tokens: OnTokens | None = None
    constraint: TokenConstraint | None = None  # the grammar its output must match (engine/grammar.py)
    _listener: tuple[asyncio.AbstractEventLoop, asyncio.Queue, object] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: TokenEvent) -> None:
        """Delivers an event (any thread)."""
        with self._lock:
            listener = self._listener
            if listener is None:
                self.events.put(event)
                return
        loop, inbox, key = listener
        item = event if key is None else (key, event)
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def listen(self, inbox: asyncio.Queue, key: object = None) -> None:
        """From now on every event (those not yet taken first) goes into `inbox`, an asyncio
        queue of the running loop: as is, or as (key, event) when a key is given."""
        loop = asyncio.get_running_loop()
        with self._lock:
            while True:
                try:
                    event = self.events.get_nowait()
                except queue.Empty:
                    break
                inbox.put_nowait(event if key is None else (key, event))
            self._listener = (loop, inbox, key)


class RequestHandle:
    """The caller's view of a submitted request: events, cancel, result."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self.request_id = request.request_id
        self._tokens: list[int] = []
        self._final: TokenEvent | None = None
        self._lock = threading.Lock()

    def _next(self, timeout: float | None) -> TokenEvent:
        try:
            event = self._request.events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no event within {timeout} s") from None
        with self._lock:
            self._tokens.extend(event.token_ids)
            if event.finished:
                self._final = event
        return event

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Blocks for each event until the final one; `timeout` bounds each wait."""
        while self._final is None:
            event = self._next(timeout)
            yield event
            if event.finished:
                return

    async def aevents(self) -> AsyncIterator[TokenEvent]:
        """The same events for asyncio code (delivered onto the loop; never blocks it). Use either
        this or `events`/`result` for one handle, not both."""
        inbox: asyncio.Queue = asyncio.Queue()
        self._request.listen(inbox)
        while self._final is None:
            event = await inbox.get()
            with self._lock:
                self._tokens.extend(event.token_ids)
                if event.finished:
                    self._final = event
            yield event
            if event.finished:
                return

    def deliver_to(self, inbox: asyncio.Queue, key: object) -> None:
        """Sends every event of this request into `inbox` (an asyncio queue of the running loop) as
        (key, event), so one coroutine can wait on several requests at once; the handle itself
        then records nothing (`events`, `result` and `aevents` are not for such a handle)."""
        self._request.listen(inbox, key)

    def cancel(self) -> None:
        """Asks the engine to drop the request at the next step boundary."""
        self._request.cancelled.set()

    @property
    def done(self) -> bool:
        return self._final is not None

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Waits for the end; returns all generated ids, the finish reason and statistics.

        Raises RuntimeError when the request failed (finish_reason "error").
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._final is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._next(left)
        final = self._final
        if final.finish_reason == "error":
            raise RuntimeError(f"request {self.request_id} failed: {final.error}")
        return GenerationResult(list(self._tokens), final.finish_reason or "stop", final.stats or RequestStats(),
                                final.features)
