"""The FastAPI app: OpenAI routes over an EngineLoop, OpenAI-shaped errors, auth, metrics, and the
Prompt Cache schema routes (``schema_routes.py``) and tokenizer routes (``tokenizer_routes.py``).

Bodies are read and parsed by hand (size limit before parsing, strict UTF-8, then JSON, then the
model) so that every refusal is a 4xx naming the problem, never a 422 or a 500.

Each generating route checks its body into a ``Prepared`` request and hands it to ``answering.py``
(queueing, overload refusals, streaming, collecting): completions and chats here, OpenAI's
Responses API in ``responses_routes.py`` and Anthropic's Messages API in ``anthropic_routes.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.engine.gc_tuning import tune_gc
from prefixserve.entrypoints.generation_config import sampling_defaults
from prefixserve.entrypoints.openai.answering import FIRST_OUTPUT, ROUTE_START, answer, route_start
from prefixserve.entrypoints.openai.anthropic_routes import add_anthropic_routes
from prefixserve.entrypoints.openai.batch_routes import BatchService, add_batch_routes
from prefixserve.entrypoints.openai.batch_settings import BatchSettings
from prefixserve.entrypoints.openai.beam_answers import answer_beams
from prefixserve.entrypoints.openai.cache_routes import add_cache_routes
from prefixserve.entrypoints.openai.cors import allow_origins
from prefixserve.entrypoints.openai.embedding_routes import add_embedding_routes
from prefixserve.entrypoints.openai.message_batches import add_message_batch_routes
from prefixserve.entrypoints.openai.metrics import ServerMetrics
from prefixserve.entrypoints.openai.model_routes import add_model_routes
from prefixserve.entrypoints.openai.overload_http import queue_deadline
from prefixserve.entrypoints.openai.requests import (
    MAX_BODY_BYTES,
    REQUEST_ID_HEADER,
    ServerState,
    authorize,
    read_named_json,
)
from prefixserve.entrypoints.openai.responses_background import BackgroundRuns
from prefixserve.entrypoints.openai.responses_routes import add_responses_routes
from prefixserve.entrypoints.openai.schema_routes import add_schema_routes
from prefixserve.entrypoints.openai.tokenizer_routes import add_tokenizer_routes
from prefixserve.protocols.anthropic.message_batches import MESSAGE_BATCHES_ROUTE
from prefixserve.protocols.anthropic.prepare import COUNT_ROUTE, MESSAGES_ROUTE
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.lists import BATCHES_ROUTE, FILES_ROUTE
from prefixserve.protocols.openai.prepare import prepare_chat, prepare_completion
from prefixserve.protocols.pooling.embeddings import EMBEDDINGS_ROUTE
from prefixserve.protocols.pooling.scoring import RERANK_ROUTES, SCORE_ROUTES
from prefixserve.protocols.responses.prepare import RESPONSES_ROUTE
from prefixserve.protocols.responses.store import ResponseStore
from prefixserve.protocols.vllm.tokenizer import TOKENIZER_ROUTES
from prefixserve.serving.engine_thread import EngineLoop
from prefixserve.serving.host_trim import IdleTrim, trim_when_idle
from prefixserve.serving.overload import ArrivalGate, OverloadSettings, StallWatch
from prefixserve.serving.stats_log import log_stats as stats_log
from prefixserve.version import __version__

log = logging.getLogger(__name__)

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    RESPONSES_ROUTE,
    MESSAGES_ROUTE,
    COUNT_ROUTE,
    "/v1/models",
    "/v1/schemas",
    FILES_ROUTE,
    BATCHES_ROUTE,
    MESSAGE_BATCHES_ROUTE,
    EMBEDDINGS_ROUTE,
    *SCORE_ROUTES,
    *RERANK_ROUTES,
    "/health",
    "/ping",
    "/metrics",
    *TOKENIZER_ROUTES,
)


def build_app(
    config: EngineConfig | None = None,
    *,
    engine: Engine | None = None,
    api_key: str | Sequence[str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    engine_process: bool = False,
    overload: OverloadSettings | None = None,
    responses: ResponseStore | None = None,
    allowed_origins: list[str] | None = None,
    batches: BatchSettings | None = None,
    log_stats: bool = False,
    log_requests: bool = False,
    max_log_len: int | None = None,
) -> FastAPI:
    """Load the engine now (errors surface before binding); its thread starts with the app's lifespan.

    ``engine_process``: the engine runs in a child process (``serving/engine_process.py``), not on a thread
    of this one; the app then holds only the tokenizer. ``overload``: the waiting queue's bounds,
    the queue deadline and the stream stall timeout (default: bounds sized from the engine, no
    deadline, 60 s). ``responses``: where /v1/responses keeps stored responses (default: 1,024).
    ``allowed_origins``: the browser origins that may call it (``cors.py``; None: none).
    ``batches``: where /v1/files and /v1/batches keep files and batches (default: a temporary
    folder removed at exit). ``log_stats``: a log line of the engine's throughput and load every
    10 s while it works (``serving/stats_log.py``; ``serve`` turns it on unless --disable-log-stats).
    ``log_requests``: a log line per engine request, its prompt cut at ``max_log_len``
    (``serving/request_log.py``)."""
    overload = overload or OverloadSettings()
    loop: EngineLoop
    if engine_process:
        if engine is not None:
            raise ValueError("engine_process takes a config, not an engine")
        from prefixserve.model.loader import tokenizer_for
        from prefixserve.serving.engine_process import EngineProcess

        config = config or EngineConfig()
        loop = EngineProcess(config, limits=overload.limits)
        tune_gc()  # this process too: every stream's chunks are young objects, and each pass stops the loop
        info = loop.info
        model, max_model_len, system_prompts = info["model"], info["max_model_len"], info["system_prompts"]
        hidden_size = info["hidden_size"]
        eos_ids = frozenset(info["eos_ids"])
        tokenizer = tokenizer_for(config.model, progress=False, chat_template=config.chat_template)[1]
    else:
        engine = engine or Engine(config or EngineConfig(), progress=False)
        started = time.perf_counter()
        # now, not as stalls of the first requests of each size and batch
        if captured := engine.capture_graphs(progress=True, seal=True):
            took = time.perf_counter() - started
            log.info("captured %d graphs in %.1f s before serving", captured, took)
        loop = EngineLoop(engine, limits=overload.limits)
        model, max_model_len, tokenizer = engine.model_name, engine.max_model_len, engine.tokenizer
        hidden_size = engine.model_config.hidden_size
        eos_ids = frozenset(engine.eos_ids)
        system_prompts = dict(engine.config.system_prompts)
        config = engine.config
    defaults = sampling_defaults(config)
    gate = ArrivalGate(loop)
    metrics = ServerMetrics(lambda: loop.snapshot, lambda: gate.counters)
    loop.observer = metrics
    stall_s = overload.stream_stall_timeout
    watch = None if stall_s is None else StallWatch(loop, stall_s, metrics.streams_stalled)
    state = ServerState(
        loop=loop,
        model=model,
        aliases=config.served_model_name[1:],
        reasoning_parser=config.reasoning_parser,
        trust_request_chat_template=config.trust_request_chat_template,
        cache_salt_scope=config.cache_salt_scope,
        max_model_len=max_model_len,
        hidden_size=hidden_size,
        sampling_defaults=defaults,
        eos_ids=eos_ids,
        tokenizer=tokenizer,
        api_key=api_key if api_key is None or isinstance(api_key, str) else tuple(api_key),
        system_prompts=system_prompts,
        max_body_bytes=max_body_bytes,
        max_queue_delay=overload.max_queue_delay,
        stall_watch=watch,
        gate=gate,
        responses=ResponseStore() if responses is None else responses,
        background=BackgroundRuns(),
        log_requests=log_requests,
        max_log_len=max_log_len,
    )

    batch_service = BatchService(batches or BatchSettings(), state, config.max_num_seqs)
    trim = IdleTrim()  # freed heap back to the OS when idle (serving/host_trim.py)

    def requests_seen() -> float:
        return loop.snapshot.get("requests_total", 0.0)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        trimmer = asyncio.create_task(
            trim_when_idle(lambda: loop.in_flight, requests_seen, trim, observe=metrics.idle_trim.observe)
        )
        lag = asyncio.create_task(metrics.watch_loop_lag())
        unwatch_gc = metrics.watch_gc()
        stats = asyncio.create_task(stats_log(lambda: loop.snapshot)) if log_stats else None
        batch_service.start()
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            state.background.cancel_all()
            await batch_service.stop()
            unwatch_gc()
            trimmer.cancel()
            lag.cancel()
            await asyncio.get_running_loop().run_in_executor(None, loop.stop)

    app = FastAPI(title="prefixserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.engine_loop = loop
    app.state.arrival_gate = gate
    app.state.metrics = metrics
    app.state.host_trim = trim
    app.state.batch_service = batch_service
    app.add_middleware(_Failures)  # innermost: a failure's 500 passes the counting and CORS layers
    app.add_middleware(_CountRequests, metrics=metrics)
    allow_origins(app, allowed_origins)  # outermost: a preflight is answered before anything counts it
    _add_error_handlers(app)
    _add_routes(app, state, metrics)
    add_batch_routes(app, state, batch_service)
    add_message_batch_routes(app, state, batch_service)
    return app


class _Failures:
    """A route's unhandled exception as a 500 in OpenAI's shape, answered inside the other layers
    (Starlette's own handler answers outside them: no X-Request-Id, no CORS headers, counted as
    nothing). A response already started can only be cut: the exception goes on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def noting(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting)
        except Exception as exc:
            if started:
                raise
            await _internal_error(exc)(scope, receive, send)


