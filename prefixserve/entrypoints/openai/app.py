"""The FastAPI app: OpenAI routes over an EngineLoop, OpenAI-shaped errors, auth, metrics, and the
Prompt Cache schema routes (``schema_routes.py``) and tokenizer routes (``tokenizer_routes.py``).

Bodies are read and parsed by hand (size limit before parsing, strict UTF-8, then JSON, then the
model) so that every refusal is a 4xx naming the problem, never a 422 or a 500.

Under overload (``overload.py``) a request past the waiting queue's bounds, or one that would not start
by its deadline, is answered 429 with Retry-After: at arrival by ``ArrivalGate`` in this process (from
the engine's last published queue), else by the engine when it takes the request, or when it drops it
from the queue. A stream's status and headers go out with its first output (its first token, or its
end), so a streamed request dropped from the queue gets that 429 too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.engine.admission import QueueFull
from prefixserve.engine.gc_tuning import tune_gc
from prefixserve.engine.host_trim import IdleTrim, trim_when_idle
from prefixserve.engine.input_processor import check_context
from prefixserve.entrypoints.openai import format as fmt
from prefixserve.entrypoints.openai.anthropic_messages import COUNT_ROUTE, MESSAGES_ROUTE
from prefixserve.entrypoints.openai.anthropic_routes import add_anthropic_routes
from prefixserve.entrypoints.openai.cache_routes import add_cache_routes
from prefixserve.entrypoints.openai.engine_thread import EngineLoop, EngineStopped, StreamSink
from prefixserve.entrypoints.openai.metrics import ServerMetrics
from prefixserve.entrypoints.openai.model_routes import add_model_routes
from prefixserve.entrypoints.openai.overload import (
    ArrivalGate,
    OverloadSettings,
    StallWatch,
    deadline_error,
    dropped,
    queue_deadline,
    refusal,
    sse_response,
)
from prefixserve.entrypoints.openai.prepare import (
    Prepared,
    prepare_chat,
    prepare_completion,
    prompt_ids,
    response_body,
    stream_state,
    truncated,
)
from prefixserve.entrypoints.openai.protocol import APIError, engine_failure, param_of
from prefixserve.entrypoints.openai.requests import (
    MAX_BODY_BYTES,
    ServerState,
    authorize,
    read_json,
)
from prefixserve.entrypoints.openai.responses import ResponseStore, prepare_response
from prefixserve.entrypoints.openai.responses_request import renamed
from prefixserve.entrypoints.openai.responses_routes import RESPONSES_ROUTE, add_responses_routes
from prefixserve.entrypoints.openai.responses_stream import response_stream
from prefixserve.entrypoints.openai.schema_routes import add_schema_routes
from prefixserve.entrypoints.openai.tokenizer_routes import TOKENIZER_ROUTES, add_tokenizer_routes
from prefixserve.outputs import RequestOutput
from prefixserve.promptcache.pml import PMLError
from prefixserve.version import __version__

log = logging.getLogger(__name__)

# request.state keys (in the ASGI scope, read by _CountRequests when the response is written)
ROUTE_START = "ps_route_start"  # time.monotonic() when the route began (the queue deadline's origin)
FIRST_OUTPUT = "ps_first_output"  # when this process received a stream's first output
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    RESPONSES_ROUTE,
    MESSAGES_ROUTE,
    COUNT_ROUTE,
    "/v1/models",
    "/v1/schemas",
    "/health",
    "/metrics",
    *TOKENIZER_ROUTES,
)


def build_app(
    config: EngineConfig | None = None,
    *,
    engine: Engine | None = None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    engine_process: bool = False,
    overload: OverloadSettings | None = None,
    responses: ResponseStore | None = None,
) -> FastAPI:
    """Load the engine now (errors surface before binding); its thread starts with the app's lifespan.

    ``engine_process``: the engine runs in a child process (``engine_process.py``), not on a thread
    of this one; the app then holds only the tokenizer. ``overload``: the waiting queue's bounds,
    the queue deadline and the stream stall timeout (default: bounds sized from the engine, no
    deadline, 60 s). ``responses``: where /v1/responses keeps stored responses (default: 1,024)."""
    overload = overload or OverloadSettings()
    loop: EngineLoop
    if engine_process:
        if engine is not None:
            raise ValueError("engine_process takes a config, not an engine")
        from prefixserve.entrypoints.openai.engine_process import EngineProcess
        from prefixserve.model.loader import tokenizer_for

        config = config or EngineConfig()
        loop = EngineProcess(config, limits=overload.limits)
        tune_gc()  # this process too: every stream's chunks are young objects, and each pass stops the loop
        info = loop.info
        model, max_model_len, system_prompts = info["model"], info["max_model_len"], info["system_prompts"]
        tokenizer = tokenizer_for(config.model, progress=False)[1]
    else:
        engine = engine or Engine(config or EngineConfig(), progress=False)
        started = time.perf_counter()
        # now, not as stalls of the first requests of each size and batch
        if captured := engine.capture_graphs(progress=True):
            took = time.perf_counter() - started
            log.info("captured %d graphs in %.1f s before serving", captured, took)
        loop = EngineLoop(engine, limits=overload.limits)
        model, max_model_len, tokenizer = engine.model_name, engine.max_model_len, engine.tokenizer
        system_prompts = dict(engine.config.system_prompts)
    gate = ArrivalGate(loop)
    metrics = ServerMetrics(lambda: loop.snapshot, lambda: gate.counters)
    loop.observer = metrics
    stall_s = overload.stream_stall_timeout
    watch = None if stall_s is None else StallWatch(loop, stall_s, metrics.streams_stalled)
    state = ServerState(
        loop=loop,
        model=model,
        max_model_len=max_model_len,
        tokenizer=tokenizer,
        api_key=api_key,
        system_prompts=system_prompts,
        max_body_bytes=max_body_bytes,
        max_queue_delay=overload.max_queue_delay,
        stall_watch=watch,
        gate=gate,
        responses=ResponseStore() if responses is None else responses,
    )

    trim = IdleTrim()  # freed heap back to the OS when idle (engine/host_trim.py)

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
        try:
            yield
        finally:
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
    app.add_middleware(_CountRequests, metrics=metrics)
    _add_error_handlers(app)
    _add_routes(app, state, metrics)
    return app


class _CountRequests:
    """Pure ASGI (unlike BaseHTTPMiddleware it leaves streaming and disconnects alone)."""

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

        async def send_status(message: Message) -> None:
            nonlocal status, wrote
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not wrote:
                wrote = True
                self._timed(scope, status)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else "other"
            for parent in ("/v1/models", "/v1/schemas", RESPONSES_ROUTE):
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

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _error(APIError(500, f"internal error: {type(exc).__name__}"))


# ---- submitting and collecting -----------------------------------------------------------------


async def _tokenize(state: ServerState, prep: Prepared, text: str) -> list[int] | None:
    """A text prompt's token ids (``prompt_ids``), encoded in a worker thread (the tokenizer releases
    the GIL).

    Encoding on the engine thread stops every step for as long as it takes (~10 ms for an 8K-token
    prompt, ~35 ms for 16K): each arrival stalled all running streams. None leaves the text to the
    engine: a possible Prompt Cache prompt (``<prompt ...>``, parsed there), no tokenizer, or an error
    (the engine then reports it as it would).
    """
    try:
        return await asyncio.to_thread(prompt_ids, state, prep, text)
    except Exception:
        return None


def _length(tokens: list[int] | None) -> int | None:
    return None if tokens is None else len(tokens)


def _check_fits(state: ServerState, prep: Prepared, tokens: list[int]) -> None:
    """ValueError (a 400) for a prompt, or a max_tokens, that no context holds, as the engine's
    intake would refuse it: counted with the application's pinned prompt in front."""
    ids = state.engine_ids(tokens, prep.application)
    check_context(len(ids), prep.params.max_tokens, state.max_model_len)


