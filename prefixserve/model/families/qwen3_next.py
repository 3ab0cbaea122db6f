"""Linear-attention hybrids: Qwen3-Next and Qwen3.5 (dense and MoE text models). Layers of Gated
DeltaNet (``LINEAR``: a recurrent state per head and a short causal convolution, ``model/gated_delta.py``)
between full-attention layers (three to one by default, HF's ``full_attention_interval``). Both read
as HF's config classes resolve them:

- the full layers: QK-norm, q_proj doubled into a per-head output gate (``attn_output_gate``), RoPE on
  the first ``partial_rotary_factor`` of each head (``partial``: ``model/rotary.partial_inv_freq``);
- norms that scale by (1 + w) (folded at load), but the DeltaNet's gated norm scales by w;
- experts (Qwen3-Next on every ``decoder_sparse_step``-th layer but ``mlp_only_layers``; Qwen3.5-MoE
  on every layer) with a shared expert behind a sigmoid gate.

A multimodal Qwen3.5 checkpoint serves its language model (``text_config``), as Gemma's do.
"""

from __future__ import annotations

from typing import Any

from prefixserve.model.families.base import base_fields
from prefixserve.model.families.gemma3 import language_config
from prefixserve.model.families.moe import experts_fields
from prefixserve.model.layer_types import FULL, LINEAR


def _layer_types(raw: dict[str, Any], layers: int) -> list[str]:
    given = raw.get("layer_types")
    if given:
        return list(given)
    interval = int(raw.get("full_attention_interval", 4))
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]


def _partial_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Our ``partial`` RoPE from HF's ``rope_parameters`` (or the older top-level fields), or as
    ``to_hf_dict`` wrote it back. Only the default RoPE is known with a partial rotation."""
    written = raw.get("rope_scaling") or {}
    if written.get("rope_type") == "partial":
        return dict(written)
    params = dict(raw.get("rope_parameters") or {})
    kind = params.get("rope_type", "default")
    if kind not in ("default", None):
        raise ValueError(f"{kind!r} RoPE is not supported for Qwen3.5 / Qwen3-Next (default is)")
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    return {"rope_type": "partial", "partial_rotary_factor": float(factor)}


def config_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    raw = language_config(raw)
    fields = base_fields(raw, family)
    params = raw.get("rope_parameters") or {}
    fields.update(
        layer_types=_layer_types(raw, fields["num_hidden_layers"]),
        rope_theta=float(raw.get("rope_theta", params.get("rope_theta", 10000.0))),
        rope_scaling=_partial_rope(raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qk_norm=True,
        norm_weight_offset=1.0,
        attn_output_gate=bool(raw.get("attn_output_gate", True)),
        linear_num_key_heads=int(raw.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(raw.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(raw.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(raw.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
    )
    if not fields["attn_output_gate"]:
        raise ValueError("attn_output_gate=False is not supported (Qwen3.5 and Qwen3-Next gate their output)")
    if raw.get("num_experts", raw.get("num_local_experts")):
        fields.update(
            experts_fields(raw, "moe_intermediate_size"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            mlp_only_layers=[int(i) for i in raw.get("mlp_only_layers") or []],
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        )
    return fields
