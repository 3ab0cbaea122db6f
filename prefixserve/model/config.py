"""The model's shape, read from an HF config.json or a GGUF file's metadata, described layer by layer.

Every family (``model/families/``) reads its config.json into one ``ModelConfig``: the sizes every
layer shares, then what may differ per layer (``layer_spec``): full or sliding-window attention and
the RoPE that layer type uses. A config that contradicts itself is refused here, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixserve.model.families import family_fields, write_config
from prefixserve.model.layer_types import FULL, LAYER_TYPES, SLIDING

__all__ = ["FULL", "LAYER_TYPES", "SLIDING", "LayerSpec", "ModelConfig", "RopeSpec"]

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One RoPE: its base and scaling (``rope_scaling`` items, sorted: hashable, so layers that use the
    same RoPE share one table of angles)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] = ()

    @property
    def scaling_dict(self) -> dict[str, Any]:
        return dict(self.scaling)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one decoder layer attends with: its type, window (sliding layers only) and RoPE."""

    kind: str  # FULL | SLIDING
    window: int | None  # keys a query sees, itself included (HF's ``sliding_window``); None: all
    rope: RopeSpec


def _rope_spec(theta: float, scaling: dict[str, Any] | None) -> RopeSpec:
    scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) in ("default", None):
        scaling = {}
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
    return RopeSpec(float(theta), frozen)


@dataclass(slots=True)
class ModelConfig:
    """Everything the transformer needs to know about its shape (HF config.json names, flattened)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"  # the family (``model/families``): llama, mistral, qwen2, qwen3, gemma3
    # ---- what differs between families and between layers ----
    layer_types: list[str] = field(default_factory=list)  # per layer FULL | SLIDING; empty: all FULL
    sliding_window: int | None = None  # the window of SLIDING layers
    # RoPE of a layer type where it differs from rope_theta / rope_scaling (Gemma: local and global)
    rope_by_layer_type: dict[str, dict[str, Any]] = field(default_factory=dict)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    norm_weight_offset: float = 0.0  # Gemma's norms scale by (1 + w): folded into w at load
    hidden_act: str = "silu"  # the gated MLP's activation
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
                f"{self.num_hidden_layers}: it needs one per layer"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types holds {unknown}: supported layer types are {list(LAYER_TYPES)}")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(
                f"layer_types has {SLIDING!r} layers but sliding_window is {self.sliding_window!r}: "
                "a sliding layer needs a window of at least one token"
            )
        unknown = sorted(set(self.rope_by_layer_type) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"RoPE given for layer types {unknown}; layer types are {list(LAYER_TYPES)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: {list(ACTIVATIONS)}"
            )
        for spec in {self.layer_spec(i).rope for i in range(self.num_hidden_layers)}:
            kind = spec.scaling_dict.get("rope_type", spec.scaling_dict.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {list(ROPE_TYPES)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, per byte of element size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def layer_spec(self, i: int) -> LayerSpec:
        """Layer ``i``'s attention type, window and RoPE."""
        kind = self.layer_types[i] if self.layer_types else FULL
        rope = self.rope_by_layer_type.get(kind)
        if rope is None:
            spec = _rope_spec(self.rope_theta, self.rope_scaling)
        else:
            spec = _rope_spec(rope.get("rope_theta", self.rope_theta), rope)
        return LayerSpec(kind, self.sliding_window if kind == SLIDING else None, spec)

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING in self.layer_types

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read an HF config.json dict of a supported family (``model/families``); an unknown
        architecture is refused, naming the supported ones."""
        return cls(**family_fields(raw))

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            raw = json.load(f)
        try:
            return cls.from_hf_dict(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config.json that ``from_hf_dict`` reads back to this config (what the weight
        cache writes beside the safetensors)."""
        return write_config(self)


# RoPE scalings ``model/llama.rope_inv_freq`` computes
ROPE_TYPES = ("default", "llama3", "linear")
