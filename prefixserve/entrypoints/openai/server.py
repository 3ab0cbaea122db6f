"""OpenAI-compatible HTTP server: ``prefixserve serve`` and an in-process runner for tests and benchmarks.

The pieces: ``metrics`` (Prometheus), ``app`` (the app and its routes), ``answering`` (one request's
queueing, streaming and collecting); the engine thread or process, overload control and the
server's logs are ``prefixserve/serving/``'s; request models, errors, bodies and stream chunks are
``prefixserve/protocols/``'s. FastAPI and uvicorn are imported
here, never by the engine core.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections; in-flight requests get
``grace_s`` seconds to finish, then whatever still runs is aborted (streams end with finish_reason
"abort" and ``[DONE]``), the engine thread stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import socket
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn

from prefixserve.entrypoints.args import engine_config_from_args
from prefixserve.entrypoints.openai.app import MAX_BODY_BYTES, build_app
from prefixserve.entrypoints.openai.batch_settings import BatchSettings
from prefixserve.entrypoints.serve_args import uvicorn_options
from prefixserve.protocols.responses.store import ResponseStore
from prefixserve.serving.admission import AdmissionLimits
from prefixserve.serving.engine_process import wants_engine_process
from prefixserve.serving.engine_thread import EngineLoop
from prefixserve.serving.overload import OverloadSettings

__all__ = ["MAX_BODY_BYTES", "GracefulServer", "ServerThread", "build_app", "free_port", "serve"]

log = logging.getLogger(__name__)

GRACE_S = 10.0  # seconds in-flight requests get to finish on shutdown before they are aborted


def http_options() -> dict[str, str]:
    """uvicorn's HTTP parser and event loop: httptools and uvloop where importable, else h11 and asyncio.

    Every streamed token is one body write, and h11 (pure Python) costs several times httptools (C) per
    write on the asyncio thread, which shares the GIL with the engine thread; uvloop's loop is cheaper
    per callback. Both are optional (no wheels on Windows; some images lack httptools).
    """
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return {"http": http, "loop": loop}


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that aborts engine requests at the end of the grace period and exits cleanly."""

    def __init__(self, config: uvicorn.Config, grace_s: float = GRACE_S) -> None:
        config.timeout_graceful_shutdown = grace_s + 5.0  # aborted streams need a moment to end
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(self.config.app, "state", None)
        batches = getattr(state, "batch_service", None)
        if batches is not None:  # first: a row aborted below must not count as answered
            batches.runs.halt()
        loop: EngineLoop | None = getattr(state, "engine_loop", None)
        if loop is not None:
            asyncio.get_running_loop().call_later(self.grace_s, loop.abort_all)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it is done (exit status -15); a clean shutdown exits 0.
        self._captured_signals.clear()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerThread:
    """A live server in this process (tests, benchmarks): ``with ServerThread(app) as srv: srv.url``."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int | None = None,
        grace_s: float = 2.0,
        listener: dict[str, Any] | None = None,
    ) -> None:
        """``listener``: uvicorn.Config's keywords for TLS, root path and logs (``uvicorn_options``)."""
        self.app = app
        self.host = host
        self.port = port or free_port(host)
        options: dict[str, Any] = {"log_level": "warning", **http_options(), **(listener or {})}
        self.scheme = "https" if options.get("ssl_certfile") else "http"
        config = uvicorn.Config(app, host=self.host, port=self.port, lifespan="on", **options)
        self.server = GracefulServer(config, grace_s)
        self._thread = threading.Thread(target=self.server.run, name="prefixserve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def engine_loop(self) -> EngineLoop:
        return self.app.state.engine_loop  # type: ignore[no-any-return]

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        waited = 0.0
        while not self.server.started:
            if not self._thread.is_alive() or waited > timeout:
                raise RuntimeError(f"the server did not start on {self.url}")
            threading.Event().wait(0.02)
            waited += 0.02
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def overload_settings(args: argparse.Namespace) -> OverloadSettings:
    """``serve``'s overload options (ValueError names a bad one)."""
    limits = AdmissionLimits(args.max_waiting_requests, args.max_waiting_tokens)
    stall = args.stream_stall_timeout
    if stall is not None and stall < 0:
        raise ValueError(f"--stream-stall-timeout must be >= 0 (0: never), got {stall}")
    if args.max_queue_delay is not None and not args.max_queue_delay > 0:
        raise ValueError(f"--max-queue-delay must be > 0 seconds, got {args.max_queue_delay}")
    return OverloadSettings(limits, args.max_queue_delay, stall or None)


def batch_settings(args: argparse.Namespace) -> BatchSettings:
    """``serve``'s files and batches options."""
    return BatchSettings(args.files_dir, args.max_file_bytes, args.batch_concurrency, args.batch_grouping)


def serve(args: argparse.Namespace) -> int:
    """``prefixserve serve``: load the model, bind (127.0.0.1 by default), serve until SIGTERM/Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.switch_interval_ms <= 0:
        raise ValueError(f"--switch-interval-ms must be > 0, got {args.switch_interval_ms}")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    config = engine_config_from_args(args)
    listener = uvicorn_options(args)
    overload = overload_settings(args)
    log.info("loading %s", config.model or "the default model")
    own_process = wants_engine_process(args.engine_process, config)
    if args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    stored = ResponseStore(args.max_stored_responses)
    app = build_app(
        config,
        api_key=args.api_key,
        engine_process=own_process,
        overload=overload,
        responses=stored,
        allowed_origins=args.allowed_origins,
        batches=batch_settings(args),
        log_stats=not args.disable_log_stats,
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
    )
    state = app.state.server
    options = http_options()
    log.info(
        "serving %s (context %d) on %s://%s:%d%s%s (http %s, loop %s)",
        state.model,
        state.max_model_len,
        "https" if args.ssl_certfile else "http",
        args.host,
        args.port,
        args.root_path,
        " (API key required)" if args.api_key else "",
        options["http"],
        options["loop"],
    )
    server = GracefulServer(
        uvicorn.Config(app, host=args.host, port=args.port, lifespan="on", **options, **listener)
    )
    server.run()
    return 0 if server.started else 1
