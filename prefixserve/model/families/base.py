"""The config.json fields every family names alike (sizes, norms, RoPE, token ids)."""

from __future__ import annotations

from typing import Any

from prefixserve.model.layer_types import FULL, LAYER_TYPES, SLIDING


def base_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from the keys that Llama, Qwen and Gemma configs share."""
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    rope_params = raw.get("rope_parameters") or {}
    if any(kind in rope_params for kind in LAYER_TYPES):  # per layer type (Gemma): read by the family
        rope_params = {}
    rope_scaling = raw.get("rope_scaling") or (
        rope_params if rope_params.get("rope_type", "default") != "default" else None
    )
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(raw["intermediate_size"]),
        "num_hidden_layers": int(raw["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
        "rope_theta": float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "attention_bias": bool(raw.get("attention_bias", False)),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": eos_ids,
        "architecture": family,
    }


def layer_types(raw: dict[str, Any], sliding: list[bool] | None) -> list[str]:
    """The config's ``layer_types`` as written, else one per layer from ``sliding`` (None: all full).

    Left as written even when wrong: ``ModelConfig`` checks it and names the problem."""
    given = raw.get("layer_types")
    if given is not None:
        return list(given)
    if sliding is None or not any(sliding):
        return []
    return [SLIDING if s else FULL for s in sliding]


def qwen_sliding(raw: dict[str, Any]) -> tuple[int | None, list[bool] | None]:
    """Qwen2/Qwen3's rule: with ``use_sliding_window``, layers from ``max_window_layers`` on slide."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return None, None
    start = int(raw.get("max_window_layers", 0))
    return int(raw["sliding_window"]), [i >= start for i in range(int(raw["num_hidden_layers"]))]
