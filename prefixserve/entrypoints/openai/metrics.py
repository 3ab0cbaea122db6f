"""Prometheus metrics for one server app (its own CollectorRegistry, so several apps can coexist).

Engine counters and gauges are read from the engine thread's latest snapshot at scrape time (the HTTP
thread never touches the Engine), plus the counters of refusals the HTTP process decided itself
(``overload.ArrivalGate``: added to the engine's, by bound); latency histograms are fed by the engine
thread as requests move, and the path histograms (``PATH_STAGES``) by the routes, the delivering
thread and the response middleware: where a request's time goes outside the engine's clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixserve.engine.gc_tuning import watch_gc
from prefixserve.entrypoints.openai.tenant_metrics import TenantMetrics

PREFIX = "prefixserve"

_COUNTERS = {
    "requests_total": "requests accepted by the engine",
    "requests_finished_total": "requests finished (any reason)",
    "requests_aborted_total": "requests aborted (client gone or stalled, shutdown, queue deadline)",
    "requests_dropped_deadline_total": "requests dropped from the waiting queue for their deadline (429)",
    "requests_refused_http_total": (
        "requests refused with 429 at arrival by the HTTP process, from the engine's last published "
        "queue, before the engine saw them (also in requests_refused_total)"
    ),
    "queue_starts_estimated_total": "queued requests that started, with a wait estimated at admission",
    "queue_wait_estimated_seconds_total": "their estimated queue waits, summed",
    "queue_wait_actual_seconds_total": "their actual queue waits, summed",
    "queue_starts_late_total": "of them, started later than estimated by over a quarter of their deadline",
    "engine_gc_passes_total": "cyclic GC passes in the engine process (each stops its loop)",
    "engine_gc_pause_seconds_total": "time the engine process's cyclic GC passes took",
    "engine_pipe_send_seconds_total": "time the engine process waited to send outputs to the server",
    "prompt_tokens_total": "prompt tokens of accepted requests",
    "prompt_tokens_computed_total": "prompt tokens actually run through the model (not from cache)",
    "generation_tokens_total": "tokens generated",
    "spec_decode_draft_tokens_total": "draft tokens speculative decoding proposed and checked",
    "spec_decode_accepted_tokens_total": "of them, drafts kept (each a token a step did not have to decode)",
    "prefix_cache_hit_tokens_total": "prompt tokens served from the prefix cache (first admissions only)",
    "attention_kv_tokens_read_total": "KV rows read by attention (shared segments read once)",
    "attention_kv_tokens_logical_total": "KV rows a per-sequence attention would read",
    "preemptions_total": "sequences preempted for lack of KV blocks",
    "steps_total": "engine steps",
    "step_seconds_total": "wall time of engine steps",
    "step_host_seconds_total": "time of engine steps not spent waiting on the device",
    "slow_steps_total": "engine steps longer than 0.5 s (every running stream and every arrival waited)",
    "slow_step_host_seconds_total": "host time of those slow steps (compiles, captures, allocations)",
    "gpu_busy_seconds_total": "device time of steps (CUDA), first kernel to last",
    "gpu_idle_seconds_total": "device time between consecutive steps (CUDA): the GPU waiting on the host",
    "cuda_graph_captures_total": "CUDA graphs captured (decode batches, dense pieces of eager steps)",
    "cuda_graph_capture_seconds_total": "host time spent capturing CUDA graphs (the running streams wait)",
    "cuda_graph_misses_total": "decode steps run eagerly after ready: no captured graph held them",
    "kernel_compiles_total": "Triton kernels compiled in the engine's process (start-up included)",
    "kernel_compile_seconds_total": "host time those compiles took",
    "kernel_compiles_serving_total": "Triton kernels compiled after start-up (each stalls every stream)",
    "kernel_compile_serving_seconds_total": "host time those serve-time compiles took",
    "prefix_cache_evicted_blocks_total": "cached KV blocks evicted to make room (least recently used first)",
    "prefix_cache_resets_total": "prefix-cache resets (POST /reset_prefix_cache, LLM.reset_prefix_cache)",
    "prefix_cache_reset_blocks_total": "cached KV blocks those resets dropped (device and host memory)",
    "kv_scattered_allocations_total": "allocations of 16+ blocks split into runs (no free run long enough)",
    "kv_run_evicted_blocks_total": "cached KV blocks evicted to give a long allocation one run of block ids",
    # Prompt Cache: schemas' modules
    "module_tokens_reused_total": "prompt tokens served from encoded prompt modules (Prompt Cache)",
    "module_encodes_total": "prompt module pieces encoded (run through the model)",
    "module_loads_host_total": "prompt module pieces brought back to the GPU from host memory",
    "module_loads_disk_total": "prompt module pieces brought back to the GPU from the module store",
    "module_evictions_gpu_total": "prompt module pieces moved off the GPU to make room",
    "module_store_corrupt_total": "module store entries found corrupt or truncated (recomputed)",
    "module_recomputed_tokens_total": "module rows recomputed in their request's context (accuracy recovery)",
    "module_rows_shared_total": "module rows requests read from blocks shared with other requests",
    "module_rows_private_total": "module rows requests read from their own copies (recovered blocks)",
    "module_recompute_skipped_total": "requests run without module recovery: the pool was short of blocks",
    "module_holds_let_go_total": "waiting requests that let their module blocks go for a stuck queue's head",
    "module_holds_deferred_total": "Prompt Cache requests taken in with no room for their modules yet",
}
_GAUGES = {
    "num_running": ("num_requests_running", "sequences running"),
    "engine_pipe_send_longest_seconds": (
        "engine_pipe_send_longest_seconds",
        "the engine process's longest wait to send outputs to the server so far",
    ),
    "engine_gc_pause_longest_seconds": (
        "engine_gc_pause_longest_seconds",
        "the engine process's longest cyclic GC pass so far",
    ),
    "num_waiting": ("num_requests_waiting", "sequences waiting"),
    "kv_blocks_total": ("kv_blocks_total", "KV pool size in blocks"),
    "kv_pool_tokens": ("kv_pool_tokens", "KV pool size in tokens (twice as many with --kv-cache-dtype fp8)"),
    "kv_blocks_used": ("kv_blocks_used", "KV blocks held by requests"),
    "kv_blocks_cached": ("kv_blocks_cached", "KV blocks in the prefix index"),
    "kv_free_runs": ("kv_free_runs", "runs of consecutive free KV block ids"),
    "kv_longest_free_run": ("kv_longest_free_run", "free KV blocks in the longest run of consecutive ids"),
    "kv_free_fragmentation": (
        "kv_free_fragmentation",
        "share of free KV blocks outside the longest free run (0: one run)",
    ),
    "gpu_memory_allocated_bytes": ("gpu_memory_allocated_bytes", "CUDA memory held by tensors (engine)"),
    "gpu_memory_reserved_bytes": ("gpu_memory_reserved_bytes", "CUDA memory the caching allocator holds"),
    "module_blocks_gpu": ("module_blocks_gpu", "KV blocks holding encoded prompt modules"),
    "module_entries_host": ("module_entries_host", "prompt module pieces kept in host memory"),
    # overload (serving/admission.py): absent without an admission (then 0)
    "waiting_prompt_tokens": ("num_waiting_prompt_tokens", "prompt tokens waiting requests have to compute"),
    "queue_wait_estimate_seconds": (
        "queue_wait_estimate_seconds",
        "time the waiting queue takes to drain at its recent rates",
    ),
    "queue_wait_slack_seconds": (
        "queue_wait_slack_seconds",
        "seconds added to a wait estimate at arrival: how much later than estimated recent requests started",
    ),
    "queue_wait_slack_ratio": (
        "queue_wait_slack_ratio",
        "factor on a wait estimate at arrival: the largest recent actual / estimated wait",
    ),
    "queue_drain_requests_per_second": (
        "queue_drain_requests_per_second",
        "requests started per second while the queue was not empty (smoothed)",
    ),
    "queue_drain_prompt_tokens_per_second": (
        "queue_drain_prompt_tokens_per_second",
        "prefill tokens computed per second while the queue was not empty (smoothed)",
    ),
    "max_waiting_requests": ("max_waiting_requests", "bound on waiting requests (0: unbounded)"),
    "max_waiting_tokens": ("max_waiting_tokens", "bound on waiting prompt tokens (0: unbounded)"),
}
# requests refused at arrival with 429, by the bound they met
_REFUSED = {
    "queue_requests": "requests_refused_queue_requests_total",
    "queue_tokens": "requests_refused_queue_tokens_total",
    "deadline": "requests_refused_deadline_total",
}
LOOP_TICK_S = 0.1  # the event-loop lag probe's period
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PATH_BUCKETS = (0.0005, 0.001, 0.0025, *_LATENCY_BUCKETS)
# A request's way through the server outside the engine's own clock (arrival to first token), stage
# -> (histogram, help). All on time.monotonic() (CLOCK_MONOTONIC: one clock for the host's processes),
# so that a client's wait the engine does not see can be placed: before the engine, or after it.
PATH_STAGES = {
    "intake": (
        "request_intake_seconds",
        "route start (the queue deadline's origin) to the request handed to the engine: body, chat "
        "template, tokenization on a worker thread, the arrival gate",
    ),
    "to_engine": (
        "request_to_engine_seconds",
        "handed to the engine (thread queue or pipe) to the engine's arrival time (the engine created "
        "the request: it took the add between steps)",
    ),
    "from_engine": (
        "first_token_delivery_seconds",
        "the engine's first token to this process receiving that output (pipe and reader thread)",
    ),
    "to_client": (
        "first_write_seconds",
        "a stream's first output received to its first chunk (or its 429) written to the transport: "
        "the event loop, the route and the response",
    ),
    "refusal": (
        "refusal_seconds",
        "route start to a 429 response written (refused at arrival, by the engine, or dropped)",
    ),
}


class _EngineCollector(Collector):
    def __init__(
        self, snapshot: Callable[[], dict[str, float]], local: Callable[[], dict[str, int]] | None
    ) -> None:
        self._snapshot = snapshot
        self._local = local

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if self._local is not None:  # counters this process keeps, added to the engine's
            snap = dict(snap)
            for key, value in self._local().items():
                snap[key] = snap.get(key, 0) + value
        for key, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{key.removesuffix('_total')}", doc, value=snap.get(key, 0))
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=snap.get(key, 0))
        refused = CounterMetricFamily(
            f"{PREFIX}_requests_refused",
            "requests refused with 429 at arrival: the waiting queue at its bound of requests or prompt "
            "tokens, or too long to drain before the request's deadline",
            labels=["reason"],
        )
        for reason, key in _REFUSED.items():
            refused.add_metric([reason], snap.get(key, 0))
        yield refused
        total = snap.get("kv_blocks_total", 0) or 1
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_usage_ratio",
            "fraction of KV blocks held",
            value=snap.get("kv_blocks_used", 0) / total,
        )


class ServerMetrics:
    """The app's registry plus the engine thread's latency observer."""

    def __init__(
        self, snapshot: Callable[[], dict[str, float]], local: Callable[[], dict[str, int]] | None = None
    ) -> None:
        """``snapshot``: the engine's latest metrics; ``local``: counters kept in this process, summed
        with the engine's of the same name (the HTTP side's refusals at arrival)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot, local))
        self.tenants = TenantMetrics(PREFIX)  # by the request's user, the heavy ones labelled
        self.registry.register(self.tenants)
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.streams_stalled = Counter(
            f"{PREFIX}_streams_stalled",
            "streams whose client took nothing for the stall timeout (their requests aborted)",
            registry=self.registry,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "time between consecutive generated tokens of a request",
            buckets=(0.001, 0.0025, *_LATENCY_BUCKETS),
            registry=self.registry,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stages = {
            stage: Histogram(f"{PREFIX}_{name}", doc, buckets=_PATH_BUCKETS, registry=self.registry)
            for stage, (name, doc) in PATH_STAGES.items()
        }
        self.gc_pause = Histogram(
            f"{PREFIX}_http_gc_pause_seconds",
            "the HTTP process's cyclic GC passes, any generation (the event loop stops for each)",
            buckets=(0.001, 0.0025, *_LATENCY_BUCKETS),
            registry=self.registry,
        )
        self.idle_trim = Histogram(
            f"{PREFIX}_http_idle_trim_seconds",
            "the HTTP process's trims once idle (a full GC pass, then malloc_trim; serving/host_trim.py)",
            buckets=(0.001, 0.0025, *_LATENCY_BUCKETS),
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            f"{PREFIX}_event_loop_lag_seconds",
            "how late the HTTP process's event loop ran a timer due every LOOP_TICK_S: every request's "
            "routing, every streamed chunk and every refusal waits that long",
            buckets=(0.001, 0.0025, *_LATENCY_BUCKETS),
            registry=self.registry,
        )

    def watch_gc(self) -> Callable[[], None]:
        """Time this process's cyclic GC passes (``gc_tuning.watch_gc``); returns the unwatch."""
        return watch_gc(self.gc_pause.observe)

    async def watch_loop_lag(self, tick: float = LOOP_TICK_S) -> None:
        """Run for the app's lifetime: how late the loop wakes up from ``tick`` s sleeps (a loop busy
        with streams or request handling delays everything it serves by that much)."""
        clock = asyncio.get_running_loop().time
        while True:
            due = clock() + tick
            await asyncio.sleep(tick)
            self.loop_lag.observe(max(0.0, clock() - due))

    # LatencyObserver (called on the engine thread; prometheus-client is thread-safe)
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(max(0.0, seconds))

    def inter_token(self, seconds: float, count: int) -> None:
        for _ in range(min(count, 4096)):
            self.itl.observe(max(0.0, seconds))

    def request_done(self, seconds: float) -> None:
        self.e2e.observe(max(0.0, seconds))

    def tenant_done(
        self, tenant: str | None, computed: int, cached: int, generated: int, queue_s: float
    ) -> None:
        self.tenants.done(tenant, computed, cached, generated, queue_s)

    def path(self, stage: str, seconds: float) -> None:
        """One stage of ``PATH_STAGES`` (any thread)."""
        self.stages[stage].observe(max(0.0, seconds))
