"""Mixture-of-experts families: Qwen3-MoE (Qwen3's layer, experts on every ``decoder_sparse_step``-th
layer but ``mlp_only_layers``) and Mixtral (Mistral's layer, experts on every layer). Both route by a
softmax over every expert, then the top k; Mixtral always renormalises the k, Qwen3-MoE with
``norm_topk_prob``."""

from __future__ import annotations

import re
from typing import Any

from prefixserve.model.families import llama, qwen3


def experts_fields(raw: dict[str, Any], width_key: str) -> dict[str, Any]:
    """The experts' count, k and width (transformers 5 writes ``num_local_experts`` for Qwen3-MoE's
    ``num_experts`` too)."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise ValueError("a mixture-of-experts config needs num_experts (or num_local_experts)")
    if raw.get(width_key) is None:
        raise ValueError(f"a mixture-of-experts config needs {width_key} (each expert's width)")
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(raw.get("num_experts_per_tok", 0)),
        "moe_intermediate_size": int(raw[width_key]),
    }


def qwen3_moe_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    fields = qwen3.config_fields(raw, family)
    fields.update(
        experts_fields(raw, "moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        mlp_only_layers=[int(i) for i in raw.get("mlp_only_layers") or []],
        decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
    )
    return fields


def mixtral_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    fields = llama.config_fields(raw, "mistral")  # Mistral's attention (its window, if any)
    fields.update(experts_fields(raw, "intermediate_size"), norm_topk_prob=True, architecture=family)
    return fields


_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def mixtral_name(name: str) -> str:
    """Mixtral's checkpoint names in HF's Qwen-style MoE names, which the model uses."""
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
