"""A log line every few seconds while the engine works, as vLLM's stat logger writes: prompt and
generation throughput, running and waiting requests, the KV pool's use, the prefix cache's hit rate
and the KV rows shared-segment attention did not read. It reads the engine's metrics snapshot (what
/metrics serves), so it costs the engine nothing; an idle server logs one line and then nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("prefixserve.stats")

INTERVAL_S = 10.0  # vLLM logs every 10 s (VLLM_LOG_STATS_INTERVAL)


def _rate(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def stats_line(before: dict[str, float], now: dict[str, float], seconds: float) -> str:
    """One line of what moved between two snapshots ``seconds`` apart."""

    def moved(key: str) -> float:
        return now.get(key, 0.0) - before.get(key, 0.0)

    span = max(seconds, 1e-9)
    used, total = now.get("kv_blocks_used", 0.0), now.get("kv_blocks_total", 0.0)
    read, logical = moved("attention_kv_tokens_read_total"), moved("attention_kv_tokens_logical_total")
    hits, prompts = moved("prefix_cache_hit_tokens_total"), moved("prompt_tokens_total")
    return (
        f"prompt throughput: {moved('prompt_tokens_computed_total') / span:.1f} tokens/s, "
        f"generation throughput: {moved('generation_tokens_total') / span:.1f} tokens/s, "
        f"running: {now.get('num_running', 0):.0f} reqs, waiting: {now.get('num_waiting', 0):.0f} reqs, "
        f"KV cache usage: {_rate(used, total)}, "
        f"prefix cache hit rate: {_rate(hits, prompts)}, "
        f"KV reads saved by sharing: {_rate(logical - read, logical)}"
    )


def busy(before: dict[str, float], now: dict[str, float]) -> bool:
    """Did anything run or wait between the two snapshots?"""
    if now.get("num_running", 0) or now.get("num_waiting", 0):
        return True
    return any(now.get(k, 0.0) != before.get(k, 0.0) for k in ("steps_total", "requests_total"))


async def log_stats(snapshot: Callable[[], dict[str, float]], interval: float = INTERVAL_S) -> None:
    """Log ``stats_line`` every ``interval`` seconds while the engine is busy, and once when it goes
    idle (cancel the task to stop it)."""
    before, then, was_busy = dict(snapshot()), time.monotonic(), False
    while True:
        await asyncio.sleep(interval)
        now, at = dict(snapshot()), time.monotonic()
        is_busy = busy(before, now)
        if is_busy or was_busy:
            log.info("%s", stats_line(before, now, at - then))
        before, then, was_busy = now, at, is_busy


__all__ = ["INTERVAL_S", "busy", "log_stats", "stats_line"]
