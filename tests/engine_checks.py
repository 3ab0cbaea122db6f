"""Engine checks the server tests run between steps through ``EngineLoop.call``: module-level
functions, so that they also pickle over to an engine in its own process (``engine_process.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def blocks_in_use(engine: Any) -> int:
    return int(engine.pool.num_used)


def live_requests_after_integrity_check(engine: Any) -> int:
    engine.pool.check_integrity()
    return len(engine.requests)


def wait_server_pool_empty(server: Any, timeout: float = 15.0, integrity: bool = True) -> None:
    """Wait until a live server's engine holds no KV block (a finished request's blocks go back a
    step or two after its answer), then assert it, and with ``integrity`` that the pool is whole and
    no request is left."""
    deadline = time.monotonic() + timeout
    while server.engine_loop.call(blocks_in_use).result(10) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine_loop.call(blocks_in_use).result(10) == 0
    if integrity:
        assert server.engine_loop.call(live_requests_after_integrity_check).result(10) == 0


def hold(engine: Any, held: str, go: str, timeout: float = 60.0) -> None:
    """Keep the engine's loop between two steps until the file ``go`` exists (``held`` is created
    once it is held): a stand-in for a step that takes long."""
    Path(held).touch()
    until = time.monotonic() + timeout
    while not Path(go).exists() and time.monotonic() < until:
        time.sleep(0.01)