async def _submit(
    state: ServerState,
    prep: Prepared,
    sink: asyncio.Queue[RequestOutput],
    deadline: float | None = None,
    started: float | None = None,
) -> list[str]:
    """Queue one engine request per prompt; on a refusal, abort the ones already queued. ``started``:
    when the route began (the "intake" stage ends as each is handed to the engine)."""
    ids: list[str] = []
    req, params, prompt_field = prep.req, prep.params, prep.prompt_field
    application = prep.application
    texts = [p if isinstance(p, str) else None for p in prep.prompts]
    try:
        for prompt in prep.prompts:  # ids, known for free: one that can never run is a 400, not a 429
            if not isinstance(prompt, str):
                _check_fits(state, prep, truncated(prep, prompt, state.max_model_len))
        if state.gate is not None:  # a request the gate refuses whatever its prompt is, before tokenizing
            state.gate.check(deadline)
        encoded = await asyncio.gather(*(_tokenize(state, prep, t) for t in texts if t is not None))
        encoded_iter = iter(encoded)
        for i, prompt in enumerate(prep.prompts):
            sub_id = f"{prep.rid}-{i}"
            text, tokens = (prompt, next(encoded_iter)) if isinstance(prompt, str) else (None, list(prompt))
            if tokens is not None:
                kept = truncated(prep, tokens, state.max_model_len)
                text, tokens = (text, tokens) if len(kept) == len(tokens) else (None, kept)  # text: all of it
            if text is not None and tokens is not None:
                _check_fits(state, prep, tokens)
            # refused here at once when the engine's last published queue says so (overload.py)
            arrival = None if state.gate is None else state.gate.admit(_length(tokens), deadline)
            await state.loop.add(
                sub_id,
                text,
                params,
                sink,
                prompt_token_ids=tokens,
                cache_salt=req.cache_salt,
                application=application,
                module_recompute=req.module_recompute,
                stream=req.stream,
                deadline=deadline,
                arrival=arrival,
                started=started,
            )
            ids.append(sub_id)
    except QueueFull as exc:  # the waiting queue is at a bound, or would not drain before the deadline
        for sub_id in ids:
            state.loop.abort(sub_id)
        raise refusal(exc) from None
    except PMLError as exc:  # a Prompt Cache prompt: unknown schema or module, bad argument, bad XML
        for sub_id in ids:
            state.loop.abort(sub_id)
        raise APIError(400, str(exc), param=prompt_field, code="invalid_pml") from None
    except ValueError as exc:
        for sub_id in ids:
            state.loop.abort(sub_id)
        param, code = param_of(str(exc), prompt_field)
        raise APIError(400, str(exc), param=param, code=code) from None
    except EngineStopped as exc:
        for sub_id in ids:
            state.loop.abort(sub_id)
        raise APIError(503, str(exc)) from None
    return ids


