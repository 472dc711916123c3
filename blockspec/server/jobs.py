"""One generation request in the engine: its choices' handles (`Job`), and its answer, whole
(`collect`) or as server-sent events (`stream`); a client that leaves cancels its handles."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from blockspec.config import SamplingParams
from blockspec.engine import QueueFullError, RequestHandle, TokenEvent
from blockspec.engine.grammar import OutputFormat
from blockspec.errors import BlockspecError, ConfigError, ContextLengthError
from blockspec.server import errors
from blockspec.server.echo import echo_logprobs, echo_text, joined
from blockspec.server.errors import APIError
from blockspec.server.logprobs import chat_logprobs, completion_logprobs
from blockspec.server.request_input import check_bias, choice_seed, prompt_ids, sampling_params
from blockspec.server.schemas import GenerationRequest, check_model
from blockspec.server.sse import DONE, Shapes, column_sums, event, usage
from blockspec.server.state import CUT, ServerState
from blockspec.server.structured import compile_error
from blockspec.server.tools import ToolStream, forced_format, keeps_special_tokens, parse_calls
from blockspec.text import IncrementalDetokenizer, StopStrings

log = logging.getLogger("blockspec.server")

CUT_REASON = "length"  # what an answer cut by the drain deadline ends with: incomplete, as at max_tokens


@dataclass
class Choice:
    """One of the completions of a request (prompt i, sample j is `index` i * n + j): an engine
    handle and what its tokens became."""

    index: int
    handle: RequestHandle
    detok: IncrementalDetokenizer
    prompt: int = 0  # which of the request's prompts
    prompt_logprobs: list | None = None  # echo with logprobs: the prompt's scores (first None)
    echoed: bool = False  # the echoed prompt has been streamed
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text_sent: int = 0  # characters streamed so far (completion logprobs' text offsets)
    final: TokenEvent | None = None
    tools: ToolStream | None = None  # splits tool calls from the content (a request with tools)


@dataclass
class Job:
    """A request admitted to the engine, with what is needed to turn its tokens into text."""

    state: ServerState
    req: GenerationRequest
    prompts: list[list[int]]  # token ids of each prompt
    params: SamplingParams
    stops: StopStrings
    shapes: Shapes
    arrived: float
    choices: list[Choice]
    inbox: asyncio.Queue  # (choice, TokenEvent) from the engine, or CUT
    first_token_at: float | None = None
    closed: bool = False
    cut: bool = False

    def __post_init__(self) -> None:
        self.state.metrics.generation_started()
        self.state.jobs.add(self)

    def __hash__(self) -> int:
        return id(self)

    def close(self) -> None:
        """Cancels the engine requests (a no-op once they finished) and ends the accounting;
        idempotent. Synchronous on purpose: it runs inside cancelled tasks, where awaiting is not possible."""
        if not self.closed:
            self.closed = True
            for c in self.choices:
                c.handle.cancel()
            self.state.metrics.generation_ended()
            self.state.jobs.discard(self)

    @property
    def open_choices(self) -> int:
        return sum(c.final is None for c in self.choices)

    async def next(self) -> tuple[Choice, TokenEvent] | None:
        """The next engine event of any choice; None when the drain deadline cut the request."""
        item = await self.inbox.get()
        if item is CUT:
            self.cut = True
            return None
        choice_index, ev = item
        choice = self.choices[choice_index]
        if ev.prompt_logprobs is not None:
            choice.prompt_logprobs = ev.prompt_logprobs
        if ev.token_ids:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            choice.ids.extend(ev.token_ids)
            if ev.logprobs:
                choice.logprobs.extend(ev.logprobs)
        if ev.finished:
            choice.final = ev
        return choice, ev

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def completion_tokens(self) -> int:
        """Generated tokens; with echo also each choice's echoed prompt, as OpenAI bills it."""
        echoed = sum(len(self.prompts[c.prompt]) for c in self.choices) if self.req.echo else 0
        return sum(len(c.ids) for c in self.choices) + echoed

    def usage(self) -> dict:
        return usage(self.prompt_tokens(), self.completion_tokens(),
                     [c.final.stats for c in self.choices if c.final is not None])

    def record(self) -> dict:
        reasons = [c.final.finish_reason if c.final is not None else CUT_REASON for c in self.choices]
        stats = [c.final.stats for c in self.choices if c.final is not None and c.final.stats is not None]
        lengths = [n for s in stats for n in s.acceptance_lengths]
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrived
        self.state.metrics.generation_done(reasons[0] or "unknown", self.prompt_tokens(), self.completion_tokens(),
                                           time.perf_counter() - self.arrived, ttft, lengths,
                                           accepted_by_depth=column_sums([s.accepted_by_position for s in stats]),
                                           accepted_by_rank=column_sums([s.accepted_by_rank for s in stats]),
                                           tree_steps=sum(s.tree_steps for s in stats))
        return self.usage()

    def logprobs_of(self, choice: Choice, ids: list[int], entries: list, offset: int = 0) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.kind == "chat":
            return chat_logprobs(self.state.texts, ids, entries, self.req.top_logprobs)
        return completion_logprobs(self.state.texts, ids, entries, self.req.top_logprobs, offset)

    def echo(self, choice: Choice) -> tuple[str, dict | None]:
        """The echoed prompt of a choice: its text and, with logprobs, its part of the logprobs."""
        text = echo_text(self.state.tokenizer, self.req.prompts[choice.prompt])
        if not self.req.logprobs:
            return text, None
        ids = self.prompts[choice.prompt]
        scores = choice.prompt_logprobs or [None] * len(ids)
        return text, echo_logprobs(self.state.texts, ids, scores, self.req.top_logprobs)


