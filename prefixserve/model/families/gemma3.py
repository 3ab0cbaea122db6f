"""Gemma 3 (text): five sliding-window layers to one global, each type with its own RoPE; QK-norm,
norms before and after attention and the MLP, norms that scale by (1 + w), GELU (tanh), embeddings
scaled by sqrt(hidden), softmax scale from ``query_pre_attn_scalar``."""

from __future__ import annotations

from typing import Any

from prefixserve.model.families.base import base_fields, layer_types
from prefixserve.model.layer_types import FULL, SLIDING


def _ropes(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE per layer type: transformers 5 writes ``rope_parameters`` keyed by layer type; 4.x wrote
    the global ``rope_theta`` / ``rope_scaling`` and the local ``rope_local_base_freq``."""
    params = raw.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        return {kind: dict(p) for kind, p in params.items()}
    full = dict(raw.get("rope_scaling") or {})
    full["rope_theta"] = float(raw.get("rope_theta", 1_000_000.0))
    return {FULL: full, SLIDING: {"rope_theta": float(raw.get("rope_local_base_freq", 10_000.0))}}


def language_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a multimodal checkpoint's ``text_config`` (its tie of the
    embeddings stated at the top), else the config itself."""
    text = raw.get("text_config")
    if text is None:
        return raw
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return {**text, "tie_word_embeddings": tie}


def config_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    raw = language_config(raw)
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attn_logit_softcapping={raw['attn_logit_softcapping']} is not supported (Gemma 3 has none)"
        )
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: prefixserve serves causal models")
    fields = base_fields(raw, family)
    layers = fields["num_hidden_layers"]
    pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
    sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    scalar = float(raw.get("query_pre_attn_scalar", fields["head_dim"]))
    fields.update(
        layer_types=layer_types(raw, sliding),
        sliding_window=raw.get("sliding_window"),
        rope_by_layer_type=_ropes(raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qk_norm=True,
        sandwich_norms=True,
        norm_weight_offset=1.0,
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        embed_scale=fields["hidden_size"] ** 0.5,
        attention_scale=scalar**-0.5,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )
    if fields["sliding_window"] is not None:
        fields["sliding_window"] = int(fields["sliding_window"])
    return fields
