"""What a linear-attention hybrid (Qwen3.5, Qwen3-Next) changes in the engine, decided once at start.

Its Gated DeltaNet layers hold a state per sequence (``kv/state_slots.py``), not KV rows per token,
so what reuses KV rows computed elsewhere would hand those layers no state:

- prefix-cache hits resume from the linear layers' state snapshots (``kv/state_slots.py``): a hit
  is cut back to the last snapshot within it; with the prefix cache's host tier on, evicted snapshots
  go to host memory beside the KV blocks (``kv/snapshot_spill.py``);
- refused, naming why: Prompt Cache schemas (a module's rows cannot be reused out of position on a
  linear layer: its state depends on everything before it), speculative decoding (a rejected draft
  would have to roll the states back) and tensor parallelism.
"""

from __future__ import annotations

import logging

from prefixserve.config import EngineConfig
from prefixserve.model.config import ModelConfig

log = logging.getLogger(__name__)

SCHEMA_REFUSAL = (
    "Prompt Cache schemas are not supported on a linear-attention hybrid model: a module's cached rows "
    "cannot be reused out of position on its linear layers, whose state depends on every token before"
)


def hybrid_config(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """``config`` as a hybrid ``model`` runs it (unchanged for other models); refuses what it cannot."""
    if not model.is_hybrid:
        return config
    if config.schemas:
        raise ValueError(SCHEMA_REFUSAL)
    if config.speculative_config is not None:
        raise ValueError("speculative decoding is not supported on a linear-attention hybrid model")
    if config.tensor_parallel_size > 1:
        raise ValueError("tensor parallelism is not supported on a linear-attention hybrid model yet")
    if config.enable_prefix_caching:
        log.info(
            "linear-attention hybrid: prefix-cache hits resume from the linear layers' state snapshots, "
            "recomputing from the last one within the hit"
        )
    return config


__all__ = ["SCHEMA_REFUSAL", "hybrid_config"]
