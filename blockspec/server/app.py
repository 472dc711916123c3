"""The OpenAI-compatible HTTP API: a thin shell over the continuous-batching engine.

    app = create_app(pipeline)                       # builds and owns an Engine for the pipeline
    app = create_app(pipeline, engine=my_engine)     # or serves an engine the caller owns

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics. Requests are tokenised here (chat template of the target), decoded by the engine on
token ids, and detokenised here (stop strings held back until they cannot match). Each request is
one engine handle: a client that goes away cancels its handle, which frees its batch slot at the
next step boundary.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
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
from blockspec.errors import BlockspecError, ContextLengthError
from blockspec.server import errors
from blockspec.server.errors import APIError
from blockspec.server.metrics import ServerMetrics
from blockspec.server.schemas import GenerationRequest, check_model, parse_chat, parse_completion, parse_json
from blockspec.server.sse import DONE, Shapes, event, usage
from blockspec.text import IncrementalDetokenizer, StopStrings, encode_prompt

log = logging.getLogger("blockspec.server")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


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


def create_app(
    pipeline: Pipeline,
    *,
    engine: Engine | None = None,
    engine_config: EngineConfig | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """An app serving `pipeline` (a loaded `blockspec.api.Pipeline`).

    engine: an Engine to serve (the caller stops it); None builds one from the pipeline with
    `engine_config` (an EngineConfig; default: the pipeline's block size and lookup), started and stopped
    with the app.
    """
    owns = engine is None
    if engine is None:
        config = engine_config or EngineConfig(SpecConfig(block_size=pipeline.block_size, lookup=pipeline.lookup))
        engine = Engine(pipeline.target, pipeline.drafter, config, tokenizer=pipeline.tokenizer)
    info = pipeline.target.info
    state = ServerState(
        engine=engine,
        tokenizer=pipeline.tokenizer,
        served_model_name=served_model_name or default_model_name(pipeline),
        context_length=int(info.max_position_embeddings),
        vocab_size=int(info.vocab_size),
        api_key=api_key or None,
        owns_engine=owns,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # RequestHandle.aevents parks one worker thread per waiting request; the default pool
        # (cpu + 4 threads) would make streams wait for each other, so size it to the engine.
        workers = state.engine.config.max_batch + state.engine.config.max_queue + 8
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="blockspec-events")
        asyncio.get_running_loop().set_default_executor(pool)
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
            pool.shutdown(wait=False, cancel_futures=True)

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
    async def metrics() -> Response:
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
    async def chat(request: Request) -> Response:
        req = parse_chat(parse_json(await request.body()))
        return await _generate(state, request, req)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_completion(parse_json(await request.body()))
        return await _generate(state, request, req)

    return app


def default_model_name(pipeline: Pipeline) -> str:
    """The target's zoo name or directory name."""
    source = str(getattr(pipeline, "target_source", "") or "").rstrip("/")
    return source.rsplit("/", 1)[-1] or "blockspec"


def _model_card(state: ServerState) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "blockspec",
            "max_model_len": state.context_length}


# ---- one generation request ------------------------------------------------------------------

@dataclass
class _Job:
    """A request admitted to the engine, with what is needed to turn its tokens into text."""

    req: GenerationRequest
    prompt_ids: list[int]
    params: SamplingParams
    stops: StopStrings
    handle: RequestHandle
    shapes: Shapes
    arrived: float
    metrics: ServerMetrics
    first_token_at: float | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.metrics.generation_started()

    def close(self) -> None:
        """Cancels the engine request (a no-op once it finished) and ends the accounting; idempotent.
        Synchronous on purpose: it runs inside cancelled tasks, where awaiting is not possible."""
        if not self.closed:
            self.closed = True
            self.handle.cancel()
            self.metrics.generation_ended()


