"""Read a GGUF file of a family the gguf package maps (Llama, Mixtral, Qwen2, Qwen3, Qwen3-MoE): config,
dequantized weights (HF names; a layer's stacked experts split into HF's per-expert tensors) and
tokenizer.

llama.cpp's converter permutes the rows of a Llama's q/k projections for its interleaved RoPE; we
undo that so the weights work with the HF (rotate-half) RoPE our model uses, exactly as transformers
does. Qwen's are written as they are (llama.cpp runs them with the rotate-half RoPE), so they are
read as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixserve.model.config import ModelConfig

GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3moe")  # general.architecture values read
FAMILY_OF = {"qwen3moe": "qwen3_moe"}  # where llama.cpp's architecture name is not the family's


class GGUFError(ValueError):
    """The file is not a GGUF model we can read (corrupt, truncated, or another architecture)."""


def _open(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises many kinds of errors on a bad file
        raise GGUFError(f"cannot read GGUF file {path}: {exc}") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not one of the GGUF families {list(GGUF_FAMILIES)}"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    experts = int(_field(reader, f"{arch}.expert_count", 0))
    moe = {}
    if experts:  # Qwen3-MoE's or Mixtral's (a llama with experts) experts
        width = int(
            _field(
                reader, f"{arch}.expert_feed_forward_length", _field(reader, f"{arch}.feed_forward_length")
            )
        )
        moe = {
            "num_experts": experts,
            "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
            "moe_intermediate_size": width,
            "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", True)),
            # the file says which layers hold experts by their routers
            "mlp_only_layers": [
                i
                for i in range(int(_field(reader, f"{arch}.block_count")))
                if f"blk.{i}.ffn_gate_inp.weight" not in names
            ],
        }
    return ModelConfig(
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(vocab) if vocab else 0)),
        hidden_size=hidden,
        intermediate_size=int(
            _field(reader, f"{arch}.feed_forward_length", moe.get("moe_intermediate_size", 0))
        ),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(
            _field(
                reader,
                f"{arch}.attention.key_length",
                _field(reader, f"{arch}.rope.dimension_count", hidden // heads),
            )
        ),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        architecture="mixtral" if arch == "llama" and experts else FAMILY_OF.get(arch, arch),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **moe,
    )


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the router
}
# a layer's experts stacked [E, rows, cols]: split into HF's ``mlp.experts.{e}.*_proj``
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# files written before llama.cpp stacked them (2023's Mixtral GGUFs): a tensor an expert, ``blk.L.ffn_gate.E``
_EXPERT_PARTS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE layout)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor in the file, dequantized."""
    from gguf import quants

    for t in reader.tensors:
        if t.name.startswith("rope_freqs"):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        arr = np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        permuted = config.architecture in ("llama", "mixtral")  # llama.cpp permutes a Llama's q and k only
        if permuted and (t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias")):
            arr = _unpermute(arr, config.num_attention_heads)
        elif permuted and (t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias")):
            arr = _unpermute(arr, config.num_key_value_heads)
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
            for e in range(arr.shape[0]):
                name = f"model.layers.{parts[1]}.mlp.experts.{e}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}"
                yield name, torch.from_numpy(np.ascontiguousarray(arr[e]))
            continue
        if parts[0] == "blk" and len(parts) == 5 and parts[2] in _EXPERT_PARTS and parts[3].isdigit():
            name = f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_EXPERT_PARTS[parts[2]]}.{parts[4]}"
            yield name, torch.from_numpy(np.ascontiguousarray(arr))
            continue
        yield hf_name(t.name), torch.from_numpy(np.ascontiguousarray(arr))  # writable copy


def load_gguf(path: Path) -> tuple[Any, ModelConfig]:
    """Open and validate a GGUF model file; returns (reader, config)."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = _open(path)
    return reader, read_gguf_config(reader, path)