class EngineStream(StreamingResponse):
    """A streaming response that always releases its engine requests, even when the client left
    before the body generator ever started (then the generator's own `finally` never runs)."""

    def __init__(self, job: Job, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


async def generate(state: ServerState, request: Request, req: GenerationRequest) -> Response:
    check_model(req, state.served_model_name)
    if state.draining:
        raise errors.shutting_down()
    arrived = time.perf_counter()
    check_bias(state, req)
    prompts = await state.offload(prompt_ids, state, req)
    # No seed: the standard rule (dflash/verify.py), which accepts more proposals but whose text
    # no seed reproduces; a client that wants to replay an answer sends a seed.
    seed = req.seed
    params = [sampling_params(state, req, len(ids), seed) for ids in prompts]
    fmt = output_format(state, req)
    if fmt is not None:  # compiled once per schema (cached), on the prep pool
        await state.offload(compile_format, state, fmt)
    if state.draining:  # the drain began while the prompt was being tokenised
        raise errors.shutting_down()
    job = admit(state, req, prompts, params, seed, arrived, fmt)
    if req.stream:
        return EngineStream(job, stream(job))
    return await collect(request, job)


def output_format(state: ServerState, req: GenerationRequest) -> OutputFormat | None:
    """What the answer is constrained to: a forced tool call's grammar, the structured output
    asked for, or None."""
    if req.tools is not None and req.tools.active and req.tools.forced:
        return forced_format(req.tools, state.tool_family)
    return req.output_format


def compile_format(state: ServerState, fmt: OutputFormat) -> None:
    try:
        state.grammars.compile(fmt)
    except ConfigError as e:
        raise compile_error(e, fmt) from None


def admit(state: ServerState, req: GenerationRequest, prompts: list[list[int]], params: list[SamplingParams],
           seed: int | None, arrived: float, fmt: OutputFormat | None = None) -> Job:
    """Submits the request's choices, n per prompt (prompt i, sample j is choice i * n + j, with
    the seed of sample j: a prompt sent in a batch gets the answer it gets alone), each with a
    matcher of `fmt` when given; raises APIError with nothing left queued on failure."""
    stops = StopStrings(state.tokenizer, req.stop)
    tools = req.tools is not None and req.tools.active
    extra = {"sampling_rule": params[0].rule_for(constrained=fmt is not None)}
    if tools:
        extra["tool_call_format"] = state.tool_family
    shapes = Shapes(req.kind, state.served_model_name, fingerprint=state.fingerprint, seed=seed, extra=extra)
    inbox: asyncio.Queue = asyncio.Queue()
    handles: list[RequestHandle] = []
    try:
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            for j in range(req.n):
                index = i * req.n + j
                handle = state.engine.submit(ids, sp.with_(seed=None if seed is None else choice_seed(seed, j)),
                                             request_id=f"{shapes.id}-{index}",
                                             stop_check=stops.watch() if sp.stop else None,
                                             constraint=state.grammars.matcher(fmt) if fmt is not None else None)
                handle.deliver_to(inbox, key=index)
                handles.append(handle)
    except BaseException as e:
        for h in handles:
            h.cancel()
        if isinstance(e, QueueFullError):
            raise errors.queue_full(str(e)) from None
        if isinstance(e, ContextLengthError):
            raise errors.from_blockspec(e, "messages" if req.kind == "chat" else "prompt") from None
        if isinstance(e, BlockspecError):
            raise errors.from_blockspec(e) from None
        raise
    # the text the tool parser reads keeps the special tokens where a family's markers are some
    shown = StopStrings(state.tokenizer, req.stop, keep_special=True) \
        if tools and keeps_special_tokens(state.tool_family) else stops
    choices = [Choice(i, h, IncrementalDetokenizer(shown), prompt=i // req.n,
                       tools=ToolStream(state.tool_family, req.tools.tools, state.end_texts) if tools else None)
               for i, h in enumerate(handles)]
    job = Job(state, req, prompts, params[0], stops, shapes, arrived, choices, inbox)
    if state.cut:  # admitted in the instant the deadline passed: cut it at once
        inbox.put_nowait(CUT)
    return job


def failure_of(job: Job) -> APIError | None:
    """The client-facing error of choices that did not end normally."""
    for c in job.choices:
        ev = c.final
        if ev is not None and ev.finish_reason == "error":
            reference = uuid.uuid4().hex[:12]
            log.error("engine failure (reference %s): %s", reference, ev.error)
            return errors.internal(reference)
        if ev is not None and ev.finish_reason == "cancelled":
            return errors.shutting_down()
    return None


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def all_events(job: Job) -> None:
    while job.open_choices:
        if await job.next() is None:
            return


async def collect(request: Request, job: Job) -> Response:
    """Non-streamed answer; a client that disconnects while waiting cancels its request."""
    waiter = asyncio.ensure_future(all_events(job))
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            waiter.cancel()
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        waiter.result()
    finally:
        watcher.cancel()
        job.close()
    usage_obj = job.record()
    failure = failure_of(job)
    if failure is not None:
        raise failure
    choices = []
    for c in job.choices:
        text = c.detok.push(c.ids, final=True)
        reason = c.final.finish_reason if c.final else CUT_REASON
        calls = []
        if c.tools is not None:
            text, calls = parse_calls(c.tools.family, text, job.req.tools.tools, job.state.end_texts)
            reason = "tool_calls" if calls and reason == "stop" else reason
        if job.req.echo:
            prefix, prefix_lp = job.echo(c)
            lp = job.logprobs_of(c, c.ids, c.logprobs, len(prefix))
            text, lp = prefix + text, None if prefix_lp is None else joined(prefix_lp, lp)
        else:
            lp = job.logprobs_of(c, c.ids, c.logprobs)
        choice = job.shapes.choice(c.index, text, reason, lp)
        if calls:
            choice["message"]["tool_calls"] = [call.as_openai() for call in calls]
        choices.append(choice)
    return JSONResponse(job.shapes.full(choices, usage_obj))


async def stream(job: Job) -> AsyncIterator[bytes]:
    """Server-sent events: chunks as tokens are committed, each choice's finish reason, usage, [DONE].

    When the client disconnects, the server cancels this generator; `finally` then cancels the
    engine handles so the batch slots are freed at once instead of decoding for nobody.
    """
    shapes = job.shapes
    chat = job.req.kind == "chat"
    try:
        if chat:
            for c in job.choices:
                yield event(shapes.chunk("", role=True, index=c.index))
        while job.open_choices:
            got = await job.next()
            if got is None:  # the drain deadline: end every open choice now
                for c in job.choices:
                    if c.final is None:
                        for piece in closing(job, c, CUT_REASON):
                            yield piece
                break
            c, ev = got
            if ev.finished and ev.finish_reason in ("error", "cancelled"):
                job.record()
                yield event(failure_of(job).body())
                yield DONE
                return
            if job.req.echo and not c.echoed:  # the prompt (and its scores: the first event's) come first
                c.echoed = True
                prefix, prefix_lp = job.echo(c)
                yield event(shapes.chunk(prefix, index=c.index, logprobs=prefix_lp))
                c.text_sent = len(prefix)
            if ev.token_ids:
                delta = c.detok.push(ev.token_ids)
                lp = job.logprobs_of(c, ev.token_ids, ev.logprobs or [], c.text_sent)
                calls = []
                if c.tools is not None:
                    delta, calls = c.tools.push(delta)
                if delta or lp is not None:
                    yield event(shapes.chunk(delta, index=c.index, logprobs=lp))
                    c.text_sent += len(delta)
                for piece in call_chunks(job, c, calls):
                    yield piece
            if ev.finished:
                for piece in closing(job, c, ev.finish_reason):
                    yield piece
        usage_obj = job.record()
        if job.req.include_usage:
            yield event(shapes.usage_chunk(usage_obj))
        yield DONE
    except Exception as e:  # headers are out: report in-band, as OpenAI does, then end the stream
        reference = uuid.uuid4().hex[:12]
        log.exception("stream failed (reference %s)", reference, exc_info=e)
        yield event(errors.internal(reference).body())
        yield DONE
    finally:
        job.close()


def closing(job: Job, c: Choice, reason: str | None) -> list[bytes]:
    """The held-back text of a choice and its chunk with the finish reason."""
    out = []
    tail = c.detok.push([], final=True)
    calls = []
    if c.tools is not None:
        tail, calls = c.tools.push(tail, final=True)
    if tail:
        out.append(event(job.shapes.chunk(tail, index=c.index)))
        c.text_sent += len(tail)
    out.extend(call_chunks(job, c, calls))
    if c.tools is not None and c.tools.calls and reason == "stop":
        reason = "tool_calls"
    out.append(event(job.shapes.chunk(None if job.req.kind == "chat" else "", reason or CUT_REASON, index=c.index)))
    return out


def call_chunks(job: Job, c: Choice, calls: list) -> list[bytes]:
    """A `tool_calls` delta per completed call: its index among the choice's calls, id, name and
    whole arguments."""
    out = []
    first = len(c.tools.calls) - len(calls) if c.tools is not None else 0
    for k, call in enumerate(calls):
        chunk = job.shapes.chunk(None, index=c.index)
        chunk["choices"][0]["delta"]["tool_calls"] = [call.as_openai(first + k)]
        out.append(event(chunk))
    return out
