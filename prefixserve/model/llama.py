"""Llama-family transformer over a flat batch of tokens and the paged KV cache.

The batch is one flat list of tokens from many sequences (prefill chunks and decode tokens mixed);
every token brings its own position ID, and attention goes through an AttentionBackend that sees the
paged cache and the step's AttentionMetadata, never a per-request contiguous KV tensor.
Module names follow HF's so HF state dicts load as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like HF, then cast back before the weight multiply.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3's long-context scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
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


class RotaryEmbedding(nn.Module):
    """RoPE from an explicit position per token (positions are data: they need not be 0..n-1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T, 1, D]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of the tokens ``x`` [T, hidden], RoPE applied."""
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k, positions)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        kv_layer: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        write_kv: bool = True,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.project(x, positions, rotary)
        k_cache, v_cache = kv_layer
        if write_kv:  # the new tokens' K/V into their slots; attention then reads all from the cache
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns final hidden states; ``compute_logits`` the fp32 logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(input_ids)
        for layer, kv_layer in zip(self.model.layers, kv_cache, strict=True):
            a = layer.self_attn(layer.input_layernorm(h), positions, self.rotary, kv_layer, meta, backend)
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    @torch.inference_mode()
    def layer_kv(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # k, v: [T, Hkv, D]
        """The K and V that layer 1 computes for tokens whose layer-0 KV is already in the cache, in
        the context ``meta`` gives them; nothing is written.

        Layer 0's KV depends on nothing but a token and its position, so a Prompt Cache module's
        cached rows are exactly its in-context rows there, and layer 0 can attend over them as they
        are. Layer 1's KV is the first that sees the context: how far the cached rows are from it
        says which rows to recompute (CacheBlend's selection). A one-layer model returns layer 0's.
        """
        h = self.model.embed_tokens(input_ids)
        first = self.model.layers[0]
        if len(self.model.layers) == 1:
            _, k, v = first.self_attn.project(first.input_layernorm(h), positions, self.rotary)
            return k, v
        a = first.self_attn(first.input_layernorm(h), positions, self.rotary, kv_cache[0], meta, backend,
                            write_kv=False)
        h = h + a
        h = h + first.mlp(first.post_attention_layernorm(h))
        second = self.model.layers[1]
        _, k, v = second.self_attn.project(second.input_layernorm(h), positions, self.rotary)
        return k, v

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] fp32
        return self.lm_head(hidden).float()