class _EngineStream(StreamingResponse):
    """A streaming response that always releases its engine request, even when the client left
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


def _prompt_ids(state: ServerState, req: GenerationRequest) -> list[int]:
    try:
        if req.kind == "chat":
            return encode_prompt(state.tokenizer, req.messages, chat=True,
                                 chat_template_kwargs=req.chat_template_kwargs or None)
        if isinstance(req.prompt, str):
            return encode_prompt(state.tokenizer, req.prompt, chat=False)
    except BlockspecError as e:
        raise errors.bad_request(str(e), "messages" if req.kind == "chat" else "prompt") from None
    except TemplateError as e:  # a chat template may reject messages (e.g. roles must alternate)
        raise errors.bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    ids = list(req.prompt)
    if any(not 0 <= t < state.vocab_size for t in ids):
        raise errors.bad_request(f"prompt token ids must be in [0, {state.vocab_size})", "prompt", "invalid_value")
    return ids


def _sampling(state: ServerState, req: GenerationRequest, prompt_len: int) -> SamplingParams:
    room = state.context_length - prompt_len
    prompt_param = "messages" if req.kind == "chat" else "prompt"
    if room < 1:
        raise errors.bad_request(
            f"the prompt has {prompt_len} tokens but the model's context is {state.context_length} tokens "
            "(one more is needed for the answer); shorten the prompt", prompt_param, "context_length_exceeded")
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens > room:
        raise errors.bad_request(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of "
            f"{state.context_length} tokens; lower max_tokens to at most {room} or shorten the prompt",
            "max_tokens", "context_length_exceeded")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos)
    except BlockspecError as e:
        raise errors.from_blockspec(e) from None


def _admit(state: ServerState, req: GenerationRequest) -> _Job:
    """Validates, tokenises and submits; raises APIError (nothing is queued on failure)."""
    check_model(req, state.served_model_name)
    if state.draining:
        raise errors.shutting_down()
    arrived = time.perf_counter()
    prompt_ids = _prompt_ids(state, req)
    params = _sampling(state, req, len(prompt_ids))
    stops = StopStrings(state.tokenizer, params.stop)
    shapes = Shapes(req.kind, state.served_model_name)
    stop_check = stops.tokens_to_keep if params.stop else None
    try:
        handle = state.engine.submit(prompt_ids, params, request_id=shapes.id, stop_check=stop_check)
    except QueueFullError as e:
        raise errors.queue_full(str(e)) from None
    except ContextLengthError as e:
        raise errors.from_blockspec(e, "messages" if req.kind == "chat" else "prompt") from None
    except BlockspecError as e:
        raise errors.from_blockspec(e) from None
    return _Job(req, prompt_ids, params, stops, handle, shapes, arrived, state.metrics)


async def _generate(state: ServerState, request: Request, req: GenerationRequest) -> Response:
    job = _admit(state, req)
    if req.stream:
        return _EngineStream(job, _stream(state, job))
    return await _collect(state, request, job)


def _failure(ev: TokenEvent) -> APIError | None:
    """The client-facing error of a final event that did not end normally."""
    if ev.finish_reason == "error":
        return errors.internal(ev.error or "the engine failed on this request")
    if ev.finish_reason == "cancelled":
        return errors.shutting_down()
    return None


def _record(state: ServerState, job: _Job, ev: TokenEvent, n_tokens: int) -> dict:
    stats = ev.stats
    lengths = list(stats.acceptance_lengths) if stats is not None else []
    ttft = None if job.first_token_at is None else job.first_token_at - job.arrived
    state.metrics.generation_done(ev.finish_reason or "unknown", len(job.prompt_ids), n_tokens,
                                  time.perf_counter() - job.arrived, ttft, lengths)
    return usage(len(job.prompt_ids), n_tokens, stats)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _final_event(job: _Job, ids: list[int]) -> TokenEvent:
    async for ev in job.handle.aevents():
        if ev.token_ids:
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            ids.extend(ev.token_ids)
        if ev.finished:
            return ev
    raise RuntimeError("the engine ended a request without a final event")


async def _collect(state: ServerState, request: Request, job: _Job) -> Response:
    """Non-streamed answer; a client that disconnects while waiting cancels its request."""
    ids: list[int] = []
    waiter = asyncio.ensure_future(_final_event(job, ids))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            job.handle.cancel()
            waiter.cancel()
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        ev = waiter.result()
    finally:
        watcher.cancel()
        job.close()
    usage_obj = _record(state, job, ev, len(ids))
    failure = _failure(ev)
    if failure is not None:
        raise failure
    text = job.stops.visible_text(ids)
    return JSONResponse(job.shapes.full(text, ev.finish_reason, usage_obj))


async def _stream(state: ServerState, job: _Job) -> AsyncIterator[bytes]:
    """Server-sent events: chunks as tokens are committed, the finish reason, usage, [DONE].

    When the client disconnects, the server cancels this generator; `finally` then cancels the
    engine handle so the batch slot is freed at once instead of decoding for nobody.
    """
    detok = IncrementalDetokenizer(job.stops)
    shapes = job.shapes
    n_tokens = 0
    try:
        if job.req.kind == "chat":
            yield event(shapes.chunk("", role=True))
        async for ev in job.handle.aevents():
            if ev.token_ids:
                if job.first_token_at is None:
                    job.first_token_at = time.perf_counter()
                n_tokens += len(ev.token_ids)
                delta = detok.push(ev.token_ids)
                if delta:
                    yield event(shapes.chunk(delta))
            if not ev.finished:
                continue
            usage_obj = _record(state, job, ev, n_tokens)
            failure = _failure(ev)
            if failure is not None:
                yield event(failure.body())
                break
            tail = detok.push([], final=True)
            if tail:
                yield event(shapes.chunk(tail))
            yield event(shapes.chunk(None if job.req.kind == "chat" else "", ev.finish_reason))
            if job.req.include_usage:
                yield event(shapes.usage_chunk(usage_obj))
            break
        yield DONE
    except Exception as e:  # headers are out: report in-band, as OpenAI does, then end the stream
        log.exception("stream failed", exc_info=e)
        yield event(errors.internal(f"{type(e).__name__}: {e}").body())
        yield DONE
    finally:
        job.close()


# ---- errors and accounting -------------------------------------------------------------------

def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(errors.http_status_error(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(errors.bad_request(f"invalid request: {exc.errors()}").body(), status_code=400)

    async def unexpected(_request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(errors.internal(f"{type(exc).__name__}: {exc}").body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


class _CountRequests:
    """ASGI middleware counting answered requests by route and status (streaming-safe)."""

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
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
            self.metrics.request_done(route, status)
