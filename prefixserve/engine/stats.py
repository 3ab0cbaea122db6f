"""The engine's counters, step timers and gauges, and ``metrics()`` built from them and the parts.

The loop bumps counters where things happen (requests in and out, tokens, steps); this module holds
them and puts every metric a caller sees in one dict, as vLLM v1's ``metrics/stats.py`` does.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import torch

from prefixserve.kv.block_pool import BlockPool
from prefixserve.scheduler.scheduler import SchedulerOutput
from prefixserve.triton_support.compile_watch import watch

log = logging.getLogger(__name__)

# every counter a caller may read, 0 before anything happened
COUNTERS = (
    "requests_total",
    "requests_finished_total",
    "requests_aborted_total",
    "prompt_tokens_total",
    "prompt_tokens_computed_total",
    "prefix_cache_hit_tokens_total",
    "generation_tokens_total",
    "attention_kv_tokens_read_total",
    "attention_kv_tokens_logical_total",
    "cascade_steps_total",
    "shared_segments_total",
    "steps_total",
    "preemptions_total",
    "batched_tokens_total",
    "prefix_cache_resets_total",
    "prefix_cache_reset_blocks_total",
    "spec_decode_draft_tokens_total",
    "spec_decode_accepted_tokens_total",
)

DEVICE_TIMERS = (
    "gpu_busy_seconds_total",
    "gpu_idle_seconds_total",
    "decode_gpu_busy_seconds_total",
    "decode_gpu_idle_seconds_total",
)

# Gauges that cost more than a read (the pool's free runs: one numpy pass, ~25 us at 40K blocks; the
# CUDA allocator's stats: a dict of ~100 entries) are refreshed at most this often while requests
# run, and on every call once the engine is idle (so a scrape after a burst sees exact values).
SLOW_GAUGES_S = 0.2
SLOW_STEP_S = 0.5  # a step longer than this is counted as slow (nothing a step does should take it)


class EngineStats:
    """Counters, step timers and the gauges the loop keeps up to date."""

    __slots__ = (
        "compiles",
        "counters",
        "kv_peak",
        "last_step_segments",
        "last_step_tokens",
        "slow_at",
        "slow_gauges",
        "timers",
    )

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        # Wall time of steps, and the part spent outside the forward pass + sampling (scheduling,
        # planning, metadata, bookkeeping): the host overhead a GPU would wait on.
        self.timers: Counter[str] = Counter()
        self.kv_peak = 0  # most blocks held at once (a gauge: what a workload needed of the pool)
        self.last_step_segments = 0
        self.last_step_tokens = 0
        self.slow_gauges: dict[str, float] = {}
        self.slow_at = -float("inf")  # time.monotonic() of the last refresh
        self.compiles = watch()  # the process's Triton compiles (each one met while serving stalls a step)

    def count_schedule(self, sched: SchedulerOutput, pool: BlockPool) -> None:
        self.kv_peak = max(self.kv_peak, pool.num_used)
        self.counters["preemptions_total"] += len(sched.preempted)
        self.counters["prefix_cache_hit_tokens_total"] += sched.cache_hit_tokens

    def count_step(self, stats: dict[str, float], num_tokens: int, layers: int) -> None:
        """A launched forward: its tokens and what attention read (``stats``: the step's attention plan)."""
        c = self.counters
        c["steps_total"] += 1
        c["batched_tokens_total"] += num_tokens
        c["attention_kv_tokens_read_total"] += int(stats.get("kv_tokens_read", 0)) * layers
        c["attention_kv_tokens_logical_total"] += int(stats.get("kv_tokens_logical", 0)) * layers
        c["cascade_steps_total"] += int(stats.get("cascade", 0))
        c["shared_segments_total"] += int(stats.get("shared_segments", 0))
        self.last_step_segments = int(stats.get("shared_segments", 0))
        self.last_step_tokens = num_tokens

    def time_step(self, total: float, waited: float) -> None:
        """A step's wall time, and its host part: all but the time spent waiting on the device."""
        self.timers["step_seconds_total"] += total
        self.timers["step_host_seconds_total"] += total - waited
        if total > SLOW_STEP_S:  # a compile, a capture, an allocation: every stream waited this long
            self.timers["slow_steps_total"] += 1
            self.timers["slow_step_host_seconds_total"] += total - waited
            log.info(
                "slow engine step: %.2f s (%.2f s on the host) with %d tokens over %d shared segments",
                total, total - waited, self.last_step_tokens, self.last_step_segments,
            )  # fmt: skip

    def save(self, runner: Any) -> tuple[Counter[str], Counter[str], Counter[str]]:
        """Copies of the counters and timers (the runner's too), for ``restore`` after start-up work."""
        return Counter(self.counters), Counter(self.timers), Counter(runner.timers)

    def restore(self, saved: tuple[Counter[str], Counter[str], Counter[str]], runner: Any) -> None:
        self.counters, self.timers, runner.timers = saved

    def metrics(self, engine: Any) -> dict[str, float]:
        """Every metric: the counters, then the Prompt Cache's, the pool's, the device's and gauges."""
        out: dict[str, float] = {k: 0 for k in COUNTERS}
        out["module_tokens_reused_total"] = 0
        out.update(self.counters)
        out.update(engine.modules.metrics())
        spill, pool = engine.spill, engine.pool
        out["prefix_cache_host_hit_tokens_total"] = engine.blocks.restored_tokens
        out["prefix_cache_spilled_blocks_total"] = spill.spilled_blocks if spill else 0
        out.update(step_seconds_total=self.timers["step_seconds_total"])
        out.update(step_host_seconds_total=self.timers["step_host_seconds_total"])
        out.update(slow_steps_total=self.timers["slow_steps_total"])
        out.update(slow_step_host_seconds_total=self.timers["slow_step_host_seconds_total"])
        out.update(self.compiles.metrics())
        # CUDA: device time of steps, and the gaps between consecutive steps (the GPU waiting on the host)
        device = engine.runner.timers
        out.update({k: device[k] for k in DEVICE_TIMERS})
        graphs, pieces = engine.runner.graphs, engine.runner.pieces
        captures = (graphs.captures if graphs else 0) + (pieces.captures if pieces else 0)
        out["cuda_graph_captures_total"] = captures
        out["cuda_graph_capture_seconds_total"] = (graphs.capture_s if graphs else 0.0) + (
            pieces.capture_s if pieces else 0.0
        )
        out["cuda_graph_misses_total"] = graphs.misses if graphs else 0
        out.update(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            kv_blocks_total=pool.num_blocks,
            kv_pool_tokens=pool.num_blocks * pool.block_size,
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            kv_blocks_cached=pool.num_cached,
            prefix_cache_evicted_blocks_total=pool.evictions,
            kv_scattered_allocations_total=pool.scattered_allocations,
            kv_blocks_used_peak=self.kv_peak,
            kv_blocks_pinned=sum(len(p.blocks) for p in engine.system_prompt_kv.values()),
            shared_segments_per_step=self.last_step_segments,
            kv_run_evicted_blocks_total=pool.run_evictions,
        )
        now = time.monotonic()
        if now - self.slow_at >= SLOW_GAUGES_S or not engine.scheduler.has_work():
            self.slow_gauges, self.slow_at = slow_gauges(pool, engine.device), now
        out.update(self.slow_gauges)
        return out


def slow_gauges(pool: BlockPool, device: torch.device) -> dict[str, float]:
    """The pool's free-space fragmentation (``kv/fragmentation.py``) and, on CUDA, the caching
    allocator's bytes (the driver rank's under tensor parallelism)."""
    space = pool.free_space()
    out = {
        "kv_free_runs": float(space.runs),
        "kv_longest_free_run": float(space.longest),
        "kv_free_fragmentation": space.fragmentation,
        "gpu_memory_allocated_bytes": 0.0,
        "gpu_memory_reserved_bytes": 0.0,
    }
    if device.type == "cuda":
        out["gpu_memory_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
        out["gpu_memory_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
    return out


__all__ = ["COUNTERS", "EngineStats"]