class _CountRequests:
    """Counts requests by route and status, times the path stages a response ends, and echoes the
    client's X-Request-Id. Pure ASGI (unlike BaseHTTPMiddleware it leaves streaming and disconnects
    alone)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        wrote = False
        scope.setdefault("state", {})  # request.state's dict, shared with the route below
        named = next((v for k, v in scope.get("headers", ()) if k == REQUEST_ID_HEADER.encode()), None)

        async def send_status(message: Message) -> None:
            nonlocal status, wrote
            if message["type"] == "http.response.start":
                status = message["status"]
                if named is not None:  # the client's name for its request, echoed (vLLM's header)
                    message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER.encode(), named)]
            await send(message)
            if message["type"] == "http.response.body" and not wrote:
                wrote = True
                self._timed(scope, status)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else "other"
            parents = (
                "/v1/models",
                "/v1/schemas",
                RESPONSES_ROUTE,
                FILES_ROUTE,
                BATCHES_ROUTE,
                MESSAGE_BATCHES_ROUTE,
            )
            for parent in parents:
                if path.startswith(parent + "/"):
                    route = parent
            self.metrics.http_requests.labels(route, str(status)).inc()

    def _timed(self, scope: Scope, status: int) -> None:
        """A response's first body bytes are written: the stages that end there (``metrics.PATH_STAGES``)."""
        now = time.monotonic()
        state = scope.get("state") or {}
        received = state.get(FIRST_OUTPUT)
        if received is not None:
            self.metrics.path("to_client", now - received)
        started = state.get(ROUTE_START)
        if status == 429 and started is not None:
            self.metrics.path("refusal", now - started)


