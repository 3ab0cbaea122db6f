"""Gemma 4 (text, dense): Gemma 3's layer (sliding and global layers, QK-norm, sandwich norms, GELU,
scaled embeddings, final soft-cap) with what Gemma 4 changes, each read as HF's ``Gemma4TextConfig``
resolves it:

- the global layers' own head size and KV heads (``per_layer_config``, or the older
  ``global_head_dim`` (default 512) and ``num_global_key_value_heads``), their ``proportional`` RoPE
  (``partial_rotary_factor``); the last layer is always global, as HF forces it;
- ``attention_k_eq_v``: the global layers' V is their K projection; every V head RMS-normed without a
  weight; softmax scale 1 (QK-norm does the scaling); norms that scale by ``w`` (not Gemma 3's 1 + w);
- ``num_kv_shared_layers``: the last layers read the KV of the last earlier layer of their type;
  ``use_double_wide_mlp`` doubles those layers' MLPs;
- per-layer input embeddings (``hidden_size_per_layer_input``, on by default as in HF) and each
  layer's ``layer_scalar``.

- ``enable_moe_block``: each layer's experts beside its dense MLP, with a router of their own
  (``moe.Gemma4Router``) and norms before and after (``moe_beside_mlp``).

Refused, naming the field: bidirectional attention (``"all"``).
"""

from __future__ import annotations

import logging
from typing import Any

from prefixserve.model.families.base import base_fields
from prefixserve.model.families.gemma3 import language_config
from prefixserve.model.layer_types import FULL, SLIDING

log = logging.getLogger(__name__)

# HF's Gemma4TextConfig defaults, where a config.json may leave a field out
DEFAULT_ROPES = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_PER_LAYER_INPUT = 256
DEFAULT_PER_LAYER_VOCAB = 262_144


def _layer_types(raw: dict[str, Any], layers: int) -> list[str]:
    """As written (five sliding to one global if absent), the last layer made global as HF makes it."""
    types = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
    if types and types[-1] != FULL:
        log.warning("Gemma 4's last layer is global: layer_types[-1]=%r read as %r", types[-1], FULL)
        types[-1] = FULL
    return types


def _ropes(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``rope_parameters`` per layer type (keys that are not a layer's, as some configs carry at the
    top, are left); HF's defaults when there are none."""
    params = raw.get("rope_parameters") or DEFAULT_ROPES
    return {kind: dict(p) for kind, p in params.items() if isinstance(p, dict)}


def _per_layer_config(raw: dict[str, Any], types: list[str]) -> dict[int, dict[str, int]]:
    """Each global layer's head size and KV heads, written out for every one of them (so the config
    reads back the same after ``to_hf_dict``). ``per_layer_config`` as written (JSON keys are strings),
    else HF's older fields: ``global_head_dim`` (default 512) and, only with ``attention_k_eq_v``,
    ``num_global_key_value_heads``."""
    given = raw.get("per_layer_config")
    if given is not None:
        out = {int(i): dict(sizes) for i, sizes in given.items()}
    else:
        sizes = {"head_dim": int(raw.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM)}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
            sizes["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
        out = {i: dict(sizes) for i, kind in enumerate(types) if kind == FULL}
    for i, kind in enumerate(types):
        if kind == FULL and i not in out:
            out[i] = {}
    return out


def config_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    raw = language_config(raw)
    if raw.get("use_bidirectional_attention") == "all":
        raise ValueError(
            "use_bidirectional_attention='all' is not supported: prefixserve serves causal models"
        )
    fields = base_fields(raw, family)
    types = _layer_types(raw, fields["num_hidden_layers"])
    per_layer = _per_layer_config(raw, types)
    for sizes in per_layer.values():  # written out whole (an empty entry: the config-wide sizes)
        sizes.setdefault("head_dim", fields["head_dim"])
        sizes.setdefault("num_key_value_heads", fields["num_key_value_heads"])
    per_layer_width = raw.get("hidden_size_per_layer_input", DEFAULT_PER_LAYER_INPUT)
    fields.update(
        layer_types=types,
        sliding_window=int(raw.get("sliding_window") or 512),
        rope_by_layer_type=_ropes(raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131_072)),
        qk_norm=True,
        sandwich_norms=True,
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        embed_scale=fields["hidden_size"] ** 0.5,
        attention_scale=1.0,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        per_layer_config=per_layer,
        attention_k_eq_v=bool(raw.get("attention_k_eq_v", False)),
        v_norm=True,
        num_kv_shared_layers=int(raw.get("num_kv_shared_layers") or 0),
        use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=int(per_layer_width or 0),
        vocab_size_per_layer_input=int(raw.get("vocab_size_per_layer_input") or DEFAULT_PER_LAYER_VOCAB),
        layer_scalar=True,
    )
    if raw.get("enable_moe_block") or raw.get("moe_beside_mlp"):  # HF's name, or ours written back
        fields.update(
            num_experts=int(raw.get("num_experts") or 0),
            num_experts_per_tok=int(raw.get("top_k_experts") or raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            norm_topk_prob=True,
            moe_beside_mlp=True,
        )
        if not fields["num_experts"]:
            raise ValueError("enable_moe_block=True needs num_experts >= 1")
    return fields
