"""One engine replica behind the Ray Serve ingress: the single server's app, called in process.

The replica runs exactly the app ``prefixserve serve`` runs (``openai/app.build_app``: its checks,
errors, streaming, metrics), so a replicated endpoint answers as one server does; its engine runs
where the direct server's does (``--engine-process``, auto: a process of its own when the engine runs
on CUDA, else a thread). The replica's process also runs Ray's streaming and the app's loop; an engine
thread sharing their GIL is one of the two causes issue 52 found for 256 streamed chats running 46%
slower behind ``--replicas 1`` than from a direct server on an H100 (the other: one ingress
relaying every stream, ``serve_app.default_ingress_replicas``).
The ingress hands it a request's method, path, headers and body; the replica drives its ASGI app
without a socket and yields the response start (status, headers) and then the body chunks as the
app writes them. It also reports its prefix-cache events (for the router) and its health (Ray
Serve restarts a replica whose engine stopped). No Ray import: ``serve_app.py`` makes it a
deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import os
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from prefixserve.config import EngineConfig
from prefixserve.kv.cache_events import DEFAULT_CONSUMER, CacheEvents

APP_EXIT_WAIT_S = 5.0  # how long a finished response's ASGI task gets to return


class EngineReplica:
    """An engine and its OpenAI app; methods are called by the ingress through a Ray Serve handle."""

    def __init__(
        self,
        config: EngineConfig,
        api_key: str | Sequence[str] | None = None,
        overload: Any = None,
        engine_process: str = "auto",
        switch_interval_ms: float | None = None,
        name: str | None = None,
        max_stored_responses: int = 1024,
        batches: Any = None,
    ) -> None:
        """``overload``: the server's ``OverloadSettings`` (queue bounds, deadline, stall timeout);
        ``engine_process``: auto, on or off, as ``serve --engine-process``; ``switch_interval_ms``:
        this process's GIL switch interval, as ``serve --switch-interval-ms`` (None: Python's);
        ``name``: the ingress's name for it, written into the ids of the responses it stores (at most
        ``max_stored_responses``), and into its files' and batches' (``batches``: the server's
        ``BatchSettings``; with a ``files_dir``, this replica keeps them in its own folder there)."""
        # FastAPI and uvicorn: only where a replica runs
        from prefixserve.entrypoints.openai.app import build_app
        from prefixserve.entrypoints.openai.batch_settings import BatchSettings
        from prefixserve.protocols.responses.store import ResponseStore
        from prefixserve.serving.engine_process import wants_engine_process

        if switch_interval_ms is not None:
            sys.setswitchinterval(switch_interval_ms / 1e3)
        own_process = wants_engine_process(engine_process, config)
        self.app = build_app(
            config,
            api_key=api_key,
            engine_process=own_process,
            overload=overload,
            responses=ResponseStore(max_stored_responses, tag=name),
            batches=replica_batches(batches or BatchSettings(), name),
        )
        self._resumed = False  # the app's lifespan would resume its batches: done at the first call
        self.loop = self.app.state.engine_loop
        self.loop.start()  # the app's lifespan would; it is never run here (no server)
        self.incarnation = uuid.uuid4().hex  # a restarted replica is a new one: its cache starts empty

    def info(self) -> dict[str, Any]:
        """Who this replica is: its incarnation, process id and its engine's (tests kill them by pid)."""
        pid = os.getpid()
        return {"incarnation": self.incarnation, "pid": pid, "engine_pid": getattr(self.loop, "pid", pid)}

    async def cache_events(
        self, full: bool = False, consumer: str = DEFAULT_CONSUMER
    ) -> tuple[str, CacheEvents]:
        """(incarnation, prefix-index changes since ``consumer``'s last call, or all of it when
        ``full``); each ingress is its own consumer. A method caller, not a lambda: an engine in its
        own process runs only what pickles."""
        drain = operator.methodcaller("drain_cache_events", full, consumer)
        events = await self.loop.run(drain)
        return self.incarnation, events

    async def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.app.state.metrics.registry))

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it restart the replica."""
        self._resume_batches()
        if not self.loop.alive:
            raise RuntimeError("the engine of this replica stopped")

    async def handle(
        self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        """Run one HTTP request through the app: yields ``{"status", "headers"}``, then body chunks.

        Leaving early (the ingress's client went away) tells the app its client disconnected, so
        the app aborts the engine requests as it would for a socket."""
        self._resume_batches()
        async for item in call_asgi(self.app, method, path, query, headers, body):
            yield item

    def _resume_batches(self) -> None:
        """The unfinished batches this replica's files folder holds, started again (needs the
        replica's event loop, so not in ``__init__``)."""
        if not self._resumed:
            self._resumed = True
            self.app.state.batch_service.start()

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.stop(timeout=5.0)


async def call_asgi(
    app: Any, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
) -> AsyncIterator[dict[str, Any] | bytes]:
    """Drive an ASGI app for one HTTP request without a socket (see ``EngineReplica.handle``)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(scope, receive, messages.put))
    try:
        while True:
            getter = asyncio.ensure_future(messages.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # the app raised: pass it on
                if messages.empty():
                    raise RuntimeError("the app ended without a complete response")
                continue
            message = getter.result()
            if message["type"] == "http.response.start":
                raw = message.get("headers", [])
                yield {"status": message["status"], "headers": [(k.decode(), v.decode()) for k, v in raw]}
            elif message["type"] == "http.response.body":
                body, more = _with_queued_body(message, messages)
                if body:
                    yield body
                if not more:
                    return
    finally:
        gone.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, APP_EXIT_WAIT_S)


def _with_queued_body(message: dict[str, Any], messages: asyncio.Queue[dict[str, Any]]) -> tuple[bytes, bool]:
    """A body message joined with the body messages already queued behind it: (bytes, more_body).

    Each item a replica yields is one Ray Serve streaming hop to the ingress; when the ingress falls
    behind (many streams, a token each per step), chunks queue here and go as one item. Nothing
    waits for a chunk that is not there yet, so a stream keeping up is relayed chunk by chunk.
    """
    parts = [bytes(message.get("body", b""))]
    more = bool(message.get("more_body", False))
    while more and not messages.empty():
        queued = messages.get_nowait()  # the app writes only body messages after the start
        parts.append(bytes(queued.get("body", b"")))
        more = bool(queued.get("more_body", False))
    return b"".join(parts), more


__all__ = ["EngineReplica", "call_asgi"]


def replica_batches(settings: Any, name: str | None) -> Any:
    """A replica's ``BatchSettings``: ids tagged with its name, its files in ``files_dir/name``."""
    folder = settings.files_dir
    if folder is not None and name is not None:
        folder = os.path.join(folder, name)
    return dataclasses.replace(settings, files_dir=folder, tag=name)
