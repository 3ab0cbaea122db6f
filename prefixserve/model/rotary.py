"""RoPE: the inverse frequencies of each scaling a family asks for (default, linear, llama3, Gemma 4's
proportional, YaRN), the per-step angles, and what a step hands every layer besides the residual stream."""

from __future__ import annotations

import math

import torch
from torch import nn

from prefixserve.model import fused
from prefixserve.model.config import ModelConfig, RopeSpec


def rope_inv_freq(config: ModelConfig, rope: RopeSpec | None = None) -> torch.Tensor:
    """Inverse frequencies of ``rope`` (default: layer 0's), with Llama-3's long-context scaling or
    linear scaling when it asks for them.

    Computed on the CPU whatever device context the model is built under (callers move it): on the
    meta device, fp64 ``arange`` runs torch's Python decomposition, which imports torch._dynamo."""
    rope = rope or config.layer_spec(0).rope
    dim = rope.dim or config.head_dim
    scaling = rope.scaling_dict
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "proportional":  # Gemma 4's global layers: the first pairs rotate, the rest do not
        return proportional_inv_freq(rope.theta, dim, scaling)
    if kind == "partial":  # Qwen3.5, Qwen3-Next: see ``partial_inv_freq``
        return partial_inv_freq(rope.theta, dim, scaling)
    if kind == "yarn":
        return yarn_inv_freq(rope.theta, dim, scaling, config.max_position_embeddings)
    steps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (rope.theta ** (steps / dim))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


def proportional_inv_freq(theta: float, dim: int, scaling: dict) -> torch.Tensor:  # [dim / 2] fp32
    """HF's ``proportional`` RoPE: of a head's ``dim / 2`` rotate-half pairs, the first
    ``int(partial_rotary_factor * dim // 2)`` turn at ``theta ** (-2j / dim)`` (the exponent over the
    whole head, not over the rotated part), the others at frequency 0 (cos 1, sin 0: left as they
    are); all divided by ``factor``. The same rotate-half over the whole head then applies it."""
    angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
    steps = torch.arange(0, 2 * angles, 2, dtype=torch.float64, device="cpu")
    inv_freq = torch.zeros(dim // 2, dtype=torch.float64, device="cpu")
    inv_freq[:angles] = 1.0 / (theta ** (steps / dim))
    return (inv_freq / float(scaling.get("factor", 1.0))).float()


def partial_inv_freq(theta: float, dim: int, scaling: dict) -> torch.Tensor:  # [dim / 2] fp32
    """HF's ``partial_rotary_factor`` RoPE (Qwen3.5, Qwen3-Next): rotate-half over the first
    ``r = dim * factor`` dims at ``theta ** (-2j / r)``, the other dims left. The loader reorders each
    q and k head (``gated_attention.rope_order``) so that those pairs are the whole head's first
    ``r / 2`` rotate-half pairs; the others turn at frequency 0. The same kernels then apply it."""
    rotary = int(dim * float(scaling.get("partial_rotary_factor", 1.0)))
    steps = torch.arange(0, rotary, 2, dtype=torch.float64, device="cpu")
    inv_freq = torch.zeros(dim // 2, dtype=torch.float64, device="cpu")
    inv_freq[: rotary // 2] = 1.0 / (theta ** (steps / rotary))
    return inv_freq.float()


def _yarn_factor(scaling: dict, max_positions: int) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-style: the ratio of the context lengths
        factor = max_positions / float(scaling["original_max_position_embeddings"])
    return float(factor)


def yarn_inv_freq(theta: float, dim: int, scaling: dict, max_positions: int) -> torch.Tensor:  # [dim / 2]
    """YaRN: each pair's frequency blended between the original (fast pairs, which turn many times
    within the pretraining context: extrapolated) and divided by ``factor`` (slow pairs:
    interpolated), along a linear ramp between the pairs that turn ``beta_fast`` and ``beta_slow``
    times in ``original_max_position_embeddings`` (ends rounded out unless ``truncate`` is false).
    fp32 as HF computes it; the cos/sin scale is ``rope_attention_factor``'s."""
    factor = _yarn_factor(scaling, max_positions)
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def pair_turning(rotations: float) -> float:  # the pair index that turns ``rotations`` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_attention_factor(config: ModelConfig, rope: RopeSpec) -> float:
    """What cos and sin are scaled by: YaRN's ``attention_factor`` (0.1 ln(factor) + 1 unless given,
    or the ``mscale`` ratio), 1 for every other RoPE."""
    scaling = rope.scaling_dict
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, config.max_position_embeddings)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"]))
    return mscale(factor)


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, D] fp32 each (``RotaryEmbedding.cos_sin``)


class Ropes(tuple):
    """What every layer of a step reads besides the residual stream, computed once per step: the RoPE
    angles, one ``Rope`` per distinct RoPE of the model (``CausalLM.ropes``; a layer's ``rope_index``
    picks its own), and Gemma 4's per-layer inputs ``per_layer`` [T, layers, P] (None without).

    The engine holds it between the forward's pieces (``worker/piecewise_graph.py``), so tensors here
    live as long as the CUDA graphs that read them."""

    per_layer: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """RoPE from an explicit position per token (positions are data: they need not be 0..n-1)."""

    def __init__(self, config: ModelConfig, rope: RopeSpec | None = None) -> None:
        super().__init__()
        self.spec = rope or config.layer_spec(0).rope
        self.register_buffer("inv_freq", rope_inv_freq(config, self.spec), persistent=False)
        self.attention_factor = rope_attention_factor(config, self.spec)

    def cos_sin(self, positions: torch.Tensor) -> Rope:  # [T] -> cos, sin [T, D]
        """The step's angles, computed once and shared by every layer (scaled where YaRN asks)."""
        cos, sin = fused.rope_cos_sin(positions, self.inv_freq)
        if self.attention_factor != 1.0:
            return cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        cos, sin = self.cos_sin(positions)
        return fused.apply_rope(q, cos, sin), fused.apply_rope(k, cos, sin)


def distinct_ropes(config: ModelConfig) -> list[RopeSpec]:
    """The model's RoPEs in order of first use (one for most models; Gemma: local and global)."""
    out: list[RopeSpec] = []
    for i in range(config.num_hidden_layers):
        rope = config.layer_spec(i).rope
        if rope not in out:
            out.append(rope)
    return out


__all__ = [
    "Rope",
    "Ropes",
    "RotaryEmbedding",
    "distinct_ropes",
    "partial_inv_freq",
    "proportional_inv_freq",
    "rope_attention_factor",
    "rope_inv_freq",
    "yarn_inv_freq",
]
