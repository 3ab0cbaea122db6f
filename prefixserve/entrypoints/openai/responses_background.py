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
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any

from prefixserve.entrypoints.openai.protocol import APIError
from prefixserve.entrypoints.openai.responses import ResponseCall, input_items
from prefixserve.outputs import RequestOutput

log = logging.getLogger(__name__)

ACTIVE = ("queued", "in_progress")  # a background response's statuses while it may still change
# a failure's error code as the Responses API names it, by the server's error type
FAILURE_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}


class BackgroundRuns:
    """The background responses running in this process, by response id."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, call: ResponseCall, finals: Awaitable[list[RequestOutput] | None]) -> dict[str, Any]:
        """Store the response as ``queued`` and run on until ``finals`` (its queued engine work's
        final outputs) are in; the ``queued`` body is the create request's answer."""
        body = call.skeleton("queued")
        self._put(call, body)
        task = asyncio.get_running_loop().create_task(self._run(call, finals))
        self._tasks[call.rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(call.rid, None))
        return body

    async def _run(self, call: ResponseCall, finals: Awaitable[list[RequestOutput] | None]) -> None:
        self._put(call, call.skeleton("in_progress"))
        try:
            done = await finals
        except asyncio.CancelledError:  # cancelled: the engine's requests were aborted on the way out
            self._put(call, call.skeleton("cancelled"))
            raise
        except APIError as exc:
            self._failed(call, FAILURE_CODES.get(exc.type, "server_error"), exc.message)
            return
        except Exception as exc:  # the task's own failure: recorded, never lost in the event loop
            log.exception("background response %s failed", call.rid)
            self._failed(call, "server_error", f"internal error: {type(exc).__name__}")
            return
        if done is None or any(c.finish_reason == "abort" for f in done for c in f.outputs):
            self._put(call, call.skeleton("cancelled"))  # aborted by the server (shutting down)
            return
        call.body(done)  # stored as a foreground response is: completed or incomplete

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
        task = self._tasks.get(rid)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def cancel_all(self) -> None:
        """At shutdown: every run is cancelled (each aborts its engine requests)."""
        for task in list(self._tasks.values()):
            task.cancel()


__all__ = ["ACTIVE", "BackgroundRuns"]
