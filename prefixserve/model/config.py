"""The model's shape, read from an HF config.json or a GGUF file's metadata, described layer by layer.

Every family (``model/families/``) reads its config.json into one ``ModelConfig``: the sizes every
layer shares, then what may differ per layer (``layer_spec``): full or sliding-window attention, the
RoPE that layer type uses, and (Gemma 4) the layer's head size and KV heads (``layer_kv_shape``),
whose KV cache it reads (``kv_source``) and its MLP's width. A config that contradicts itself is
refused here, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixserve.model.families import family_fields, write_config
from prefixserve.model.layer_types import FULL, LAYER_TYPES, LINEAR, SLIDING

__all__ = ["FULL", "LAYER_TYPES", "LINEAR", "SLIDING", "LayerSpec", "ModelConfig", "RopeSpec"]

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")  # swiglu_oai: gpt-oss's experts only


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One RoPE: its base and scaling (``rope_scaling`` items, sorted: hashable, so layers that use the
    same RoPE share one table of angles)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] = ()
    dim: int = 0  # the head size it rotates (a layer's ``head_dim``); 0: the config's

    @property
    def scaling_dict(self) -> dict[str, Any]:
        return dict(self.scaling)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one decoder layer attends with: its type, window (sliding layers only) and RoPE; its head
    size and KV heads; whether it reads another layer's KV cache instead of writing its own (Gemma 4's
    KV-shared layers), whether its V is its K projection (Gemma 4's ``attention_k_eq_v``), and its
    MLP's width."""

    kind: str  # FULL | SLIDING
    window: int | None  # keys a query sees, itself included (HF's ``sliding_window``); None: all
    rope: RopeSpec
    head_dim: int = 0  # of q, k and v
    kv_heads: int = 0
    shares_kv: bool = False  # reads layer ``kv_source``'s cache, writes none
    k_eq_v: bool = False  # no v_proj: V is the K projection (before K's norm and RoPE)
    intermediate_size: int = 0
    moe: bool = False  # the MLP is a mixture of experts (``model/moe.py``), not the dense gated MLP


