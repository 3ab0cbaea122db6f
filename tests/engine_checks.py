"""Engine checks the server tests run between steps through ``EngineLoop.call``: module-level
functions, so that they also pickle over to an engine in its own process (``engine_process.py``)."""

from __future__ import annotations

from typing import Any


def blocks_in_use(engine: Any) -> int:
    return int(engine.pool.num_used)


def live_requests_after_integrity_check(engine: Any) -> int:
    engine.pool.check_integrity()
    return len(engine.requests)
