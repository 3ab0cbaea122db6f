"""Llama, Mistral and Qwen2: the plain layer (full attention, or Mistral's window on every layer)."""

from __future__ import annotations

from typing import Any

from prefixserve.model.families.base import base_fields, layer_types, qwen_sliding


def config_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    fields = base_fields(raw, family)
    layers = fields["num_hidden_layers"]
    window, sliding = None, None
    if family == "mistral" and raw.get("sliding_window") is not None:  # Mistral 7B v0.1: all layers
        window, sliding = int(raw["sliding_window"]), [True] * layers
    elif family == "qwen2":
        fields["attention_bias"] = bool(raw.get("attention_bias", True))  # q, k and v carry a bias
        window, sliding = qwen_sliding(raw)
    types = layer_types(raw, sliding)
    fields.update(layer_types=types, sliding_window=window if types else raw.get("sliding_window"))
    if not types:
        fields["sliding_window"] = None
    return fields
