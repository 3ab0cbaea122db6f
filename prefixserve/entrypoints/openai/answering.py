"""Answering one request: queue its engine work, then stream its outputs or collect its answer.

Shared by every generating route (completions, chats, responses, messages): another API's answer to
the chat it runs as comes in as ``stream`` and ``body`` makers. Under overload (``serving/overload.py``;
its answers in ``overload_http.py``) a request is refused 429 at arrival by ``ArrivalGate``, by the
engine when it takes the request, or when it drops it from the queue; a stream's status and headers
go out with its first output, so a streamed request dropped from the queue gets that 429 too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.input_processor import check_context
from prefixserve.entrypoints.openai.overload_http import deadline_error, refusal, sse_response
from prefixserve.entrypoints.openai.requests import ServerState, request_tenant
from prefixserve.outputs import RequestOutput
from prefixserve.promptcache.pml import PMLError, is_pml_prompt
from prefixserve.protocols.errors import APIError, as_sent, engine_failure, param_of
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.prepare import (
    Prepared,
    prompt_ids,
    response_body,
    stream_state,
    truncated,
)
from prefixserve.protocols.openai.salt_scope import pin_counts, public_tokens
from prefixserve.serving.admission import QueueFull
from prefixserve.serving.engine_thread import EngineStopped, StreamSink
from prefixserve.serving.overload import dropped
from prefixserve.serving.request_log import log_request

# request.state keys (in the ASGI scope, read by the app's middleware when the response is written)
ROUTE_START = "ps_route_start"  # time.monotonic() when the route began (the queue deadline's origin)
FIRST_OUTPUT = "ps_first_output"  # when this process received a stream's first output
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


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


def _encodes(prep: Prepared) -> bool:
    """Whether the request's public part or cache breakpoints need text encoded (a salted chat
    under the after-system scope, an application's pinned prompt, Anthropic's breakpoints)."""
    salted = getattr(prep.req, "cache_salt", None) is not None
    return bool(prep.pin_texts) or (salted and prep.salt_scope == "after-system")


def _prefix_counts(
    state: ServerState, prep: Prepared, tokens: list[int] | None
) -> tuple[int, list[tuple[int, float]] | None]:
    """A prompt's public tokens under its salt's scope (``prepare.public_tokens``) and its cache
    breakpoints' token counts (``prepare.pin_counts``), on a worker thread (they encode text); none for
    a text the engine tokenizes itself (a Prompt Cache document)."""
    if tokens is None:
        return 0, None
    ids = state.engine_ids(tokens, prep.application)
    return public_tokens(state, prep, ids), (pin_counts(state, prep, ids) if prep.pin_texts else None)


def public_modules(state: ServerState, prep: Prepared) -> int:
    """A salted Prompt Cache prompt's public rows under the after-system scope: all it has (the context
    holds every module row; the engine counts them), as its schema's text is declared by whoever
    registered it; none under "prompt". Its arguments and text stay salted whatever this says."""
    if getattr(prep.req, "cache_salt", None) is None or prep.salt_scope != "after-system":
        return 0
    return state.max_model_len


def _length(tokens: list[int] | None) -> int | None:
    return None if tokens is None else len(tokens)


def _check_fits(state: ServerState, prep: Prepared, tokens: list[int]) -> None:
    """ValueError (a 400) for a prompt, or a max_tokens, that no context holds, as the engine's
    intake would refuse it: counted with the application's pinned prompt in front."""
    ids = state.engine_ids(tokens, prep.application)
    check_context(len(ids), prep.params.max_tokens, state.max_model_len, generates=prep.pooling is None)


