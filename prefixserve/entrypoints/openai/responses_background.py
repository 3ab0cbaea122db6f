"""Background responses (``background: true``): answered at once, run on as a task of this process.

The create request is checked and queued as any response is (a refusal, a 429 included, answers it
then), and answered ``queued``, or with ``stream`` its events from ``response.created`` on; the
response is stored at once and its stored body follows it: ``in_progress`` while it runs, then what
a foreground response would have answered (``completed`` or ``incomplete``), or ``failed`` with the
error, or ``cancelled``. The client polls ``GET /v1/responses/{id}``, or follows its events with
``?stream=true`` (from ``starting_after``, an event's ``sequence_number``: a dropped connection
resumes where it broke); ``POST /v1/responses/{id}/cancel`` (or deleting it) stops it and frees its
blocks. A client leaving its stream stops nothing. Not kept across a restart, as the store is not.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from prefixserve.protocols.responses.items import input_items
from prefixserve.protocols.responses.prepare import ResponseCall
from prefixserve.protocols.responses.store import ACTIVE
from prefixserve.serving.engine_thread import StreamSink

log = logging.getLogger(__name__)

KEPT_LOGS = 64  # finished responses whose events stay followable (the running ones' always are)


class FirstOutput(StreamSink):
    """A background response's sink: notes its first output (the request has started: the
    response leaves ``queued`` for ``in_progress``)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: Callable[[], None] | None = None

    def put_nowait(self, item: Any) -> None:
        if self.started is not None:
            self.started, started = None, self.started
            started()
        super().put_nowait(item)


class EventLog:
    """A background response's stream events, each at the place of its ``sequence_number`` (they
    count from 0), so that any client can follow it from any event while it runs and after."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.last: dict[str, Any] = {}  # the last event's payload
        self.closed = False
        self._changed = asyncio.Event()

    def add(self, chunk: str) -> None:
        """The events of one stream write (one or several ``event: ...\\ndata: ...\\n\\n``)."""
        parts = [part for part in chunk.split("\n\n") if part]
        self.events += [part + "\n\n" for part in parts]
        if parts:
            self.last = json.loads(parts[-1].split("\ndata: ", 1)[1])
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()  # every follower waiting on it goes on; later ones wait on a new one
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number ``after``, as they come, until the run ends."""
        at = max(after + 1, 0)
        while True:
            if at < len(self.events):
                chunk, at = "".join(self.events[at:]), len(self.events)
                yield chunk
                continue
            if self.closed:
                return
            await self._changed.wait()


class BackgroundRuns:
    """The background responses running in this process, by response id, and the events of those
    running or recently finished."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(
        self,
        call: ResponseCall,
        sink: FirstOutput,
        events: AsyncIterator[str],
        opening: str,
        abort: Callable[[], None],
    ) -> EventLog:
        """Store the response as ``queued`` (``in_progress`` from its first output on) and run on
        until ``events`` (its queued engine work's stream, from ``sink``) end, kept in the returned
        log after ``opening`` (the created and queued events). Cancelled at any point, even before
        it ever ran, it calls ``abort`` (the engine's requests stop and free their blocks)."""
        self._put(call, call.skeleton("queued"))
        events_log = EventLog()
        events_log.add(opening)
        self._logs[call.rid] = events_log

        def started() -> None:  # a first output that arrives after a cancel or a delete changes nothing
            if call.rid in self._tasks:
                self._put(call, call.skeleton("in_progress"))

        sink.started = started
        task = asyncio.get_running_loop().create_task(self._run(call, events, events_log))
        self._tasks[call.rid] = task

        def ended(done: asyncio.Task[None]) -> None:
            self._tasks.pop(call.rid, None)
            sink.started = None
            events_log.close()
            if done.cancelled():  # also before it ever ran: nothing else stops the engine's requests
                abort()
                self._put(call, call.skeleton("cancelled"))
            self._keep_recent()

        task.add_done_callback(ended)
        return events_log

    async def _run(self, call: ResponseCall, events: AsyncIterator[str], events_log: EventLog) -> None:
        try:
            async for chunk in events:
                events_log.add(chunk)
            if events_log.last.get("type") == "response.failed":  # the engine refused or failed it
                self._put(call, events_log.last["response"])
            else:  # ended without its last event: aborted by the server (shutting down)
                stored = None if call.store is None else call.store.get(call.rid)
                if stored is not None and stored.body.get("status") in ACTIVE:
                    self._put(call, call.skeleton("cancelled"))
        except Exception as exc:  # the task's own failure: recorded, never lost in the event loop
            log.exception("background response %s failed", call.rid)
            body = call.skeleton("failed")
            body["error"] = {"code": "server_error", "message": f"internal error: {type(exc).__name__}"}
            self._put(call, body)

    @staticmethod
    def _put(call: ResponseCall, body: dict[str, Any]) -> None:
        assert call.store is not None  # a background response is stored (``prepare_response``)
        call.store.put(call.rid, body, call.history, input_items(call.req.input))

    def _keep_recent(self) -> None:
        finished = [rid for rid in self._logs if rid not in self._tasks]
        for rid in finished[: max(0, len(finished) - KEPT_LOGS)]:
            del self._logs[rid]

    def events(self, rid: str) -> EventLog | None:
        """A response's events, while they are kept."""
        return self._logs.get(rid)

    def forget(self, rid: str) -> None:
        """A deleted response's events go with it."""
        self._logs.pop(rid, None)

    async def cancel(self, rid: str) -> None:
        """Stop a running background response (its stored status becomes ``cancelled``); nothing
        for one that has finished."""
        task = self._tasks.get(rid)
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # the engine's requests are aborted

    def cancel_all(self) -> None:
        """At shutdown: every run is cancelled (each aborts its engine requests)."""
        for task in list(self._tasks.values()):
            task.cancel()


__all__ = ["BackgroundRuns", "EventLog", "FirstOutput"]
