"""The decoder-only transformer over a flat batch of tokens and the paged KV cache, built layer by layer.

One set of blocks serves every family (``model/families``): each layer takes its attention type,
window and RoPE from ``ModelConfig.layer_spec``, and the config switches the parts families differ
in (QK-norm, Gemma's sandwich norms, the MLP's activation, an embedding scale, a final soft-cap).

The batch is one flat list of tokens from many sequences (prefill chunks and decode tokens mixed);
every token brings its own position ID, and attention goes through an AttentionBackend that sees the
paged cache and the step's AttentionMetadata, never a per-request contiguous KV tensor.
Module names follow HF's, except that q/k/v and gate/up are one ``MergedLinear`` each (``qkv_proj``,
``gate_up_proj``); the loaders fill their parts from HF's separate tensors. The elementwise work
between the matmuls goes through ``prefixserve.model.fused`` (Triton kernels on CUDA).

Under tensor parallelism (``Shard``) each process builds the same modules at its own sizes: its query
and KV heads, its intermediate columns, its vocabulary rows; ``src`` spans say which rows or columns
of the checkpoint's tensors each holds, and an all-reduce follows o_proj, down_proj and the embedding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.window import attend_layer
from prefixserve.model import cpu_linear, fused
from prefixserve.model.config import LayerSpec, ModelConfig, RopeSpec
from prefixserve.model.meta_init import LoadedLater
from prefixserve.model.parallel import Shard
from prefixserve.model.peer_allreduce import ATTENTION_SLOT, EMBEDDING_SLOT, MLP_SLOT
from prefixserve.sampling.argmax import argmax_rows


class RMSNorm(nn.Module):
    """HF's RMSNorm; given the residual stream too, it adds the residual first (vLLM's convention).

    ``norm(x)`` returns the normalised x; ``norm(x, residual)`` returns ``(norm(x + residual),
    x + residual)``, one kernel on CUDA (``fused.add_rms_norm``) instead of an add and a norm.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor | fused.PeerSum,  # [T, hidden], or what ``fused.add_rms_norm`` also takes
        residual: torch.Tensor | None = None,  # [T, hidden]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        normed, summed = self.with_stream(x, residual)
        return normed if residual is None else (normed, summed)

    def with_stream(
        self, x: torch.Tensor | fused.PeerSum, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, with no residual ``(norm(x), x)``: the residual
        stream too, which a ``PeerSum`` x only has once summed."""
        return fused.add_rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig, rope: RopeSpec | None = None) -> torch.Tensor:
    """Inverse frequencies of ``rope`` (default: layer 0's), with Llama-3's long-context scaling or
    linear scaling when it asks for them.

    Computed on the CPU whatever device context the model is built under (callers move it): on the
    meta device, fp64 ``arange`` runs torch's Python decomposition, which imports torch._dynamo."""
    rope = rope or config.layer_spec(0).rope
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (rope.theta ** (steps / dim))
    scaling = rope.scaling_dict
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


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, D] fp32 each (``RotaryEmbedding.cos_sin``)
Ropes = tuple[Rope, ...]  # a step's angles for each distinct RoPE of the model (``CausalLM.ropes``)


class RotaryEmbedding(nn.Module):
    """RoPE from an explicit position per token (positions are data: they need not be 0..n-1)."""

    def __init__(self, config: ModelConfig, rope: RopeSpec | None = None) -> None:
        super().__init__()
        self.spec = rope or config.layer_spec(0).rope
        self.register_buffer("inv_freq", rope_inv_freq(config, self.spec), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> Rope:  # [T] -> cos, sin [T, D]
        """The step's angles, computed once and shared by every layer."""
        return fused.rope_cos_sin(positions, self.inv_freq)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        cos, sin = self.cos_sin(positions)
        return fused.apply_rope(q, cos, sin), fused.apply_rope(k, cos, sin)


class Linear(LoadedLater, nn.Linear):
    """``nn.Linear`` that takes oneDNN with a packed weight on the CPU when it has one (``cpu_linear``),
    and on a GPU the skinny kernel for a decode step's few rows where it beats cuBLAS (``fused.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused.linear(x, self.weight, self.bias)
        return cpu_linear.linear(self, x)


class MergedLinear(Linear):
    """Several projections of the same input as one matmul, their weights stacked by rows.

    ``parts`` names the stacked projections as checkpoints name them (q_proj, k_proj, v_proj;
    gate_proj, up_proj), in row order: the loaders fill each part's rows from its own tensor, so HF
    state dicts load unchanged. One GEMM reads x once and runs at a larger N (the split q/k/v and
    gate/up GEMMs ran split-K with their own reduce kernels at decode sizes on an H200).
    """

    def __init__(self, in_features: int, parts: list[tuple[str, tuple[int, int], int]], bias: bool) -> None:
        """``parts``: (checkpoint name, this rank's [start, stop) rows of that tensor, its total rows)."""
        super().__init__(in_features, sum(b - a for _, (a, b), _ in parts), bias=bias)
        self.parts = parts

    def part_rows(self) -> dict[str, slice]:
        """Each part's rows of the stacked weight (and bias)."""
        out, at = {}, 0
        for name, (a, b), _ in self.parts:
            out[name] = slice(at, at + b - a)
            at += b - a
        return out


class RowParallelLinear(Linear):
    """A linear layer whose input columns ``src`` = [start, stop) of the checkpoint's ``total`` are
    this rank's; ``reduced`` sums the ranks' partial products."""

    def __init__(self, total_in: int, src: tuple[int, int], out_features: int) -> None:
        super().__init__(src[1] - src[0], out_features, bias=False)
        self.src, self.total_in = src, total_in

    def reduced(self, x: torch.Tensor, shard: Shard, slot: int | None = None) -> torch.Tensor | fused.PeerSum:
        """The product summed over the ranks, for a norm that adds it to the residual stream next.

        With a product ``slot`` (``peer_allreduce``'s: consecutive calls never share one) the sum may
        be left to that norm: where ``product_slot`` gives one, a ``PeerSum`` comes back, which
        ``fused.add_rms_norm`` sums over NVLink with the residual add and the norm in one kernel
        (``kernels/peer_norm.py``, ``kernels/ranks_norm.py``).

        On the peer path the product (cuBLAS, or the skinny kernel at a few rows) is written straight
        into the peer buffer and the sum is returned there: the copies in and out of the buffer (130
        a step of the 8B model) go. That sum lives only until the next all-reduce, which is why only
        these two call sites, whose next op (``add_rms_norm`` with the residual) writes new tensors,
        take it."""
        peer = shard.peer
        if peer is not None and fused.staged_allreduce(x):
            if slot is not None and fused.peer_norm_enabled():
                pending = peer.product_slot(slot, x.shape[0], self.out_features, x.dtype)
                if pending is not None:
                    fused.linear_into(x, self.weight, pending.mine)
                    return pending
            staged = peer.staged(x.shape[0], self.out_features, x.dtype)
            if staged is not None:
                fused.linear_into(x, self.weight, staged)
                return peer.reduce_staged(staged)
        return shard.all_reduce(self(x))


class VocabParallelEmbedding(LoadedLater, nn.Embedding):
    """The embedding rows ``src`` = [start, stop) of the vocabulary; other ids look up zeros here and
    their row on the rank that holds it (the all-reduce sums the ranks' lookups)."""

    def __init__(self, vocab: int, hidden: int, shard: Shard) -> None:
        self.src = shard.vocab_span(vocab)
        super().__init__(self.src[1] - self.src[0], hidden)
        self.vocab, self.shard = vocab, shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if not self.shard.parallel:
            return super().forward(ids)
        return self.shard.all_reduce(fused.shard_lookup(ids, self.weight, self.src[0]))

    def summed_later(self, ids: torch.Tensor) -> torch.Tensor | fused.PeerSum:
        """``forward(ids)``, except that on the fused path (``product_slot``) the lookups are written into
        the embedding's product slot and come back unsummed (``PeerSum``): the first layer's norm
        sums them (``DecoderLayer.before_attention``), saving the all-reduce and its copies."""
        peer = self.shard.peer
        fused_path = fused.staged_allreduce(ids) and fused.peer_norm_enabled()
        if self.shard.parallel and peer is not None and fused_path:
            pending = peer.product_slot(EMBEDDING_SLOT, ids.shape[0], self.embedding_dim, self.weight.dtype)
            if pending is not None:
                fused.shard_embedding(ids, self.weight, self.src[0], pending.mine)
                return pending
        return self(ids)


class Attention(nn.Module):
    """q/k/v projection (QK-norm where the family has it), RoPE, attention over the cache (within the
    layer's window, if it slides), o_proj."""

    def __init__(self, config: ModelConfig, shard: Shard, spec: LayerSpec | None = None) -> None:
        super().__init__()
        self.shard = shard
        d = self.head_dim = config.head_dim
        q0, q1 = shard.span(config.num_attention_heads)
        k0, k1 = shard.kv_head_span(config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0
        self.scale = config.softmax_scale
        self.window = spec.window if spec is not None else None  # keys a query sees; None: all
        if config.qk_norm:  # one RMSNorm over each head's dims, shared by the heads
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        hidden, bias = config.hidden_size, config.attention_bias
        q_total, kv_total = config.num_attention_heads * d, config.num_key_value_heads * d
        parts = [
            ("q_proj", (q0 * d, q1 * d), q_total),
            ("k_proj", (k0 * d, k1 * d), kv_total),
            ("v_proj", (k0 * d, k1 * d), kv_total),
        ]
        self.qkv_proj = MergedLinear(hidden, parts, bias=bias)
        self.o_proj = RowParallelLinear(q_total, (q0 * d, q1 * d), hidden)

    def _qkv(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        rope: Rope | None,
        cache: fused.KVWrite | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._rotated(x, rope if rope is not None else rotary.cos_sin(positions), cache)

    def _rotated(
        self, x: torch.Tensor, rope: Rope, cache: fused.KVWrite | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x`` with RoPE applied (K/V written to ``cache`` if given). On a GPU the
        projection may come as split-K partials, which the RoPE kernel sums (``fused.qkv_partials``)."""
        proj = self.qkv_proj
        qkv = fused.qkv_partials(x, proj.weight, proj.bias) if x.is_cuda else proj(x)  # [(S,) T, W]
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        return fused.rope_qkv(qkv, *rope, *shape, cache, x.dtype, norms)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of the tokens ``x`` [T, hidden], RoPE applied.

        ``rope``: the step's cos and sin when the caller has them (else computed from ``positions``).
        """
        return self._qkv(x, positions, rotary, rope, None)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        kv_layer: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        write_kv: bool = True,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_layer
        # With write_kv the new tokens' K/V go into their slots (in the RoPE kernel on CUDA);
        # attention then reads everything from the cache.
        cache = (k_cache, v_cache, meta.slot_mapping) if write_kv else None
        q, _, _ = self._qkv(x, positions, rotary, rope, cache)
        return self.output(self.attend(q, kv_layer, meta, backend))

    def attend(
        self,
        q: torch.Tensor,
        kv_layer: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Attention of q over this layer's cache, with this layer's scale and window."""
        return attend_layer(backend, q, *kv_layer, meta, self.scale, self.window)

    def query(self, x: torch.Tensor, rope: Rope, cache: fused.KVWrite) -> torch.Tensor:
        """q [T, Hq, D] of the tokens ``x``, their K/V written to the cache: the work before attention."""
        return self._rotated(x, rope, cache)[0]

    def output(
        self, out: torch.Tensor, for_norm: bool = False
    ) -> torch.Tensor | fused.PeerSum:  # attention output [T, Hq, D] -> [T, hidden]
        """o_proj of the attention output, the ranks' partial products summed (with ``for_norm``,
        maybe by the norm that follows: ``RowParallelLinear.reduced``'s ``ATTENTION_SLOT``)."""
        flat = out.reshape(out.shape[0], self.num_heads * self.head_dim)
        return self.o_proj.reduced(flat, self.shard, slot=ATTENTION_SLOT if for_norm else None)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.act = config.hidden_act  # silu (Llama, Qwen) or gelu_pytorch_tanh (Gemma)
        inter = config.intermediate_size
        cols = shard.span(inter)
        parts = [("gate_proj", cols, inter), ("up_proj", cols, inter)]
        self.gate_up_proj = MergedLinear(config.hidden_size, parts, bias=False)
        self.down_proj = RowParallelLinear(inter, cols, config.hidden_size)

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor | fused.PeerSum:  # [T, hidden]
        """The MLP's output; with ``partials`` (for a norm next: ``fused.add_rms_norm`` takes them)
        maybe the down projection's fp32 split-K partials [S, T, hidden] instead (one process), or
        on the fused path (``product_slot``) the ranks' products unsummed (``PeerSum``, ``MLP_SLOT``)."""
        # [T, I] (this rank's columns: on a GPU without the [T, 2I] product), then the ranks' sums added
        gelu = self.act == "gelu_pytorch_tanh"
        if x.is_cuda:
            act = fused.linear_silu_and_mul(x, self.gate_up_proj.weight, gelu)
        else:
            act = fused.silu_and_mul(self.gate_up_proj(x), gelu)
        if partials and not self.shard.parallel and act.is_cuda:
            return fused.linear_partials(act, self.down_proj.weight)
        return self.down_proj.reduced(act, self.shard, slot=MLP_SLOT if partials else None)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with ``sandwich_norms`` (Gemma) each block's output is
    normed too before its residual add: ``post_attention_layernorm`` then follows attention and
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` surround the MLP (HF's names)."""

    def __init__(self, config: ModelConfig, shard: Shard, spec: LayerSpec, rope_index: int = 0) -> None:
        super().__init__()
        self.spec, self.rope_index = spec, rope_index  # rope_index: which of the step's angles
        self.self_attn = Attention(config, shard, spec)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden] or [S, T, hidden] partials: the last MLP's output (layer 0: embedding)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before h is added; None at layer 0
        rope: Ropes,
        kv_layer: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the residual stream before it)
        """One layer with every residual add fused into the next norm: the stream is h + residual."""
        q, residual = self.before_attention(h, residual, rope, (*kv_layer, meta.slot_mapping))
        out = self.self_attn.attend(q, kv_layer, meta, backend)
        return self.after_attention(out, residual)

    def before_attention(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: Ropes, cache: fused.KVWrite
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, residual stream): the input norm, then q/k/v with RoPE, K/V written to ``cache``."""
        x, residual = self.input_layernorm.with_stream(h, residual)
        return self.self_attn.query(x, rope[self.rope_index], cache), residual

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it): o_proj, the post-attention norm, the MLP."""
        if self.sandwich:  # the block outputs are normed before their residual adds
            attn = self.post_attention_layernorm(self.self_attn.output(out))
            x, residual = self.pre_feedforward_layernorm(attn, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(self.self_attn.output(out, for_norm=True), residual)
        return self.mlp(x, partials=True), residual  # the next norm sums split-K partials or ranks


def distinct_ropes(config: ModelConfig) -> list[RopeSpec]:
    """The model's RoPEs in order of first use (one for most models; Gemma: local and global)."""
    out: list[RopeSpec] = []
    for i in range(config.num_hidden_layers):
        rope = config.layer_spec(i).rope
        if rope not in out:
            out.append(rope)
    return out


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        ropes = distinct_ropes(config)
        specs = [config.layer_spec(i) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(DecoderLayer(config, shard, s, ropes.index(s.rope)) for s in specs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.embed_scale  # Gemma: sqrt(hidden), applied in the model's dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor | fused.PeerSum:  # [T] -> [T, hidden]
        """The embeddings of ``ids``, scaled where the family scales them (then summed over ranks here)."""
        if self.embed_scale is None:
            return self.embed_tokens.summed_later(ids)
        h = self.embed_tokens(ids)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)


class ParallelLMHead(Linear):
    """The output projection's vocabulary rows ``src`` (the embedding's, for tied weights)."""

    def __init__(self, hidden: int, vocab: int, shard: Shard) -> None:
        self.src = shard.vocab_span(vocab)
        super().__init__(hidden, self.src[1] - self.src[0], bias=False)


class LlamaForCausalLM(nn.Module):
    """The whole model, of any supported family (the name is the first family's). ``forward`` returns
    final hidden states; ``compute_logits`` the logits (fp32 unless an argmax alone asks for the
    model's dtype).

    ``config`` is what this process computes (``Shard.local_config``: its heads and columns; the
    KV cache and the attention are sized from it); ``full_config`` the checkpoint's model.
    """

    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.shard = shard = shard or Shard()
        self.full_config = config
        self.config = shard.local_config(config)
        self.model = LlamaBody(config, shard)
        self.ropes = nn.ModuleList(RotaryEmbedding(config, rope) for rope in distinct_ropes(config))
        self.rotary = self.ropes[0]
        self.softcap = config.final_logit_softcapping
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, shard)
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
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """Final hidden states. ``before_layer(i)``, if given, runs before layer i touches the cache:
        the model runner's wait for KV still being copied into it (``kv/landing.py``)."""
        h = self.model.embed(input_ids)
        rope = self.cos_sin(positions)
        residual = None
        for i, (layer, kv_layer) in enumerate(zip(self.model.layers, kv_cache, strict=True)):
            if before_layer is not None:
                before_layer(i)
            h, residual = layer(h, residual, rope, kv_layer, meta.for_layer(i), backend)
        return self.model.norm(h, residual)[0]

    def cos_sin(self, positions: torch.Tensor) -> Ropes:
        """The step's RoPE angles, once per distinct RoPE, shared by the layers that use it."""
        return tuple(rotary.cos_sin(positions) for rotary in self.ropes)

    def reset_ropes(self, device: torch.device) -> None:
        """Recompute the RoPE tables on ``device`` (after building on the meta device)."""
        for rotary in self.ropes:
            rotary.inv_freq = rope_inv_freq(self.full_config, rotary.spec).to(device)

    # ---- the forward in pieces between attentions (``engine/piecewise_graph.py`` replays them) ----
    # forward == first_piece, then for each layer l: attention, then piece(l + 1) (last_piece after
    # the last layer); the same ops in the same order.
    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: fused.KVWrite
    ) -> tuple[torch.Tensor, torch.Tensor, Ropes]:
        """(layer 0's q, the residual stream, the step's RoPE angles) from the token ids."""
        h = self.model.embed(input_ids)
        rope = self.cos_sin(positions)
        q, residual = self.model.layers[0].before_attention(h, None, rope, cache)
        return q, residual, rope

    def middle_piece(
        self, layer: int, out: torch.Tensor, residual: torch.Tensor, rope: Ropes, cache: fused.KVWrite
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer - 1``'s attention output ``out`` -> (layer ``layer``'s q, the residual stream)."""
        h, residual = self.model.layers[layer - 1].after_attention(out, residual)
        return self.model.layers[layer].before_attention(h, residual, rope, cache)

    def last_piece(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's attention output -> final hidden states [T, hidden]."""
        h, residual = self.model.layers[-1].after_attention(out, residual)
        return self.model.norm(h, residual)[0]

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
        layers, rope = self.model.layers, self.cos_sin(positions)
        first = layers[0]
        x, residual = first.input_layernorm.with_stream(self.model.embed(input_ids))
        if len(layers) == 1:
            _, k, v = first.self_attn.project(x, positions, self.rotary, rope[first.rope_index])
            return k, v
        q, _, _ = first.self_attn.project(x, positions, self.rotary, rope[first.rope_index])
        h, residual = first.after_attention(first.self_attn.attend(q, kv_cache[0], meta, backend), residual)
        second = layers[1]
        x, _ = second.input_layernorm.with_stream(h, residual)
        _, k, v = second.self_attn.project(x, positions, self.rotary, rope[second.rope_index])
        return k, v

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:  # [R, vocab]
        """Every rank scores its vocabulary rows; the ranks' scores are joined (every rank calls this).

        ``fp32=False`` keeps the model's dtype: an argmax needs no cast (the cast is exact, so the
        winner is the same), and at B=1024 x 128K vocabulary the fp32 copy is 0.5 GB a step."""
        logits = self.lm_head(hidden)
        if self.softcap is not None:  # monotone: the argmax paths need not apply it
            logits = torch.tanh(logits.float() / self.softcap) * self.softcap
        return self.shard.gather_columns(logits.float() if fp32 else logits, self.config.vocab_size)

    @property
    def argmax_exact(self) -> bool:
        """Column ids travel as fp32 in ``compute_argmax``: exact below 2**24."""
        return self.config.vocab_size < 1 << 24

    @torch.inference_mode()
    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor:  # [R] int64
        """``compute_logits(hidden, fp32=False).argmax(-1)`` (every rank calls it) with no logits
        gathered: each rank finds its own columns' best, then the ranks exchange [R, 2] (score,
        column) instead of [R, vocab / ranks] logits (0.36 ms of a 6.4 ms 8B step at B=256, TP=2):
        at two ranks on the fused path in one kernel over NVLink (``kernels/peer_argmax.py``), else
        through NCCL."""
        logits = self.lm_head(hidden)
        start = self.lm_head.src[0]
        valid = self.config.vocab_size - start
        if valid < logits.shape[1]:  # the last rank's padding rows score 0: never the argmax
            logits[:, valid:] = float("-inf")
        local = argmax_rows(logits)
        peer = self.shard.peer
        if peer is not None and logits.is_cuda and fused.peer_norm_enabled():
            tokens = peer.argmax(logits, local, start)  # two ranks: one kernel over NVLink
            if tokens is not None:
                return tokens
        best = logits.gather(1, local[:, None])[:, 0].float()  # exact: bf16/fp16 -> fp32
        every = self.shard.all_gather_stack(torch.stack([best, (local + start).float()], 1))
        # the first rank holding a row's largest score holds its lowest such column, as argmax picks
        rank = every[..., 0].argmax(0)
        return every[rank, torch.arange(rank.shape[0], device=rank.device), 1].long()