async def submit(
    state: ServerState,
    prep: Prepared,
    sink: asyncio.Queue[RequestOutput],
    deadline: float | None = None,
    started: float | None = None,
    progress: bool | None = None,
    tenant: str | None = None,
) -> list[str]:
    """Queue one engine request per prompt; on a refusal, abort the ones already queued. ``started``:
    when the route began (the "intake" stage ends as each is handed to the engine); ``progress``:
    outputs every step, not only the last (default: where the request streams); ``tenant``: the
    request's (``request_tenant``), else the body's ``user``."""
    ids: list[str] = []
    req, params, prompt_field = prep.req, prep.params, prep.prompt_field
    application = prep.application
    texts = [p if isinstance(p, str) else None for p in prep.prompts]
    try:
        for prompt in prep.prompts:  # ids, known for free: one that can never run is a 400, not a 429
            if not isinstance(prompt, str):
                _check_fits(state, prep, truncated(prep, prompt, state.max_model_len))
        # the gate's wait estimate counts the whole queue ahead: a request with a priority of its own
        # (which may pass those waiting) is left to the engine's books, which know the order, and so
        # is every request once priorities are in the queue (``QueueState.priorities``)
        gate_deadline = deadline if req.priority == 0 else None
        if state.gate is not None:  # a request the gate refuses whatever its prompt is, before tokenizing
            state.gate.check(gate_deadline)
        encoded = await asyncio.gather(*(_tokenize(state, prep, t) for t in texts if t is not None))
        encoded_iter = iter(encoded)
        # the engine's ids: unique even where clients name two requests alike (``request_id``)
        base = prep.rid if getattr(req, "request_id", None) is None else f"{prep.rid}-{uuid.uuid4().hex[:8]}"
        for i, prompt in enumerate(prep.prompts):
            sub_id = f"{base}-{i}"
            text, tokens = (prompt, next(encoded_iter)) if isinstance(prompt, str) else (None, list(prompt))
            if tokens is not None:
                kept = truncated(prep, tokens, state.max_model_len)
                text, tokens = (text, tokens) if len(kept) == len(tokens) else (None, kept)  # text: all of it
            if text is not None and tokens is not None:
                _check_fits(state, prep, tokens)
            public, pins = (0, None)
            if tokens is not None and _encodes(prep):  # text to encode: off the event loop
                public, pins = await asyncio.to_thread(_prefix_counts, state, prep, tokens)
            elif text is not None and tokens is None and _encodes(prep) and is_pml_prompt(text):
                public = public_modules(state, prep)  # a Prompt Cache prompt: its schema's modules
            # refused here at once when the engine's last published queue says so (serving/overload.py)
            arrival = None if state.gate is None else state.gate.admit(_length(tokens), gate_deadline)
            await state.loop.add(
                sub_id,
                text,
                None if prep.pooling is not None else params,
                sink,
                pooling=prep.pooling,
                prompt_token_ids=tokens,
                cache_salt=req.cache_salt,
                public_tokens=public,
                tenant=tenant or getattr(req, "user", None),  # OpenAI's user, Anthropic's metadata.user_id
                cache_pins=pins,
                application=application,
                module_recompute=req.module_recompute,
                priority=req.priority,
                stream=req.stream if progress is None else progress,
                deadline=deadline,
                arrival=arrival,
                started=started,
            )
            ids.append(sub_id)
            if state.log_requests:
                log_request(sub_id, text, tokens, prep.pooling or params, state.max_log_len)
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
        raise as_sent(APIError(400, str(exc), param=param, code=code), prep.req) from None
    except EngineStopped as exc:
        for sub_id in ids:
            state.loop.abort(sub_id)
        raise APIError(503, str(exc)) from None
    return ids


async def collect(
    state: ServerState,
    gone: Callable[[], Awaitable[bool]],
    ids: list[str],
    sink: asyncio.Queue[RequestOutput],
) -> list[RequestOutput] | None:
    """Wait for every final output; None if the client left (``gone()``, asked twice a second: its
    requests are aborted, as they are when this is cancelled)."""
    finals: dict[str, RequestOutput] = {}
    try:
        while len(finals) < len(ids):
            try:
                out = await asyncio.wait_for(sink.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await gone():
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


async def first_outputs(
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


async def stream_events(
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


def route_start(request: Request) -> float:
    """Now, noted on the request for the response middleware's path stages."""
    started = time.monotonic()
    setattr(request.state, ROUTE_START, started)
    return started


async def answer(
    state: ServerState,
    request: Request,
    prep: Prepared,
    deadline: float | None,
    started: float | None = None,
    stream: Callable[[], fmt.StreamState] | None = None,
    body: Callable[[list[RequestOutput]], dict[str, Any]] | None = None,
) -> Response:
    """Queue a checked request and answer it: an SSE stream (from its first output on), or one JSON
    body when all is done. ``deadline``: when it must have started (``overload_http.queue_deadline``);
    ``started``: when the route began; ``stream`` and ``body``: another API's answer to the chat
    ``prep`` (/v1/responses, /v1/messages), in place of the chat's."""
    sink: asyncio.Queue[RequestOutput] = StreamSink() if prep.req.stream else asyncio.Queue()
    ids = await submit(state, prep, sink, deadline, started, tenant=request_tenant(request, prep.req))
    if isinstance(sink, StreamSink):
        try:
            first = await first_outputs(state, request, ids, sink)
        except APIError:  # dropped for its deadline (429), or refused (400): ends the "to_client" stage
            setattr(request.state, FIRST_OUTPUT, sink.first_received)
            raise
        setattr(request.state, FIRST_OUTPUT, sink.first_received)
        if first is None:
            return Response(status_code=499)
        s = stream_state(state, prep) if stream is None else stream()
        response = sse_response(stream_events(state, ids, sink, s, first), ids, state.stall_watch)
        return _with_pin_notice(response, first.values())
    finals = await collect(state, request.is_disconnected, ids, sink)
    if finals is None:
        return Response(status_code=499)
    answer_body = response_body(state, prep, finals) if body is None else body(finals)
    return _with_pin_notice(JSONResponse(answer_body), finals)


PIN_NOTICE = "prefixserve-cache-control"  # the header saying a request's cache breakpoints were refused


def _with_pin_notice(response: Response, outputs: Iterable[RequestOutput]) -> Response:
    """The answer, with ``PIN_NOTICE`` where the pinned-block budget refused a cache breakpoint (the
    request was answered; its prefixes stay in the cache as any other, by LRU)."""
    if any(o.cache_pins_refused for o in outputs):
        response.headers[PIN_NOTICE] = "not-honoured; pinned-block budget full (--cache-control-fraction)"
    return response
