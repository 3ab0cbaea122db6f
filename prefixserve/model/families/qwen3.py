"""Qwen3 (dense): Llama's layer with an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

from typing import Any

from prefixserve.model.families.base import base_fields, layer_types, qwen_sliding


def config_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    fields = base_fields(raw, family)
    window, sliding = qwen_sliding(raw)
    types = layer_types(raw, sliding)
    fields.update(qk_norm=True, layer_types=types, sliding_window=window if types else None)
    if types and window is None and raw.get("sliding_window") is not None:
        fields["sliding_window"] = int(raw["sliding_window"])
    return fields
