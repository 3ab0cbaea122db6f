"""Benchmark-only backend that skips attention (Hydragen's "no attention" throughput ceiling).

Projections, the KV writes, the MLP and sampling all still run; the attention output is the query
itself, so the model computes nonsense at the speed of everything except attention. Never use it for
real generations: it exists to measure how close the real backends come to that ceiling.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.attention.backend import AttentionBackend, register_backend
from prefixserve.attention.metadata import AttentionMetadata


@register_backend
class NoAttentionBackend(AttentionBackend):
    name = "none"
    takes_sinks = True

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.stats["kv_tokens_read"] = 0.0
        meta.stats["kv_tokens_logical"] = float(meta.logical_kv_tokens())

    def graph_step(self, meta: AttentionMetadata, shape: Any, bucket: int) -> Any:
        from prefixserve.attention.graph import GraphStep, NoAttentionGraph

        self.prepare(meta)
        return GraphStep(("none", bucket), {}, lambda: NoAttentionGraph(shape.device), windowed=True)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return q

    def forward_with_lse(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """q as it is, at an LSE no sink changes (the ceiling of a model with sinks)."""
        return q.float(), torch.full(q.shape[:2], float("inf"), device=q.device)
