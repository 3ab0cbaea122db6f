"""What one rank's decode step must do, counted from a model config: its FLOPs and the HBM bytes no
implementation can skip (each weight once, the shared prefix's KV once, every sequence's own KV once).

The counts feed ``benchmarks/power.py``'s linear energy model, whose step time at the board's cap is
(J/byte x bytes + J/FLOP x FLOPs) / (cap - floor): a lead, not a bound (a step at a lower clock than
the ceilings' GEMM pays less a FLOP and can beat it).
"""

from __future__ import annotations

from typing import Any


def decode_step_work(
    cfg: dict[str, Any], tp: int, batch: int, prefix: int, own: float, attention: bool = True
) -> dict[str, float]:
    """One rank's FLOPs and unavoidable bytes for a decode step of ``batch`` sequences sharing a
    ``prefix``-token run with ``own`` tokens of their own each (bf16 weights and KV). Without
    ``attention`` (the no-attention ceiling) only the matmuls count."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    dim = cfg.get("head_dim", hidden // heads)
    attention_params = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden  # qkv, o
    layer_params = attention_params + 3 * hidden * cfg["intermediate_size"]  # gate, up, down
    # the layers' matrices and lm_head, split over the ranks; the embedding reads B rows only
    params = (layers * layer_params + cfg["vocab_size"] * hidden) / tp
    work = {"flops": 2.0 * batch * params, "bytes": 2.0 * params}
    if attention:
        rank_kv_heads = max(kv_heads / tp, 1.0)  # more ranks than KV heads: each holds a replica
        work["flops"] += 4.0 * batch * (heads / tp) * dim * (prefix + own) * layers  # Q K^T and P V
        work["bytes"] += 4.0 * layers * rank_kv_heads * dim * (prefix + batch * own)  # K and V, bf16
    return work


def capped_step_ms(work: dict[str, float], model: dict[str, float]) -> float:
    """The step's time at the board's cap by the linear energy model (``benchmarks.power.ceilings``)."""
    joules = model["j_per_byte_read"] * work["bytes"] + model["j_per_flop"] * work["flops"]
    return 1e3 * joules / (model["cap_w"] - model["floor_w"])
