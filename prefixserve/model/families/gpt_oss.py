"""gpt-oss: sliding (window 128) and full layers alternating, attention sinks, biases on q/k/v/o, YaRN
RoPE; every MLP a mixture of experts routed by the top k logits then a softmax over them, experts
with biases and a clamped SwiGLU. Its checkpoint stores each layer's experts as two stacked tensors
(gate and up columns interleaved; MXFP4 blocks as published, dequantized at load: ``model/mxfp4.py``)."""

from __future__ import annotations

from typing import Any

from prefixserve.model.families.base import base_fields, layer_types
from prefixserve.model.families.moe import experts_fields

WINDOW = 128  # GptOssConfig's sliding_window when a config leaves it out


def config_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """A config without ``layer_types`` alternates as ``GptOssConfig`` fills it in (sliding first):
    read as all full, such a model attended past its windows and its logits left HF's."""
    fields = base_fields(raw, family)
    window = raw.get("sliding_window", WINDOW)
    alternating = None if window is None else [i % 2 == 0 for i in range(int(raw["num_hidden_layers"]))]
    fields.update(
        experts_fields(raw, "intermediate_size"),
        layer_types=layer_types(raw, alternating),
        sliding_window=None if window is None else int(window),
        attention_bias=bool(raw.get("attention_bias", True)),
        o_proj_bias=bool(raw.get("attention_bias", True)),
        attention_sinks=True,
        router_rule="topk_softmax",
        router_bias=True,
        expert_bias=True,
        hidden_act="swiglu_oai",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
    return fields


_RENAMES = (
    (".mlp.router.", ".mlp.gate."),
    (".self_attn.o_proj.bias", ".self_attn.o_bias"),
)


def checkpoint_name(name: str) -> str:
    """gpt-oss's checkpoint names as the model names its tensors (the router is the MoE's ``gate``)."""
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name
