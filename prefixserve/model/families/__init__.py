"""The supported model families: each module reads its config.json into ``ModelConfig``'s fields.

The transformer itself is one set of blocks (``model/llama.py``) built layer by layer from the config;
a family only says how its config names things and which blocks its layers use (QK-norm, sandwich
norms, sliding windows, the activation). Adding a family is a short module here and a line in
``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixserve.model.families import gemma3, gemma4, gpt_oss, llama, moe, qwen3, qwen3_next

ConfigReader = Callable[[dict[str, Any], str], dict[str, Any]]

# family name -> (what reads its config.json into ModelConfig's fields, HF architecture names, HF
# model_type names)
FAMILIES: dict[str, tuple[ConfigReader, tuple[str, ...], tuple[str, ...]]] = {
    "llama": (llama.config_fields, ("LlamaForCausalLM",), ("llama",)),
    "mistral": (llama.config_fields, ("MistralForCausalLM",), ("mistral",)),
    "qwen2": (llama.config_fields, ("Qwen2ForCausalLM",), ("qwen2",)),
    "qwen3": (qwen3.config_fields, ("Qwen3ForCausalLM",), ("qwen3",)),
    # the multimodal checkpoint (Gemma 3 4B-27B as published) serves its language model: text only
    "gemma3": (
        gemma3.config_fields,
        ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        ("gemma3_text", "gemma3"),
    ),
    # dense only (the MoE block is refused); the multimodal checkpoint serves its language model
    "gemma4": (
        gemma4.config_fields,
        ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
        ("gemma4_text", "gemma4"),
    ),
    "qwen3_moe": (moe.qwen3_moe_fields, ("Qwen3MoeForCausalLM",), ("qwen3_moe",)),
    "mixtral": (moe.mixtral_fields, ("MixtralForCausalLM",), ("mixtral",)),
    "gpt_oss": (gpt_oss.config_fields, ("GptOssForCausalLM",), ("gpt_oss",)),
    # linear-attention hybrids: Gated DeltaNet layers between full ones (the multimodal Qwen3.5
    # checkpoints serve their language model)
    "qwen3_next": (qwen3_next.config_fields, ("Qwen3NextForCausalLM",), ("qwen3_next",)),
    "qwen3_5": (
        qwen3_next.config_fields,
        ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
        ("qwen3_5_text", "qwen3_5"),
    ),
    "qwen3_5_moe": (
        qwen3_next.config_fields,
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        ("qwen3_5_moe_text", "qwen3_5_moe"),
    ),
}


def supported() -> str:
    return ", ".join(arch for _, archs, _ in FAMILIES.values() for arch in archs)


def family_of(raw: dict[str, Any]) -> str:
    """The family of an HF config dict, by ``architectures`` first, then ``model_type``."""
    archs = raw.get("architectures") or []
    for name, (_, arch_names, types) in FAMILIES.items():
        if (archs and archs[0] in arch_names) or (not archs and raw.get("model_type") in types):
            return name
    named = archs[0] if archs else raw.get("model_type")
    raise ValueError(f"unsupported architecture {named!r}; supported families: {supported()}")


def family_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig``'s keyword arguments from an HF config dict, read by its family."""
    name = family_of(raw)
    return FAMILIES[name][0](raw, name)


def write_config(config: Any) -> dict[str, Any]:  # a ModelConfig
    """An HF-style config.json of ``config`` (its family's architecture name and HF keys)."""
    out = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("eos_token_ids", "architecture", "rope_by_layer_type") and v not in (None, [], {})
    }
    _, archs, types = FAMILIES[config.architecture]
    out["eos_token_id"] = config.eos_token_ids
    out["architectures"] = [archs[0]]
    out["model_type"] = types[0]
    if config.rope_by_layer_type:
        out["rope_parameters"] = dict(config.rope_by_layer_type)
    return out


def checkpoint_name(family: str, name: str) -> str:
    """A checkpoint tensor's name as the model names it: the family's own names mapped (Mixtral's
    ``block_sparse_moe.experts.{e}.w1``/``w3``/``w2`` are ``mlp.experts.{e}.gate_proj``/``up_proj``/
    ``down_proj``), others as they are."""
    if family == "mixtral":
        return moe.mixtral_name(name)
    if family == "gpt_oss":
        return gpt_oss.checkpoint_name(name)
    return name