def _error(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    if exc.headers:
        headers = {**exc.headers, **(headers or {})}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _internal_error(exc: Exception) -> JSONResponse:
    """A bug's answer: logged with its traceback, answered as a 500 naming only its type."""
    log.exception("unhandled error", exc_info=exc)
    return _error(APIError(500, f"internal error: {type(exc).__name__}"))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _error(
            APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in err["loc"] if p != "body")
        return _error(APIError(400, f"invalid value for '{where}': {err['msg']}", param=where or None))

    @app.exception_handler(Exception)  # one raised outside ``_Failures`` (in a middleware)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _internal_error(exc)


# ---- routes ------------------------------------------------------------------------------------
def _add_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics) -> None:
    _add_status_routes(app, state, metrics)
    add_model_routes(app, state)
    _add_completion_routes(app, state)
    _add_chat_routes(app, state)
    add_schema_routes(app, state)
    add_tokenizer_routes(app, state)
    add_cache_routes(app, state)
    add_responses_routes(app, state)
    add_anthropic_routes(app, state)
    add_embedding_routes(app, state)


def _add_status_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics) -> None:
    """/health (and /ping), /version and /metrics (no API key: load balancers and Prometheus scrape
    them)."""

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's, for SageMaker's health checks
    async def health() -> Response:
        if not state.loop.alive:
            return _error(APIError(503, "the engine is not running"))
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        started = route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        body = prepare_completion(state, await read_named_json(state, request))
        if body.req.use_beam_search:
            return await answer_beams(state, request, body, deadline, started)
        return await answer(state, request, body, deadline, started)


def _add_chat_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        started = route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        body = prepare_chat(state, await read_named_json(state, request))
        if body.req.use_beam_search:
            return await answer_beams(state, request, body, deadline, started)
        return await answer(state, request, body, deadline, started)
