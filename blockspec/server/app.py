"""The OpenAI-compatible HTTP API: a thin shell over the continuous-batching engine.

    app = create_app(pipeline)                       # builds and owns an Engine for the pipeline
    app = create_app(pipeline, engine=my_engine)     # or serves an engine the caller owns

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics. Requests are tokenised here (chat template of the target), decoded by the engine on
token ids, and detokenised here (stop strings held back until they cannot match). Each choice of
a request (`n`) is one engine handle: a client that goes away cancels its handles, which frees
their batch slots at the next step boundary.

The event loop only moves bytes: reading and parsing large bodies, rendering templates and
tokenising run on a small thread pool (`ServerState.prep`), engine events arrive on the loop
without parked threads (`RequestHandle.deliver_to`), and detokenising decodes a few tokens per
event. Every failure, even a bug, is answered as an OpenAI error on a connection that stays open.

Draining (SIGTERM/SIGINT, see launch.py): new generation requests get 503 `shutting_down`
while the listener stays open; running ones finish until the drain deadline, when each open
answer ends early (finish_reason "length", then `[DONE]` for streams).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.api import Pipeline
from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine import Engine, EngineConfig, QueueFullError, RequestHandle, TokenEvent
from blockspec.engine.grammar import Grammars, OutputFormat
from blockspec.errors import BlockspecError, ConfigError, ContextLengthError
from blockspec.server import errors
from blockspec.server.completions_prompt import check_ids
from blockspec.server.echo import echo_logprobs, echo_text, joined
from blockspec.server.errors import APIError
from blockspec.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from blockspec.server.metrics import ServerMetrics
from blockspec.server.schemas import (
    GenerationRequest,
    check_model,
    parse_chat,
    parse_completion,
    parse_json,
    template_switches,
)
from blockspec.server.sse import DONE, Shapes, column_sums, event, usage
from blockspec.server.structured import compile_error
from blockspec.server.tools import (ToolStream, detect_family, forced_format, keeps_special_tokens, parse_calls,
                                    render_prompt)
from blockspec.text import IncrementalDetokenizer, StopStrings, encode_prompt

log = logging.getLogger("blockspec.server")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 128K-token prompt is ~0.5 MB of text
DEFAULT_DRAIN_S = 25.0  # under the 30 s most supervisors wait after SIGTERM before SIGKILL
INLINE_BYTES = 64 * 1024  # smaller bodies are parsed on the loop (a thread hop costs more)
CUT_REASON = "length"  # what an answer cut by the drain deadline ends with: incomplete, as at max_tokens
_CUT = object()  # put into a job's inbox when the drain deadline passes
SAMPLING_RULE = "gumbel-coupled/1"  # how seeds map to tokens (dflash/sampling.py); part of the fingerprint


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
    jobs: set = field(default_factory=set)  # open generation requests (_Job)
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
                job.inbox.put_nowait(_CUT)
        return not self.jobs

    async def offload(self, fn: Callable, *args: object) -> object:
        """Runs fn(*args) on the prep pool, keeping the loop free."""
        if self.prep is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.prep, functools.partial(fn, *args))


def create_app(
    pipeline: Pipeline,
    *,
    engine: Engine | None = None,
    engine_config: EngineConfig | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """An app serving `pipeline` (a loaded `blockspec.api.Pipeline`).

    engine: an Engine to serve (the caller stops it); None builds one from the pipeline with
    `engine_config` (an EngineConfig; default: the pipeline's block size and lookup), started and stopped
    with the app. max_request_bytes: larger bodies are answered 413 unread.
    """
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1024:
        raise BlockspecError(f"max_request_bytes must be an integer >= 1024, got {max_request_bytes!r}")
    owns = engine is None
    if engine is None:
        config = engine_config or EngineConfig(SpecConfig(block_size=pipeline.block_size, lookup=pipeline.lookup,
                                                          tree_nodes=pipeline.tree_nodes))
        engine = Engine(pipeline.target, pipeline.drafter, config, tokenizer=pipeline.tokenizer)
    info = pipeline.target.info
    name = served_model_name or default_model_name(pipeline)
    state = ServerState(
        engine=engine,
        tokenizer=pipeline.tokenizer,
        served_model_name=name,
        context_length=int(info.max_position_embeddings),
        vocab_size=int(info.vocab_size),
        api_key=api_key or None,
        owns_engine=owns,
        max_request_bytes=max_request_bytes,
        fingerprint=fingerprint(pipeline),
        compute=pipeline.compute,
        switches=template_switches(getattr(pipeline.tokenizer, "chat_template", None)),
        max_token_bytes=longest_token_bytes(pipeline.tokenizer),
        texts=TokenTexts(pipeline.tokenizer),
        grammars=Grammars(pipeline.tokenizer, int(info.vocab_size), tuple(info.eos_token_ids)),
        tool_family=detect_family(getattr(pipeline.tokenizer, "chat_template", None), info.model_type),
        end_texts=tuple(pipeline.tokenizer.decode([i], skip_special_tokens=False) for i in info.eos_token_ids),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="blockspec-prep")
        state.engine.start()
        # Requests are taken once the engine has timed its steps (adaptive block size: a few
        # seconds on a CPU), so the first one does not wait for that.
        await asyncio.to_thread(state.engine.wait_ready)
        try:
            yield
        finally:
            state.draining = True
            if state.owns_engine:
                await asyncio.to_thread(state.engine.stop)
            state.prep.shutdown(wait=False, cancel_futures=True)

    async def check_key(request: Request) -> None:
        if state.api_key is None or request.url.path == "/health":
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise errors.unauthorized()

    app = FastAPI(title="blockspec", lifespan=lifespan, dependencies=[Depends(check_key)],
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.blockspec = state
    _install_error_handlers(app)
    app.add_middleware(_CountRequests, metrics=state.metrics)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    @_guarded
    async def metrics(request: Request) -> Response:
        text = state.metrics.render(state.engine.metrics)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != state.served_model_name:
            raise errors.model_not_found(model_id, state.served_model_name)
        return JSONResponse(_model_card(state))

    @app.post("/v1/chat/completions")
    @_guarded
    async def chat(request: Request) -> Response:
        body = await _read_json(state, request)
        return await _generate(state, request, parse_chat(body, state.switches))

    @app.post("/v1/completions")
    @_guarded
    async def completions(request: Request) -> Response:
        body = await _read_json(state, request)
        return await _generate(state, request, parse_completion(body))

    return app


def default_model_name(pipeline: Pipeline) -> str:
    """The target's zoo name or directory name."""
    source = str(getattr(pipeline, "target_source", "") or "").rstrip("/")
    return source.rsplit("/", 1)[-1] or "blockspec"


def fingerprint(pipeline: Pipeline) -> str:
    """`system_fingerprint`: what, besides the request and its seed, decides the sampled text (the
    target, its dtype, device and compute mode, the sampling rule). Not the drafter, block size
    or batch: those change the speed, never the tokens."""
    import blockspec

    target = pipeline.target
    parts = [getattr(blockspec, "__version__", "?"), str(getattr(pipeline, "target_source", "")),
             str(getattr(target, "dtype", "")), str(getattr(target, "device", "")), type(target).__name__,
             SAMPLING_RULE, pipeline.compute]
    return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def longest_token_bytes(tokenizer: object) -> int | None:
    """An upper bound of the UTF-8 bytes one token stands for (None when unknown): a text of B
    bytes has at least B / this many tokens, so a prompt far over the context is refused before
    the (slow) tokenisation."""
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:  # a normalizer may shrink text first
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        return max(len(token.encode("utf-8")) for token in vocab)
    except Exception:  # an unusual tokenizer: no early bound, only the exact count
        return None


def _model_card(state: ServerState) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "blockspec",
            "max_model_len": state.context_length, "compute": state.compute}