async def _collect(
    state: ServerState, request: Request, ids: list[str], sink: asyncio.Queue[RequestOutput]
) -> list[RequestOutput] | None:
    """Wait for every final output; None if the client left (its requests are aborted)."""
    finals: dict[str, RequestOutput] = {}
    try:
        while len(finals) < len(ids):
            try:
                out = await asyncio.wait_for(sink.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if out.finished:
                if dropped(out):  # waited past its deadline: the whole request is refused
                    raise deadline_error(state.loop)
                finals[out.request_id] = out
    finally:
        for sub_id in ids:
            if sub_id not in finals:
                state.loop.abort(sub_id)
    ordered = [finals[i] for i in ids]
    failure = engine_failure(ordered)
    if failure is not None:
        raise failure
    return ordered


async def _latest(sink: asyncio.Queue[RequestOutput]) -> dict[str, RequestOutput]:
    """Wait for outputs, then take all that are queued: outputs are cumulative, the newest per request
    is all that matters (a stream that fell behind catches up in one write)."""
    out = await sink.get()
    latest = {out.request_id: out}
    while not sink.empty():
        out = sink.get_nowait()
        latest[out.request_id] = out
    return latest


async def _first_outputs(
    state: ServerState, request: Request, ids: list[str], sink: asyncio.Queue[RequestOutput]
) -> dict[str, RequestOutput] | None:
    """A stream's first outputs (its first token, or its end), before anything is sent: a request
    dropped from the queue past its deadline is then a 429, and one the KV pool can never hold a
    400, not a 200 and an error event. None if the client left meanwhile (its requests are
    aborted)."""
    abort = True
    try:
        while True:
            try:
                latest = await asyncio.wait_for(_latest(sink), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if any(dropped(out) for out in latest.values()):
                raise deadline_error(state.loop)
            refused = engine_failure(out for out in latest.values() if out.error)
            if refused is not None:
                raise refused
            abort = False
            return latest
    finally:
        if abort:  # refused, or the client left: abort what may still run
            for sub_id in ids:
                state.loop.abort(sub_id)


async def _stream(
    state: ServerState,
    ids: list[str],
    sink: asyncio.Queue[RequestOutput],
    s: fmt.StreamState,
    first: dict[str, RequestOutput] | None = None,
) -> AsyncIterator[str]:
    """SSE body from the first outputs on; leaving early (client gone, cancelled) aborts what is
    still running.

    The events of one wake-up (several choices or prompts; the last delta, usage and ``[DONE]``) go
    out as one body write: each write costs a trip through the ASGI middleware and the HTTP protocol.
    """
    index = {sub_id: i for i, sub_id in enumerate(ids)}
    finals: dict[str, RequestOutput] = {}
    # a chat's role chunks go out with its first output: one write, which is the first token's
    head = s.opening()
    try:
        while len(finals) < len(ids):
            if isinstance(sink, StreamSink):
                sink.resume()  # what was taken is written: ready for the next outputs
            parts, head = head, []
            latest = first if first is not None else await _latest(sink)
            first = None
            for sub_id, out in latest.items():
                if dropped(out):  # another prompt of this request waited past its deadline
                    parts.append(s.error_event(deadline_error(state.loop).body()))
                    finals[sub_id] = out
                    yield "".join(parts)
                    return
                error = engine_failure([out])
                if error is not None:
                    parts.append(s.error_event(error.body()))
                    finals[sub_id] = out
                    yield "".join(parts)
                    return
                parts += s.update(index[sub_id], out)
                if out.finished:
                    finals[sub_id] = out
            if len(finals) == len(ids):
                parts += s.closing([finals[i] for i in ids])
            if parts:
                yield "".join(parts)
    finally:
        for sub_id in ids:
            if sub_id not in finals:
                state.loop.abort(sub_id)


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
    add_anthropic_routes(app, state, partial(_answer, state), _route_start)


def _add_status_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics) -> None:
    """/health, /version and /metrics (no API key: load balancers and Prometheus scrape them)."""

    @app.get("/health")
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


def _route_start(request: Request) -> float:
    """Now, noted on the request for the response middleware's path stages."""
    started = time.monotonic()
    setattr(request.state, ROUTE_START, started)
    return started


async def _answer(
    state: ServerState,
    request: Request,
    prep: Prepared,
    deadline: float | None,
    started: float | None = None,
    stream: Callable[[], fmt.StreamState] | None = None,
    body: Callable[[list[RequestOutput]], dict[str, Any]] | None = None,
) -> Response:
    """Queue a checked request and answer it: an SSE stream (from its first output on), or one JSON
    body when all is done. ``deadline``: when it must have started (``overload.queue_deadline``);
    ``started``: when the route began; ``stream`` and ``body``: another API's answer to the chat
    ``prep`` (/v1/responses, /v1/messages), in place of the chat's."""
    sink: asyncio.Queue[RequestOutput] = StreamSink() if prep.req.stream else asyncio.Queue()
    ids = await _submit(state, prep, sink, deadline, started)
    if isinstance(sink, StreamSink):
        try:
            first = await _first_outputs(state, request, ids, sink)
        except APIError:  # dropped for its deadline (429), or refused (400): ends the "to_client" stage
            setattr(request.state, FIRST_OUTPUT, sink.first_received)
            raise
        setattr(request.state, FIRST_OUTPUT, sink.first_received)
        if first is None:
            return Response(status_code=499)
        s = stream_state(state, prep) if stream is None else stream()
        return sse_response(_stream(state, ids, sink, s, first), ids, state.stall_watch)
    finals = await _collect(state, request, ids, sink)
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(response_body(state, prep, finals) if body is None else body(finals))


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        started = _route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        body = prepare_completion(state, await read_json(state, request))
        return await _answer(state, request, body, deadline, started)


def _add_chat_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        started = _route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        body = prepare_chat(state, await read_json(state, request))
        return await _answer(state, request, body, deadline, started)

    @app.post(RESPONSES_ROUTE)
    async def responses(request: Request) -> Response:
        started = _route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        data = await read_json(state, request)
        ready = partial(prepare_response, state, data, state.responses)  # auto: it renders several cuts
        auto = isinstance(data, dict) and data.get("truncation") == "auto"
        call = await asyncio.to_thread(ready) if auto else ready()
        try:
            stream = partial(response_stream, call)
            return await _answer(state, request, call.prep, deadline, started, stream, call.body)
        except APIError as exc:  # the chat's field names, as this API names them
            raise renamed(exc) from None
