"""Auto backend: per step, cascade attention when sharing pays for its extra work, else per sequence.

Cascade saves KV reads (each shared segment is read once instead of once per holder) but adds work:
one gather + one attention launch per segment, and an LSE merge of every row that holds a segment.
With little sharing, or too few stacked query rows to fill a matrix product, the per-sequence path
is as fast or faster. ``cascade_pays_off`` is the whole decision, a small documented cost model whose
constants are meant to be calibrated from ``benchmarks/attention_cpu.py`` (and its GPU sibling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.attention.backend import AttentionBackend, register_backend
from prefixserve.attention.cascade import cascade_attention
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.plan import SharedPlan, make_plan, unshared_plan


@dataclass(frozen=True, slots=True)
class CascadeCost:
    """Constants of the cost model (KV token-rows are the unit of work)."""

    max_read_fraction: float = 0.8  # cascade must cut KV reads to at most this share of the logical reads
    min_stacked_rows: int = 8  # a segment's rows * group below this is not worth its own launch
    segment_overhead_rows: int = 64  # fixed cost of one segment (gather + launch + merge) in KV rows


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


@register_backend
class AutoBackend(AttentionBackend):
    """Per step: cascade when ``cascade_pays_off``, else the same code with no segments (per sequence).

    On CUDA with Triton installed, steps go to the Triton backend (shared-segment + paged kernels),
    which measured never slower than the plain paged kernel (docs/benchmarks/attention.md).
    """

    name = "auto"
    group_hint: int = 4
    cost: CascadeCost = CascadeCost()

    def __init__(self) -> None:
        self._gpu: AttentionBackend | None = None

    def _gpu_backend(self, meta: AttentionMetadata) -> AttentionBackend | None:
        if meta.seq_lens.device.type != "cuda":
            return None
        if self._gpu is None:
            try:
                from prefixserve.attention.kernels.triton_backend import TritonBackend

                self._gpu = TritonBackend()
            except ImportError:
                return None
        return self._gpu

    def prepare(self, meta: AttentionMetadata) -> None:
        gpu = self._gpu_backend(meta)
        if gpu is not None:
            gpu.prepare(meta)
            return
        plan = make_plan(meta)
        logical = meta.logical_kv_tokens()
        use = cascade_pays_off(plan, logical, self.group_hint, self.cost)
        meta.plan = plan if use else unshared_plan(meta)
        meta.stats["cascade"] = 1.0 if use else 0.0
        meta.stats["kv_tokens_read"] = float(plan.kv_tokens_read if use else logical)
        meta.stats["kv_tokens_logical"] = float(logical)
        meta.stats["shared_segments"] = float(plan.num_segments if use else 0)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._gpu is not None and q.device.type == "cuda":
            return self._gpu.forward(q, k_cache, v_cache, meta, scale)
        return cascade_attention(q, k_cache, v_cache, meta, meta.plan, scale)
