"""Auto backend: per step, cascade attention when sharing pays for its extra work, else per sequence.

Cascade saves KV reads (each shared segment is read once instead of once per holder) but adds work:
one gather + one attention launch per segment, and an LSE merge of every row that holds a segment.
With little sharing, or too few stacked query rows to fill a matrix product, the per-sequence path
is as fast or faster. ``cascade_pays_off`` is the whole decision, a small documented cost model whose
constants are meant to be calibrated from ``benchmarks/attention_cpu.py`` (and its GPU sibling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixserve.attention.backend import AttentionBackend, register_backend
from prefixserve.attention.cascade import cascade_attention, cascade_attention_lse
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.decode_plans import DecodePlans
from prefixserve.attention.planning.plan import SharedPlan, fold_segments, make_plan, unshared_plan


@dataclass(frozen=True, slots=True)
class CascadeCost:
    """Constants of the cost model (KV token-rows are the unit of work)."""

    max_read_fraction: float = 0.8  # cascade must cut KV reads to at most this share of the logical reads
    min_stacked_rows: int = 8  # a segment's rows * group below this is not worth its own launch
    segment_overhead_rows: int = 64  # fixed cost of one segment (gather + launch + merge) in KV rows
    # A segment whose holders would re-read fewer KV rows than this without it ((holders - 1) x its
    # rows) is attended in their own parts instead (``fold_segments``): its own call and LSE merge
    # cost more. CPU, default model, B=32 decode over a 1.4K-token shared prefix: nine one-block
    # segments of 2-8 holders cost 0.12 ms each per layer, about 330 KV rows of the own-part attention
    # (0.36 us a row); folding them took a layer's attention from 3.2 to 2.1 ms.
    min_segment_saving: int = 256


def cascade_pays_off(
    plan: SharedPlan, logical_kv_tokens: int, group: int = 4, cost: CascadeCost | None = None
) -> bool:
    """Decide whether the cascade path beats the per-sequence path for this step.

    Cascade wins when it has at least one segment worth stacking (rows * group >= min_stacked_rows),
    reads at most ``max_read_fraction`` of the KV the per-sequence path reads, and the KV rows it saves
    exceed the fixed per-segment overhead. ``group`` is q_heads / kv_heads (unknown at prepare time,
    so it is a hint; Llama-3-8B has 4).
    """
    cost = cost or CascadeCost()
    if plan.num_segments == 0 or logical_kv_tokens <= 0:
        return False
    if plan.kv_tokens_read > cost.max_read_fraction * logical_kv_tokens:
        return False
    widest = max(plan.segment_rows_host(g) for g in range(plan.num_segments))
    if widest * group < cost.min_stacked_rows:
        return False
    saved = logical_kv_tokens - plan.kv_tokens_read
    return saved >= cost.segment_overhead_rows * plan.num_segments


def small_segments(
    plan: SharedPlan, block_size: int, cost: CascadeCost | None = None, min_saving: int | None = None
) -> np.ndarray:
    """[G] bool: the whole-block segments that save fewer KV rows than ``min_saving`` (default:
    ``cost.min_segment_saving``)."""
    cost = cost or CascadeCost()
    min_saving = cost.min_segment_saving if min_saving is None else min_saving
    holders = np.array([len(h) for h in plan.seg_holders_host], dtype=np.int64)  # [G]
    tokens = np.asarray(plan.seg_num_tokens_host, dtype=np.int64).reshape(-1)  # [G]
    whole = tokens == np.diff(np.asarray(plan.seg_block_start_host, dtype=np.int64)) * block_size
    return whole & ((holders - 1) * tokens < min_saving)


@dataclass(frozen=True, slots=True)
class GpuCascadeCost:
    """Constants of the GPU rule: KV bytes not re-read, in time, against the shared path's extra cost.

    ``bandwidth`` is the rate at which the plain paged kernel reads KV that the shared path would not:
    on the H200 it read 1.07 GB (B=64, 4,096-token shared prefix) in 0.177 ms, about 6 TB/s, above HBM
    because the re-read prefix partly hits L2 (docs/benchmarks/attention.md). ``overhead_s`` is the
    shared path's extra cost per layer over the plain paged one in the eager engine, measured on the
    H200 (docs/kernels.md §2.7): at B=64, P=4K its step took 7-9 ms more over 32 layers
    (two more launches, the per-step plan, layout and first-layer binding), about 250 us per layer,
    although its attention kernels alone are faster. The eager step is host-bound, so GPU time saved
    below that does not show. With it, the shared path is taken at B=256, P=4K (saves ~0.7 ms of
    reads per layer) and not at B=64, P=4K (~0.18 ms). Lower it once decode runs under CUDA graphs.
    ``kv_bytes_per_token`` (K and V of one token in one layer) is learned
    from the first forward; the default is Llama-3-8B in bf16 (2 x 8 heads x 128 x 2 bytes).
    """

    bandwidth: float = 6.0e12
    overhead_s: float = 250e-6
    kv_bytes_per_token: int = 4096
    # Every segment must stack at least this many query rows (holders x group). Measured in the eager
    # engine on the H200 (docs/benchmarks/throughput.md, 8B shapes): with 64 holders (256 rows) the
    # shared path lost at P=1K and 16K (0.84x, 0.71x) and tied at 4K; with n=8 samples per prompt the
    # per-prompt segments (8 holders, 32 rows) made it lose 0.62x; from 256 holders (1,024 rows) up it
    # won up to 2.83x. Small segments cost a launch's worth of work each and save little.
    min_segment_rows: int = 512
    # Segments saving fewer KV rows than this ((holders - 1) x rows) are folded into their holders' own
    # parts (``fold_segments``), as on the CPU. Prompt Cache decode (H200, 64 requests importing 10 of
    # 12 modules): the question blocks that requests with one module subset share made about 15 of a
    # step's 27 segments, each a shared-kernel tile per KV head and a merge part per row for a few
    # hundred KB of reads saved.
    min_segment_saving: int = 256


def gpu_cascade_pays_off(
    plan: SharedPlan,
    logical_kv_tokens: int,
    kv_bytes_per_token: int,
    cost: GpuCascadeCost | None = None,
    group: int = 4,
) -> bool:
    """True when every segment stacks enough rows and the KV-read time saved exceeds the extra cost.

    ``group`` is q heads per KV head (a hint at prepare time; Llama-3-8B has 4).
    """
    cost = cost or GpuCascadeCost()
    if plan.num_segments == 0:
        return False
    if min(plan.segment_rows_host(g) for g in range(plan.num_segments)) * group < cost.min_segment_rows:
        return False
    saved_bytes = (logical_kv_tokens - plan.kv_tokens_read) * kv_bytes_per_token
    return saved_bytes / cost.bandwidth >= cost.overhead_s


@register_backend
class AutoBackend(AttentionBackend):
    """Per step: cascade when ``cascade_pays_off``, else the same code with no segments (per sequence).

    On CUDA with Triton installed, each step goes either to the Triton shared-segment path or to the
    plain paged kernel (the same backend with no segments), by ``gpu_cascade_pays_off``: the shared
    path costs two launches more per layer, which an eager step pays on the host, so it is taken only
    when the KV reads it saves are worth more than that (docs/benchmarks/gpu_engine_smoke.md).
    """

    name = "auto"
    takes_sinks = True
    group_hint: int = 4
    cost: CascadeCost = CascadeCost()
    gpu_cost: GpuCascadeCost = GpuCascadeCost()
    # Under a CUDA graph the shared path's extra launches cost no host time; what is left is the
    # merge kernel and the dependent-launch latency, about 10 us per layer (docs/kernels.md §2.7).
    # Recalibrated from docs/benchmarks/throughput.md (graphed engine).
    graph_cost: GpuCascadeCost = GpuCascadeCost(overhead_s=10e-6, min_segment_rows=0)

    def __init__(self) -> None:
        self._gpu: AttentionBackend | None = None
        self._kv_bytes_per_token: int | None = None  # learned from the first forward's cache
        self.decode_plans = DecodePlans()  # graphed decode steps: the plan carried on while it holds

    def _gpu_backend(self, device: torch.device) -> AttentionBackend | None:
        if device.type != "cuda":
            return None
        if self._gpu is None:
            try:
                from prefixserve.attention.triton_backend import TritonBackend

                self._gpu = TritonBackend()
            except ImportError:
                return None
        return self._gpu

    def prepare(self, meta: AttentionMetadata) -> None:
        gpu = self._gpu_backend(meta.seq_lens.device)
        if gpu is not None:
            self._prepare_gpu(gpu, meta)
            return
        plan = make_plan(meta)
        plan = fold_segments(plan, small_segments(plan, meta.block_size, self.cost), meta.block_size)
        logical = meta.logical_kv_tokens()
        # a partly filled module block has holes that only the segment path skips: no choice then
        use = plan.has_holes or cascade_pays_off(plan, logical, self.group_hint, self.cost)
        meta.plan = plan if use else unshared_plan(meta)
        meta.stats["cascade"] = 1.0 if use else 0.0
        meta.stats["kv_tokens_read"] = float(plan.kv_tokens_read if use else logical)
        meta.stats["kv_tokens_logical"] = float(logical)
        meta.stats["shared_segments"] = float(plan.num_segments if use else 0)

    def _prepare_gpu(self, gpu: Any, meta: AttentionMetadata) -> None:
        """Plan on the host, then install the shared plan or the plain paged step by the GPU cost rule."""
        from prefixserve.attention.planning.step_plan import host_plan

        plan = self._folded(host_plan(meta), meta.block_size, self.gpu_cost.min_segment_saving)
        logical = meta.logical_kv_tokens()
        kv_bytes = self._kv_bytes_per_token or self.gpu_cost.kv_bytes_per_token
        pays = plan.has_holes or gpu_cascade_pays_off(plan, logical, kv_bytes, self.gpu_cost, self.group_hint)
        context = gpu.takes_context(meta)
        if context and not pays:  # every segment back in its holders' own parts, then the context's
            plan = fold_segments(plan, np.ones(plan.num_segments, dtype=bool), meta.block_size)
        if pays or context:
            gpu.install(meta, gpu.with_context(plan, meta) if context else plan)
            return
        meta.plan = gpu._paged_step(meta)
        meta.stats["cascade"] = 0.0
        meta.stats["kv_tokens_read"] = float(logical)
        meta.stats["kv_tokens_logical"] = float(logical)
        meta.stats["shared_segments"] = 0.0

    @staticmethod
    def _folded(plan: SharedPlan, block_size: int, min_saving: int) -> SharedPlan:
        """``plan`` with the segments that save fewer than ``min_saving`` KV rows in own parts."""
        return fold_segments(plan, small_segments(plan, block_size, min_saving=min_saving), block_size)

    def graph_step(self, meta: AttentionMetadata, shape: Any, bucket: int) -> Any:
        """A decode step for a captured graph: shared segments or plain paged, by ``graph_cost``."""
        if self._gpu_backend(shape.device) is None:
            return None
        from prefixserve.attention.graph_attention import paged_graph_step, shared_graph_step
        from prefixserve.attention.planning.step_plan import host_plan

        saving = self.graph_cost.min_segment_saving
        plan = self.decode_plans.plan(meta, lambda m: self._folded(host_plan(m), m.block_size, saving))
        meta.plan = plan  # the host plan: sliding layers' window plans follow it (window_graph.py)
        cache_dtype = shape.kv_dtype or shape.dtype  # an e4m3 cache's tokens are half bf16's bytes
        kv_bytes = 2 * shape.kv_heads * shape.head_dim * torch.empty(0, dtype=cache_dtype).element_size()
        logical = meta.logical_kv_tokens()
        if plan.has_holes or gpu_cascade_pays_off(plan, logical, kv_bytes, self.graph_cost, shape.group):
            step = shared_graph_step(meta, plan, shape, bucket)
        else:
            step = paged_graph_step(meta, shape, bucket)
        meta.stats.update(step.stats)
        return step

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._gpu is not None and q.device.type == "cuda":
            if self._kv_bytes_per_token is None:
                self._kv_bytes_per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
            return self._gpu.forward(q, k_cache, v_cache, meta, scale)
        return cascade_attention(q, k_cache, v_cache, meta, meta.plan, scale)

    def forward_with_lse(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if self._gpu is not None and q.device.type == "cuda":
            return self._gpu.forward_with_lse(q, k_cache, v_cache, meta, scale)
        return cascade_attention_lse(q, k_cache, v_cache, meta, meta.plan, scale)
