"""OpenAI's Responses API routes: ``POST /v1/responses`` (background ones: ``responses_background.py``);
stored responses: ``GET`` and ``DELETE /v1/responses/{id}``, ``GET .../input_items``, and
``POST .../cancel`` for a background one.

What a response stores is in this process's ``ResponseStore`` (``protocols/responses/store.py``), so
the stored routes answer for this server's responses.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.openai.answering import answer, route_start, stream_events, submit
from prefixserve.entrypoints.openai.overload_http import queue_deadline, sse_response
from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_json
from prefixserve.entrypoints.openai.responses_background import FirstOutput
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.lists import page
from prefixserve.protocols.responses.prepare import RESPONSES_ROUTE, ResponseCall, prepare_response
from prefixserve.protocols.responses.request import renamed
from prefixserve.protocols.responses.store import StoredResponse
from prefixserve.protocols.responses.stream import response_stream

MAX_LIST = 100  # input items in one page


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    found = state.responses.get(response_id)
    if found is None:
        message = f"no stored response with id {response_id!r}"
        raise APIError(404, message, param="response_id", code="response_not_found")
    return found


async def _start_background(state: ServerState, call: ResponseCall, started: float) -> Response:
    """Queue a background response now (a refusal answers this request) and answer it ``queued``,
    or with ``stream`` its events; its stream runs in a task, whoever is still connected. No queue
    deadline: it is the work a client chose to wait for."""
    sink = FirstOutput()
    ids = await submit(state, call.prep, sink, None, started, progress=True)  # the first: in_progress
    s = response_stream(call)
    opening = s.events.queued_events()  # type: ignore[attr-defined]
    events = stream_events(state, ids, sink, s)
    run = state.background.start(call, sink, events, opening, lambda: [state.loop.abort(i) for i in ids])
    if call.req.stream:  # leaving it stops nothing: no request of its own to abort
        return sse_response(run.follow(), [], state.stall_watch)
    return JSONResponse(_stored(state, call.rid).body)


def _follow(state: ServerState, response_id: str, starting_after: int | None) -> Response:
    """A background response's events after ``starting_after`` (all of them without it), live."""
    if not _stored(state, response_id).body.get("background"):
        message = "only a background response can be streamed again"
        raise APIError(400, message, param="response_id", code="invalid_value")
    run = state.background.events(response_id)
    if run is None:
        message = f"the events of response {response_id!r} are no longer kept: get it without stream"
        raise APIError(400, message, param="stream", code="invalid_value")
    return sse_response(run.follow(-1 if starting_after is None else starting_after), [], state.stall_watch)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(RESPONSES_ROUTE)
    async def responses(request: Request) -> Response:
        started = route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        data = await read_json(state, request)
        ready = partial(prepare_response, state, data, state.responses)  # auto: it renders several cuts
        auto = isinstance(data, dict) and data.get("truncation") == "auto"
        call = await asyncio.to_thread(ready) if auto else ready()
        try:
            if call.req.background:
                return await _start_background(state, call, started)
            stream = partial(response_stream, call)
            return await answer(state, request, call.prep, deadline, started, stream, call.body)
        except APIError as exc:  # the chat's field names, as this API names them
            raise renamed(exc) from None

    @app.post(RESPONSES_ROUTE + "/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        """Stops a background response that is still running; one that has finished is answered as
        it is (cancelling twice is harmless)."""
        authorize(state, request)
        if not _stored(state, response_id).body.get("background"):
            message = "only a background response can be cancelled"
            raise APIError(400, message, param="response_id", code="invalid_value")
        await state.background.cancel(response_id)
        return JSONResponse(_stored(state, response_id).body)

    @app.get(RESPONSES_ROUTE + "/{response_id}")
    async def get_response(
        response_id: str, request: Request, stream: bool = False, starting_after: int | None = None
    ) -> Response:
        authorize(state, request)
        if stream:
            return _follow(state, response_id, starting_after)
        return JSONResponse(_stored(state, response_id).body)

    @app.delete(RESPONSES_ROUTE + "/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        authorize(state, request)
        _stored(state, response_id)
        await state.background.cancel(response_id)  # a running one stops first
        state.responses.delete(response_id)
        state.background.forget(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get(RESPONSES_ROUTE + "/{response_id}/input_items")
    async def input_items(
        response_id: str,
        request: Request,
        limit: int = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> Response:
        authorize(state, request)
        if not 1 <= limit <= MAX_LIST:
            raise APIError(400, f"limit must be in [1, {MAX_LIST}], got {limit}", param="limit")
        items = list(_stored(state, response_id).input_items)
        if order == "desc":
            items.reverse()
        return JSONResponse(page(items, after, limit, "input item in this response"))


__all__ = ["add_responses_routes"]