def _rope_spec(theta: float, scaling: dict[str, Any] | None, dim: int = 0) -> RopeSpec:
    scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) in ("default", None):
        scaling = {}
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
    return RopeSpec(float(theta), frozen, dim)


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
    architecture: str = "llama"  # the family (``model/families``): llama, qwen2, qwen3, gemma3, gemma4, ...
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
    # ---- Gemma 4 (``families/gemma4.py``) ----
    # layer -> what differs from the sizes above: {"head_dim": .., "num_key_value_heads": ..}
    per_layer_config: dict[int, dict[str, int]] = field(default_factory=dict)
    attention_k_eq_v: bool = False  # full layers have no v_proj: V is the K projection
    v_norm: bool = False  # an RMSNorm without weight over each V head
    num_kv_shared_layers: int = 0  # the last N layers read the KV of the last earlier layer of their type
    use_double_wide_mlp: bool = False  # the KV-shared layers' MLPs are twice intermediate_size wide
    hidden_size_per_layer_input: int = 0  # per-layer input embeddings' width (0: none)
    vocab_size_per_layer_input: int = 0
    layer_scalar: bool = False  # each layer's output stream times a learned scalar (a checkpoint tensor)
    # ---- mixture of experts (``families/moe.py``; Qwen3-MoE, Mixtral) ----
    num_experts: int = 0  # 0: every MLP is dense
    num_experts_per_tok: int = 0  # k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's intermediate width
    norm_topk_prob: bool = False  # the k chosen probabilities renormalised to sum to 1
    # "softmax_topk": softmax over every expert, then the k largest (Qwen3-MoE, Mixtral);
    # "topk_softmax": the k largest logits, then a softmax over them (gpt-oss)
    router_rule: str = "softmax_topk"
    mlp_only_layers: list[int] = field(default_factory=list)  # layers that keep a dense MLP
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 (and not in mlp_only_layers)
    router_bias: bool = False  # the router carries a bias (gpt-oss)
    moe_beside_mlp: bool = False  # Gemma 4: every layer's experts run beside its dense MLP (own router)
    expert_bias: bool = False  # the experts' gate-up and down projections carry biases (gpt-oss)
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU (hidden_act "swiglu_oai")
    swiglu_limit: float = 7.0
    # ---- gpt-oss's attention ----
    attention_sinks: bool = False  # a learned logit per head beside the keys: softmax's extra term
    o_proj_bias: bool = False  # o_proj carries a bias too (attention_bias covers q, k and v)
    # ---- linear-attention hybrids (``families/qwen3_next.py``; Qwen3.5, Qwen3-Next) ----
    attn_output_gate: bool = False  # q_proj doubled: attention output times sigmoid(gate) per head
    shared_expert_intermediate_size: int = 0  # an MoE layer's shared expert (sigmoid-gated); 0: none
    linear_num_key_heads: int = 0  # Gated DeltaNet layers (``LINEAR`` in layer_types)
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

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
        self._check_per_layer()
        self._check_experts()
        self._check_linear()
        for spec in {self.layer_spec(i).rope for i in range(self.num_hidden_layers)}:
            scaling = spec.scaling_dict
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {list(ROPE_TYPES)}")
            if kind == "yarn" and "original_max_position_embeddings" not in scaling:
                raise ValueError("YaRN needs original_max_position_embeddings in its rope_scaling")
            factor = float(scaling.get("partial_rotary_factor", 1.0))
            if not 0 < factor <= 1:
                raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")

    def _check_per_layer(self) -> None:
        """Gemma 4's per-layer sizes, KV sharing and per-layer inputs, each refused naming the field."""
        layers = self.num_hidden_layers
        for i, sizes in self.per_layer_config.items():
            if not 0 <= i < layers:
                raise ValueError(f"per_layer_config names layer {i}; layers are 0..{layers - 1}")
            unknown = sorted(set(sizes) - set(PER_LAYER_SIZES))
            if unknown:
                raise ValueError(
                    f"per_layer_config[{i}] sets {unknown}: only {list(PER_LAYER_SIZES)} may differ per layer"
                )
            heads, dim = self._own_kv_shape(i)
            if heads < 1 or dim < 2 or dim % 2 or self.num_attention_heads % heads:
                raise ValueError(
                    f"per_layer_config[{i}]: num_key_value_heads={heads}, head_dim={dim} (need an even "
                    f"head_dim and KV heads dividing num_attention_heads={self.num_attention_heads})"
                )
        if not 0 <= self.num_kv_shared_layers < layers:
            raise ValueError(
                f"num_kv_shared_layers={self.num_kv_shared_layers}: at least one of the "
                f"num_hidden_layers={layers} layers must compute its own KV"
            )
        for i in range(layers - self.num_kv_shared_layers, layers):
            source = self.kv_source(i)  # raises if no earlier layer of its type computes KV
            if self._own_kv_shape(i) != self._own_kv_shape(source):
                raise ValueError(
                    f"layer {i} reads layer {source}'s KV (num_kv_shared_layers) but their "
                    f"(num_key_value_heads, head_dim) differ: {self._own_kv_shape(i)} and "
                    f"{self._own_kv_shape(source)}"
                )
        if self.hidden_size_per_layer_input < 0 or (
            self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < 1
        ):
            raise ValueError(
                f"hidden_size_per_layer_input={self.hidden_size_per_layer_input} needs a "
                f"vocab_size_per_layer_input >= 1 (got {self.vocab_size_per_layer_input})"
            )

    def _check_experts(self) -> None:
        """A mixture of experts that contradicts itself is refused, naming the field."""
        if not self.num_experts:
            if self.hidden_act == "swiglu_oai":
                raise ValueError(
                    "hidden_act 'swiglu_oai' is gpt-oss's experts' activation: it needs num_experts"
                )
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if self.hidden_act == "swiglu_oai" and not all(map(self.is_moe_layer, range(self.num_hidden_layers))):
            raise ValueError("hidden_act 'swiglu_oai' (gpt-oss's experts) needs every layer to be MoE")
        if self.router_rule not in ROUTER_RULES:
            raise ValueError(f"router rule {self.router_rule!r} is not one of {list(ROUTER_RULES)}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(
                f"mlp_only_layers names layers {outside}; layers are 0..{self.num_hidden_layers - 1}"
            )

    def _check_linear(self) -> None:
        """Gated DeltaNet layers need their sizes and at least one attention layer (whose KV cache the
        pool is sized by); a model of linear layers alone is refused."""
        if LINEAR not in self.layer_types:
            return
        if all(kind == LINEAR for kind in self.layer_types):
            raise ValueError("layer_types holds only linear_attention layers: at least one must attend")
        kh, vh = self.linear_num_key_heads, self.linear_num_value_heads
        if min(kh, vh, self.linear_key_head_dim, self.linear_value_head_dim) < 1 or vh % kh:
            raise ValueError(
                f"linear_attention layers need linear_num_key_heads={kh} dividing linear_num_value_heads="
                f"{vh} and head dims >= 1 ({self.linear_key_head_dim}, {self.linear_value_head_dim})"
            )
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be >= 2")

    @property
    def linear_layers(self) -> list[int]:
        """The Gated DeltaNet layers (each holds a recurrent and a conv state per sequence)."""
        return [i for i in range(self.num_hidden_layers) if self.layer_type(i) == LINEAR]

    @property
    def is_hybrid(self) -> bool:
        return LINEAR in self.layer_types

    def is_moe_layer(self, i: int) -> bool:
        """Is layer ``i``'s MLP a mixture of experts? HF's rule: experts on every
        ``decoder_sparse_step``-th layer, except ``mlp_only_layers``; Gemma 4's experts run beside a
        dense MLP instead (``moe_beside_mlp``)."""
        if self.num_experts == 0 or self.moe_beside_mlp:
            return False
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across the layers that hold a KV cache, per byte of element size."""
        owners = [i for i in range(self.num_hidden_layers) if self.kv_source(i) == i]
        return sum(2 * heads * dim for heads, dim in map(self.layer_kv_shape, owners))

    def _own_kv_shape(self, i: int) -> tuple[int, int]:
        sizes = self.per_layer_config.get(i, {})
        return (
            int(sizes.get("num_key_value_heads", self.num_key_value_heads)),
            int(sizes.get("head_dim", self.head_dim)),
        )

    def layer_kv_shape(self, i: int) -> tuple[int, int]:
        """(num_key_value_heads, head_dim) of layer ``i``'s KV cache: the config's, unless
        ``per_layer_config`` gives the layer others (Gemma 4's global layers). A layer that reads
        another's KV has that layer's shape (checked equal to its own)."""
        return self._own_kv_shape(self.kv_source(i))

    def kv_source(self, i: int) -> int:
        """The layer whose KV cache layer ``i`` reads: ``i`` itself, except for Gemma 4's last
        ``num_kv_shared_layers`` layers, which read the last earlier layer of their own type (HF's
        ``kv_sharing_modes``) and write no KV."""
        if self.layer_type(i) == LINEAR:  # no KV: it is handed the first attention layer's, unread
            return next(j for j in range(self.num_hidden_layers) if self.layer_type(j) != LINEAR)
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if i < first_shared:
            return i
        kind = self.layer_type(i)
        for j in range(first_shared - 1, -1, -1):
            if self.layer_type(j) == kind:
                return j
        raise ValueError(
            f"layer {i} ({kind}) is KV-shared (num_kv_shared_layers={self.num_kv_shared_layers}) but no "
            f"earlier {kind} layer computes KV for it"
        )

    def layer_type(self, i: int) -> str:
        """Layer ``i``'s attention type (FULL, SLIDING or LINEAR)."""
        return self.layer_types[i] if self.layer_types else FULL

    def layer_spec(self, i: int) -> LayerSpec:
        """Layer ``i``'s attention type, window, RoPE, head size and KV heads, KV sharing, MLP width."""
        kind = self.layer_type(i)
        heads, dim = self.layer_kv_shape(i)
        rope = self.rope_by_layer_type.get(kind)
        if rope is None:
            spec = _rope_spec(self.rope_theta, self.rope_scaling, dim)
        else:
            spec = _rope_spec(rope.get("rope_theta", self.rope_theta), rope, dim)
        shares = self.kv_source(i) != i
        wide = 2 if shares and self.use_double_wide_mlp else 1
        return LayerSpec(
            kind,
            self.sliding_window if kind == SLIDING else None,
            spec,
            head_dim=dim,
            kv_heads=heads,
            shares_kv=shares,
            k_eq_v=self.attention_k_eq_v and kind != SLIDING,
            intermediate_size=self.intermediate_size * wide,
            moe=self.is_moe_layer(i),
        )

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING in self.layer_types

    @property
    def softmax_scale(self) -> float:
        return self.layer_softmax_scale(self.head_dim)

    def layer_softmax_scale(self, head_dim: int) -> float:
        """The softmax scale of a layer with heads of ``head_dim``."""
        return self.attention_scale if self.attention_scale is not None else head_dim**-0.5

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


# RoPE scalings ``model/rotary.rope_inv_freq`` computes (``proportional``: Gemma 4's global layers;
# ``partial``: Qwen3.5's and Qwen3-Next's first dims rotated, the head reordered at load)
ROPE_TYPES = ("default", "llama3", "linear", "proportional", "yarn", "partial")
# how a mixture of experts picks a token's experts (``router_rule``)
ROUTER_RULES = ("softmax_topk", "topk_softmax")
# what ``per_layer_config`` may set for a layer
PER_LAYER_SIZES = ("head_dim", "num_key_value_heads")
