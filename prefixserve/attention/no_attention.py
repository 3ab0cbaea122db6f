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

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.stats["kv_tokens_read"] = 0.0
        meta.stats["kv_tokens_logical"] = float(meta.logical_kv_tokens())

    def graph_step(self, meta: AttentionMetadata, shape: Any, bucket: int) -> Any:
        from prefixserve.attention.graph import GraphStep, NoAttentionGraph

        self.prepare(meta)
        return GraphStep(("none", bucket), {}, lambda: NoAttentionGraph(shape.device), windowed=True)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return q
