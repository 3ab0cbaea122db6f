"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

The message runs through the answering path every generating route takes (``answering.py``:
queueing, deadlines, streaming, aborts on disconnect); every refusal is answered in Anthropic's
error shape.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.openai.answering import answer, route_start
from prefixserve.entrypoints.openai.overload_http import queue_deadline
from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_json
from prefixserve.protocols.anthropic.prepare import (
    COUNT_ROUTE,
    MESSAGES_ROUTE,
    count_tokens,
    error_body,
    prepare_message,
)
from prefixserve.protocols.anthropic.stream import message_stream
from prefixserve.protocols.errors import APIError

log = logging.getLogger(__name__)


def anthropic_error(exc: APIError) -> JSONResponse:
    """An error in Anthropic's shape, its message led by the field it is about (as Anthropic's
    ``messages.0.content: ...``)."""
    message = f"{exc.param}: {exc.message}" if exc.param else exc.message
    return JSONResponse(error_body(exc.status, message), status_code=exc.status, headers=exc.headers)


def _failed(exc: Exception) -> JSONResponse:
    log.exception("a messages request failed", exc_info=exc)
    return anthropic_error(APIError(500, f"internal error: {type(exc).__name__}"))


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(MESSAGES_ROUTE)
    async def messages(request: Request) -> Response:
        started = route_start(request)
        try:
            authorize(state, request)
            deadline = queue_deadline(request, state.max_queue_delay, started)
            call = prepare_message(state, await read_json(state, request))
            stream = partial(message_stream, call)
            return await answer(state, request, call.prep, deadline, started, stream, call.body)
        except APIError as exc:
            return anthropic_error(exc)
        except Exception as exc:  # still Anthropic's shape: its clients read no other
            return _failed(exc)

    @app.post(COUNT_ROUTE)
    async def count(request: Request) -> Response:
        try:
            authorize(state, request)
            data: Any = await read_json(state, request)
            return JSONResponse(await asyncio.to_thread(count_tokens, state, data))
        except APIError as exc:
            return anthropic_error(exc)
        except Exception as exc:  # still Anthropic's shape: its clients read no other
            return _failed(exc)


__all__ = ["add_anthropic_routes"]
