"""Overload in HTTP: what ``serving/overload.py`` and the engine decide, as the server's answers.

* a request's queue deadline from the ``X-Max-Queue-Delay`` header (``queue_deadline``; a bad one is
  a 400 naming the header);
* ``QueueFull`` (from ``serving.overload.ArrivalGate`` or the engine) and a request dropped from the
  queue for its deadline become 429 ``rate_limit_error`` with a ``Retry-After`` header (``refusal``,
  ``deadline_error``);
* the SSE response that notes when its current write began (``WatchedStream``), so that
  ``serving.overload.StallWatch`` can abort the requests of a stream whose client stopped reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

from prefixserve.protocols.errors import APIError
from prefixserve.serving.admission import QueueFull
from prefixserve.serving.engine_thread import EngineLoop
from prefixserve.serving.overload import StallWatch, deadline_at, queue_retry_after

QUEUE_DELAY_HEADER = "X-Max-Queue-Delay"


def queue_deadline(
    request: Request, max_queue_delay: float | None, arrival: float | None = None
) -> float | None:
    """The ``time.monotonic()`` by which this request must have started: ``arrival`` (default now: the
    route's start) plus the smaller of the server's ``max_queue_delay`` and the request's
    ``X-Max-Queue-Delay`` header; None for neither."""
    raw = request.headers.get(QUEUE_DELAY_HEADER)
    try:
        return deadline_at(raw, max_queue_delay, arrival)
    except ValueError:
        message = f"header {QUEUE_DELAY_HEADER} must be a number of seconds > 0, got {(raw or '')[:40]!r}"
        raise APIError(400, message, param=QUEUE_DELAY_HEADER, code="invalid_value") from None


def refusal(exc: QueueFull) -> APIError:
    """A request the queue refused at arrival, as a 429."""
    code = "queue_timeout" if exc.bound == "deadline" else "queue_full"
    return APIError(429, exc.message, code=code, headers={"Retry-After": str(exc.retry_after)})


def deadline_error(loop: EngineLoop) -> APIError:
    """A request dropped from the queue for its deadline, as a 429 with the engine's Retry-After."""
    retry = queue_retry_after(loop)
    message = (
        "the request would not start by its queue deadline (dropped from the queue before it ran); "
        f"retry after {retry} s"
    )
    return APIError(429, message, code="queue_timeout", headers={"Retry-After": str(retry)})


class WatchedStream(StreamingResponse):
    """An SSE response that notes when its current write began, for ``StallWatch``."""

    def __init__(
        self, body: AsyncIterator[str], ids: list[str], watch: StallWatch | None, headers: dict[str, str]
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.ids = ids
        self.watch = watch
        self.writing_since: float | None = None  # loop time the pending write began; None: none pending
        self.stalled = False

    async def stream_response(self, send: Send) -> None:
        if self.watch is None:
            await super().stream_response(send)
            return
        clock = asyncio.get_running_loop().time

        async def timed(message: Message) -> None:
            self.writing_since = clock()
            try:
                await send(message)  # waits while the client's socket takes nothing
            finally:
                self.writing_since = None

        self.watch.add(self)
        try:
            await super().stream_response(timed)
        finally:
            self.watch.discard(self)


def sse_response(body: AsyncIterator[str], ids: list[str], watch: StallWatch | None) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return WatchedStream(body, ids, watch, headers)


__all__ = [
    "QUEUE_DELAY_HEADER",
    "WatchedStream",
    "deadline_error",
    "queue_deadline",
    "refusal",
    "sse_response",
]
