"""Model setup: dummy (random-weight) model configs written where the engine and the server read them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# A Llama of two tiny layers with SmolLM2's vocabulary: smoke runs of every code path on the CPU in
# seconds (the tokenizer comes from the default model's files).
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def shipped_config(name: str) -> dict[str, Any]:
    """One of the model configs shipped with prefixserve (``dummy:NAME``), as a dict to modify."""
    from prefixserve.model.loader import CONFIG_DIR

    return dict(json.loads((CONFIG_DIR / f"{name}.json").read_text()))


def dummy_model(config: dict[str, Any], folder: Path) -> str:
    """``config`` written to ``folder/config.json``; returns the ``dummy:PATH`` model name for it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return f"dummy:{path}"


def model_config(name: str) -> dict[str, Any]:
    """The config a model name resolves to (``dummy:llama-3.1-70b``, a folder, a GGUF), as a dict."""
    from prefixserve.model.loader import resolve_model

    return dict(json.loads(resolve_model(name).path.read_text()))


def bf16_weights_GiB(model: str) -> float:
    """The model's weights in bf16, counted on the meta device (what one GPU would have to hold)."""
    import torch

    from prefixserve.model.config import ModelConfig
    from prefixserve.model.llama import LlamaForCausalLM
    from prefixserve.model.loader import resolve_model
    from prefixserve.model.memory_fit import GiB, weight_bytes

    with torch.device("meta"):
        meta = LlamaForCausalLM(ModelConfig.from_json(resolve_model(model).path)).to(torch.bfloat16)
    return weight_bytes(meta) / GiB