def _guarded(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Answers every failure of a route itself, as an OpenAI error: an exception that escaped to
    the framework would close the keep-alive connection (and would show Python internals)."""

    @functools.wraps(route)
    async def guarded(*args: object, **kwargs: object) -> Response:
        try:
            return await route(*args, **kwargs)
        except APIError as e:
            return _error_response(e)
        except Exception as e:
            reference = uuid.uuid4().hex[:12]
            log.exception("request failed (reference %s)", reference, exc_info=e)
            return _error_response(errors.internal(reference))

    return guarded


def _error_response(e: APIError, headers: dict | None = None) -> Response:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# ---- reading a request -----------------------------------------------------------------------

async def _read_json(state: ServerState, request: Request) -> dict:
    limit = state.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise errors.too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) <= INLINE_BYTES:
        return parse_json(raw)
    return await state.offload(parse_json, raw)


def _prompt_ids(state: ServerState, req: GenerationRequest) -> list[list[int]]:
    """Template rendering and tokenising (on the prep pool): the token ids of each prompt (one for
    chat); a 400 for what cannot be a prompt."""
    if req.kind == "completion":
        check_ids(req.prompts, state.vocab_size)
        return [_text_ids(state, p, "prompt" if len(req.prompts) == 1 else f"prompt[{i}]") if isinstance(p, str)
                else list(p) for i, p in enumerate(req.prompts)]
    _refuse_hopeless(state, sum(len((m.get("content") or "").encode("utf-8")) for m in req.messages), "messages")
    try:
        if req.tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in req.messages):
            return [render_prompt(state.tokenizer, req.messages, req.tools, state.tool_family,
                                  req.chat_template_kwargs)]
        return [encode_prompt(state.tokenizer, req.messages, chat=True,
                              chat_template_kwargs=req.chat_template_kwargs or None)]
    except BlockspecError as e:
        raise errors.bad_request(str(e), "messages") from None
    except TemplateError as e:  # a chat template may reject messages (e.g. roles must alternate)
        raise errors.bad_request(f"the chat template rejected the messages: {e}", "messages") from None


def _text_ids(state: ServerState, text: str, param: str) -> list[int]:
    _refuse_hopeless(state, len(text.encode("utf-8")), param)
    try:
        return encode_prompt(state.tokenizer, text, chat=False)
    except BlockspecError as e:
        raise errors.bad_request(str(e), param) from None


def _refuse_hopeless(state: ServerState, size: int, param: str) -> None:
    """A prompt whose text alone (`size` UTF-8 bytes) needs more tokens than the context holds
    (see longest_token_bytes)."""
    if state.max_token_bytes is None:
        return
    at_least = size // state.max_token_bytes
    if at_least >= state.context_length:
        raise errors.bad_request(
            f"the prompt has at least {at_least} tokens but the model's context is {state.context_length} "
            "tokens; shorten the prompt", param, "context_length_exceeded")


def _sampling(state: ServerState, req: GenerationRequest, prompt_len: int, seed: int | None) -> SamplingParams:
    room = state.context_length - prompt_len
    prompt_param = "messages" if req.kind == "chat" else "prompt"
    if room < 1 and req.max_tokens != 0:
        raise errors.bad_request(
            f"the prompt has {prompt_len} tokens but the model's context is {state.context_length} tokens "
            "(one more is needed for the answer); shorten the prompt", prompt_param, "context_length_exceeded")
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens > room:
        raise errors.bad_request(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of "
            f"{state.context_length} tokens; lower max_tokens to at most {room} or shorten the prompt",
            "max_tokens", "context_length_exceeded")
    # echo: the prompt's scores with logprobs; max_tokens 0 asks for nothing else (scoring alone)
    scored = req.echo and (req.logprobs or max_tokens == 0)
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos, logprobs=req.top_logprobs if req.logprobs else None,
                              prompt_logprobs=req.top_logprobs if scored else None, logit_bias=req.logit_bias)
    except BlockspecError as e:
        raise errors.from_blockspec(e) from None


def _check_bias(state: ServerState, req: GenerationRequest) -> None:
    outside = [t for t, _ in req.logit_bias if t >= state.vocab_size]
    if outside:
        raise errors.bad_request(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {state.vocab_size})",
                                 "logit_bias", "invalid_value")


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request sampled with `seed`: choice 0 uses the seed itself
    (so n=1 and the first of n>1 agree), the others a splitmix64 scramble of (seed, index)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1  # 63 bits


# ---- one generation request ------------------------------------------------------------------

@dataclass
class _Choice:
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
class _Job:
    """A request admitted to the engine, with what is needed to turn its tokens into text."""

    state: ServerState
    req: GenerationRequest
    prompts: list[list[int]]  # token ids of each prompt
    params: SamplingParams
    stops: StopStrings
    shapes: Shapes
    arrived: float
    choices: list[_Choice]
    inbox: asyncio.Queue  # (choice, TokenEvent) from the engine, or _CUT
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

    async def next(self) -> tuple[_Choice, TokenEvent] | None:
        """The next engine event of any choice; None when the drain deadline cut the request."""
        item = await self.inbox.get()
        if item is _CUT:
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

    def logprobs_of(self, choice: _Choice, ids: list[int], entries: list, offset: int = 0) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.kind == "chat":
            return chat_logprobs(self.state.texts, ids, entries, self.req.top_logprobs)
        return completion_logprobs(self.state.texts, ids, entries, self.req.top_logprobs, offset)

    def echo(self, choice: _Choice) -> tuple[str, dict | None]:
        """The echoed prompt of a choice: its text and, with logprobs, its part of the logprobs."""
        text = echo_text(self.state.tokenizer, self.req.prompts[choice.prompt])
        if not self.req.logprobs:
            return text, None
        ids = self.prompts[choice.prompt]
        scores = choice.prompt_logprobs or [None] * len(ids)
        return text, echo_logprobs(self.state.texts, ids, scores, self.req.top_logprobs)


class _EngineStream(StreamingResponse):
    """A streaming response that always releases its engine requests, even when the client left
    before the body generator ever started (then the generator's own `finally` never runs)."""

    def __init__(self, job: _Job, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


async def _generate(state: ServerState, request: Request, req: GenerationRequest) -> Response:
    check_model(req, state.served_model_name)
    if state.draining:
        raise errors.shutting_down()
    arrived = time.perf_counter()
    _check_bias(state, req)
    prompts = await state.offload(_prompt_ids, state, req)
    # No seed: the standard rule (dflash/verify.py), which accepts more proposals but whose text
    # no seed reproduces; a client that wants to replay an answer sends a seed.
    seed = req.seed
    params = [_sampling(state, req, len(ids), seed) for ids in prompts]
    fmt = _output_format(state, req)
    if fmt is not None:  # compiled once per schema (cached), on the prep pool
        await state.offload(_compile, state, fmt)
    if state.draining:  # the drain began while the prompt was being tokenised
        raise errors.shutting_down()
    job = _admit(state, req, prompts, params, seed, arrived, fmt)
    if req.stream:
        return _EngineStream(job, _stream(job))
    return await _collect(request, job)


def _output_format(state: ServerState, req: GenerationRequest) -> OutputFormat | None:
    """What the answer is constrained to: a forced tool call's grammar, the structured output
    asked for, or None."""
    if req.tools is not None and req.tools.active and req.tools.forced:
        return forced_format(req.tools, state.tool_family)
    return req.output_format


def _compile(state: ServerState, fmt: OutputFormat) -> None:
    try:
        state.grammars.compile(fmt)
    except ConfigError as e:
        raise compile_error(e, fmt) from None


def _admit(state: ServerState, req: GenerationRequest, prompts: list[list[int]], params: list[SamplingParams],
           seed: int | None, arrived: float, fmt: OutputFormat | None = None) -> _Job:
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
    choices = [_Choice(i, h, IncrementalDetokenizer(shown), prompt=i // req.n,
                       tools=ToolStream(state.tool_family, req.tools.tools, state.end_texts) if tools else None)
               for i, h in enumerate(handles)]
    job = _Job(state, req, prompts, params[0], stops, shapes, arrived, choices, inbox)
    if state.cut:  # admitted in the instant the deadline passed: cut it at once
        inbox.put_nowait(_CUT)
    return job


def _failure(job: _Job) -> APIError | None:
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


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _all_events(job: _Job) -> None:
    while job.open_choices:
        if await job.next() is None:
            return


async def _collect(request: Request, job: _Job) -> Response:
    """Non-streamed answer; a client that disconnects while waiting cancels its request."""
    waiter = asyncio.ensure_future(_all_events(job))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
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
    failure = _failure(job)
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


async def _stream(job: _Job) -> AsyncIterator[bytes]:
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
                        for piece in _closing(job, c, CUT_REASON):
                            yield piece
                break
            c, ev = got
            if ev.finished and ev.finish_reason in ("error", "cancelled"):
                job.record()
                yield event(_failure(job).body())
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
                for piece in _call_chunks(job, c, calls):
                    yield piece
            if ev.finished:
                for piece in _closing(job, c, ev.finish_reason):
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


def _closing(job: _Job, c: _Choice, reason: str | None) -> list[bytes]:
    """The held-back text of a choice and its chunk with the finish reason."""
    out = []
    tail = c.detok.push([], final=True)
    calls = []
    if c.tools is not None:
        tail, calls = c.tools.push(tail, final=True)
    if tail:
        out.append(event(job.shapes.chunk(tail, index=c.index)))
        c.text_sent += len(tail)
    out.extend(_call_chunks(job, c, calls))
    if c.tools is not None and c.tools.calls and reason == "stop":
        reason = "tool_calls"
    out.append(event(job.shapes.chunk(None if job.req.kind == "chat" else "", reason or CUT_REASON, index=c.index)))
    return out


def _call_chunks(job: _Job, c: _Choice, calls: list) -> list[bytes]:
    """A `tool_calls` delta per completed call: its index among the choice's calls, id, name and
    whole arguments."""
    out = []
    first = len(c.tools.calls) - len(calls) if c.tools is not None else 0
    for k, call in enumerate(calls):
        chunk = job.shapes.chunk(None, index=c.index)
        chunk["choices"][0]["delta"]["tool_calls"] = [call.as_openai(first + k)]
        out.append(event(chunk))
    return out


# ---- errors and accounting -------------------------------------------------------------------

def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: APIError) -> Response:
        return _error_response(exc)

    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(errors.http_status_error(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return _error_response(errors.bad_request(f"invalid request: {exc.errors()!s:.300}"))

    async def unexpected(_request: Request, exc: Exception) -> Response:
        reference = uuid.uuid4().hex[:12]
        log.exception("unhandled error (reference %s)", reference, exc_info=exc)
        return _error_response(errors.internal(reference))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


class _CountRequests:
    """ASGI middleware counting answered requests by route and status (streaming-safe), and
    closing the connection after a 413 instead of reading the rest of an oversized body."""

    def __init__(self, app: object, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 413:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
            self.metrics.request_done(route, status)
