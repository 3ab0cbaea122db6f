"""Background responses (``background: true``): answered at once, run on as a task of this process.

The create request is checked and queued as any response is (a refusal, a 429 included, answers it
then), and answered ``queued``; the response is stored at once and its stored body follows it:
``in_progress`` while it runs, then what a foreground response would have answered (``completed``
or ``incomplete``), or ``failed`` with the error, or ``cancelled``. The client polls
``GET /v1/responses/{id}``; ``POST /v1/responses/{id}/cancel`` (or deleting it) stops it and frees
its blocks. Not streamed; not kept across a restart, as the store is not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prefixserve.entrypoints.openai.engine_thread import StreamSink
from prefixserve.entrypoints.openai.protocol import APIError
from prefixserve.entrypoints.openai.responses import ResponseCall, input_items
from prefixserve.outputs import RequestOutput

log = logging.getLogger(__name__)

# a failure's error code as the Responses API names it, by the server's error type
FAILURE_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}


class FirstOutput(StreamSink):
    """A background response's sink: notes its first output (the request has started: the
    response leaves ``queued`` for ``in_progress``). Never resumed, so the engine builds that one
    progress output and then only the final one (``StreamSink``'s backpressure)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: Callable[[], None] | None = None

    def put_nowait(self, item: Any) -> None:
        if self.started is not None:
            self.started, started = None, self.started
            started()
        super().put_nowait(item)


class BackgroundRuns:
    """The background responses running in this process, by response id."""

    def __init__(self) -> None:
        # response id -> (the run, its collecting of the engine's outputs)
        self._tasks: dict[str, tuple[asyncio.Task[None], asyncio.Future[Any]]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def start(
        self,
        call: ResponseCall,
        sink: FirstOutput,
        finals: Awaitable[list[RequestOutput] | None],
        abort: Callable[[], None],
    ) -> dict[str, Any]:
        """Store the response as ``queued`` (``in_progress`` from its first output on) and run on
        until ``finals`` (its queued engine work's final outputs, from ``sink``) are in; the
        ``queued`` body is the create request's answer. Cancelled at any point, even before it
        ever ran, it calls ``abort`` (the engine's requests stop and free their blocks)."""
        body = call.skeleton("queued")
        self._put(call, body)

        def started() -> None:  # a first output that arrives after a cancel or a delete changes nothing
            if call.rid in self._tasks:
                self._put(call, call.skeleton("in_progress"))

        sink.started = started
        collecting = asyncio.ensure_future(finals)
        task = asyncio.get_running_loop().create_task(self._run(call, collecting))
        self._tasks[call.rid] = (task, collecting)

        def ended(done: asyncio.Task[None]) -> None:
            self._tasks.pop(call.rid, None)
            sink.started = None
            if done.cancelled():  # also before it ever ran: nothing else stops the collecting
                collecting.cancel()
                abort()
                self._put(call, call.skeleton("cancelled"))

        task.add_done_callback(ended)
        return body

    async def _run(self, call: ResponseCall, finals: Awaitable[list[RequestOutput] | None]) -> None:
        try:
            done = await finals
            if done is None or any(c.finish_reason == "abort" for f in done for c in f.outputs):
                self._put(call, call.skeleton("cancelled"))  # aborted by the server (shutting down)
                return
            call.body(done)  # stored as a foreground response is: completed or incomplete
        except APIError as exc:
            self._failed(call, FAILURE_CODES.get(exc.type, "server_error"), exc.message)
        except Exception as exc:  # the task's own failure: recorded, never lost in the event loop
            log.exception("background response %s failed", call.rid)
            self._failed(call, "server_error", f"internal error: {type(exc).__name__}")

    def _failed(self, call: ResponseCall, code: str, message: str) -> None:
        body = call.skeleton("failed")
        body["error"] = {"code": code, "message": message}
        self._put(call, body)

    @staticmethod
    def _put(call: ResponseCall, body: dict[str, Any]) -> None:
        assert call.store is not None  # a background response is stored (``prepare_response``)
        call.store.put(call.rid, body, call.history, input_items(call.req.input))

    async def cancel(self, rid: str) -> None:
        """Stop a running background response (its stored status becomes ``cancelled``); nothing
        for one that has finished."""
        running = self._tasks.get(rid)
        if running is None:
            return
        for part in running:
            part.cancel()
        await asyncio.gather(*running, return_exceptions=True)  # the engine's requests are aborted

    def cancel_all(self) -> None:
        """At shutdown: every run is cancelled (each aborts its engine requests)."""
        for task, _ in list(self._tasks.values()):
            task.cancel()


__all__ = ["BackgroundRuns", "FirstOutput"]
