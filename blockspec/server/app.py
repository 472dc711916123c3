"""The OpenAI-compatible HTTP API: a thin shell over the continuous-batching engine.

    app = create_app(pipeline)                       # builds and owns an Engine for the pipeline
    app = create_app(pipeline, engine=my_engine)     # or serves an engine the caller owns

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics. Requests are read and tokenised (request_input.py: the target's chat template),
decoded by the engine on token ids, and detokenised as their answers go out (jobs.py: stop
strings held back until they cannot match). Each choice of a request (`n`) is one engine handle:
a client that goes away cancels its handles, which frees their batch slots at the next step
boundary. What the routes share, and the drain, is `ServerState` (state.py).

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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.api import Pipeline
from blockspec.config import SpecConfig
from blockspec.engine import Engine, EngineConfig
from blockspec.engine.grammar import Grammars
from blockspec.errors import BlockspecError
from blockspec.server import errors
from blockspec.server.errors import APIError
from blockspec.server.jobs import generate
from blockspec.server.logprobs import TokenTexts
from blockspec.server.metrics import ServerMetrics
from blockspec.server.request_input import read_json
from blockspec.server.schemas import parse_chat, parse_completion, template_switches
from blockspec.server.state import DEFAULT_MAX_REQUEST_BYTES, ServerState
from blockspec.server.tools import detect_family

log = logging.getLogger("blockspec.server")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
DEFAULT_DRAIN_S = 25.0  # under the 30 s most supervisors wait after SIGTERM before SIGKILL
SAMPLING_RULE = "gumbel-coupled/1"  # how seeds map to tokens (dflash/sampling.py); part of the fingerprint


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
        body = await read_json(state, request)
        return await generate(state, request, parse_chat(body, state.switches))

    @app.post("/v1/completions")
    @_guarded
    async def completions(request: Request) -> Response:
        body = await read_json(state, request)
        return await generate(state, request, parse_completion(body))

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
