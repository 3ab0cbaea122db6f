"""The decoder-only transformer over a flat batch of tokens and the paged KV cache, built layer by layer.

One set of blocks serves every family (``model/families``): each layer takes its attention type,
window, RoPE, head size and KV heads from ``ModelConfig.layer_spec``, and the config switches the
parts families differ in (QK-norm, Gemma's sandwich norms, the MLP's activation, an embedding scale,
a final soft-cap; Gemma 4's V-norm, K-as-V, KV-shared layers, per-layer inputs and layer scalars).

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

from collections.abc import Callable

import torch
from torch import nn

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.kv_quant import kv_write, scales_of
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.window import attend_layer
from prefixserve.model import decode_split, fp8, fused
from prefixserve.model.config import LINEAR, LayerSpec, ModelConfig
from prefixserve.model.gated_attention import gated_attention_init, gated_output, gated_rotated
from prefixserve.model.gated_delta import GatedDeltaNet, LinearStep
from prefixserve.model.linear import (
    Linear,
    MergedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from prefixserve.model.moe import GATE_UP_STACKED, Experts, Gemma4Router, MoE
from prefixserve.model.parallel import Shard
from prefixserve.model.peer_allreduce import ATTENTION_SLOT, MLP_SLOT
from prefixserve.model.rotary import Rope, Ropes, RotaryEmbedding, distinct_ropes, rope_inv_freq
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
        quantize: bool = False,
        dtype: torch.dtype | None = None,  # split-K partials without a residual: the model's dtype
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        normed, summed = fused.add_rms_norm(x, self.weight, self.eps, residual, quantize, dtype=dtype)
        return normed if residual is None else (normed, summed)

    def after(
        self, first: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(first(x) + residual), first(x) + residual)``: a block's output normed before it
        joins the stream, then the next block's input norm (Gemma's sandwich), one kernel on CUDA."""
        return fused.add_rms_norm(x, self.weight, self.eps, residual, pre=(first.weight, first.eps))

    def with_stream(
        self, x: torch.Tensor | fused.PeerSum, residual: torch.Tensor | None = None, quantize: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, with no residual ``(norm(x), x)``: the residual
        stream too, which a ``PeerSum`` x only has once summed. ``quantize``: an FP8 projection that
        quantizes per token reads the norm (``fused.add_rms_norm``)."""
        return fused.add_rms_norm(x, self.weight, self.eps, residual, quantize)


class Attention(nn.Module):
    """q/k/v projection (QK-norm where the family has it), RoPE, attention over the cache (within the
    layer's window, if it slides), o_proj.

    Gemma 4's layers differ at the edge, in ``_gemma4_rotated``: heads of the layer's own size and KV
    heads (``spec``), each V head RMS-normed without a weight (``v_norm``), a full layer's V taken
    from its K projection (``spec.k_eq_v``: no v_proj), and a KV-shared layer (``spec.shares_kv``)
    projecting q alone and writing no KV: it attends over its source layer's cache, which the KV cache
    hands it as its own (``ModelConfig.kv_source``)."""

    def __init__(self, config: ModelConfig, shard: Shard, spec: LayerSpec | None = None) -> None:
        super().__init__()
        spec = spec or config.layer_spec(0)
        self.shard = shard
        d = self.head_dim = spec.head_dim
        q0, q1 = shard.span(config.num_attention_heads)
        k0, k1 = shard.kv_head_span(spec.kv_heads)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0
        self.scale = config.layer_softmax_scale(d)
        self.window = spec.window  # keys a query sees; None: all
        self.writes_kv, self.k_eq_v = not spec.shares_kv, spec.k_eq_v
        self.v_norm_eps = config.rms_norm_eps if config.v_norm else None
        self.gemma4 = spec.shares_kv or spec.k_eq_v or config.v_norm  # the projection takes _gemma4_rotated
        if config.qk_norm:  # one RMSNorm over each head's dims, shared by the heads
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            if self.writes_kv:
                self.k_norm = RMSNorm(d, config.rms_norm_eps)
        hidden, bias = config.hidden_size, config.attention_bias
        q_total, kv_total = config.num_attention_heads * d, spec.kv_heads * d
        parts = [("q_proj", (q0 * d, q1 * d), q_total)]
        if self.writes_kv:
            parts.append(("k_proj", (k0 * d, k1 * d), kv_total))
            if not self.k_eq_v:
                parts.append(("v_proj", (k0 * d, k1 * d), kv_total))
        self.qkv_proj = MergedLinear(hidden, parts, bias=bias)
        self.o_proj = RowParallelLinear(q_total, (q0 * d, q1 * d), hidden)
        if config.o_proj_bias:  # added after the ranks' products are summed
            self.o_bias = nn.Parameter(torch.empty(hidden))
        self.head_span, self.total_heads = (q0, q1), config.num_attention_heads
        self.sinks = nn.Parameter(torch.empty(q1 - q0)) if config.attention_sinks else None
        self.gated = config.attn_output_gate  # Qwen3.5 / Qwen3-Next: ``gated_attention.py``
        if self.gated:
            gated_attention_init(self, config, shard, spec)

    @property
    def takes_rows(self) -> bool:
        """Whether the norm before may hand the q/k/v product its input's FP8 codes: the plain
        projection (not Gemma 4's nor the gated attention's edge) over FP8 per-token W8A8."""
        return not (self.gated or self.gemma4) and fp8.takes_rows(self.qkv_proj)

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
        if self.gated:
            return gated_rotated(self, x, rope, cache)
        if self.gemma4:
            return self._gemma4_rotated(x, rope, cache)
        proj = self.qkv_proj
        if x.is_cuda:  # maybe split-K partials: the RoPE kernel sums them
            qkv = decode_split.fp8_qkv(x, proj) if proj.fp8 else fused.qkv_partials(x, proj.weight, proj.bias)
        else:
            qkv = proj(x)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        return fused.rope_qkv(qkv, *rope, *shape, cache, x.dtype, norms)

    def _gemma4_rotated(
        self, x: torch.Tensor, rope: Rope, cache: fused.KVWrite | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``_rotated`` of a Gemma 4 layer: the projection as one matmul (V's norm needs the product
        itself, not split-K partials), V normed (from K's projection with ``k_eq_v``) into the
        [q | k | v] row the RoPE kernel takes; a KV-shared layer's q alone, with k and v None."""
        qkv = self.qkv_proj(x)  # [T, W]
        if not self.writes_kv:  # the source layer's cache holds this layer's K/V
            norm = (self.q_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None
            return fused.rope_q(qkv.view(-1, self.num_heads, self.head_dim), *rope, norm), None, None
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        if self.v_norm_eps is not None or self.k_eq_v:
            qkv = fused.qkv_with_v(qkv, *shape, self.k_eq_v, self.v_norm_eps)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None
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
        # With write_kv the new tokens' K/V go into their slots (in the RoPE kernel on CUDA);
        # attention then reads everything from the cache.
        cache = kv_write(kv_layer, meta.slot_mapping) if write_kv and self.writes_kv else None
        q, _, _ = self._qkv(x, positions, rotary, rope, cache)
        return self.output(self.attend(q, kv_layer, meta, backend, queried=cache is not None))

    def attend(
        self,
        q: torch.Tensor,
        kv_layer: tuple,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        queried: bool = False,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Attention of q over this layer's cache, with this layer's scale, window and sinks. ``queried``:
        q is ``query``'s over this cache, which an e4m3 one's RoPE kernel turned where it wrote K."""
        scales = scales_of(kv_layer)  # an e4m3 cache's (attention/kv_quant.py)
        turned = queried and self.writes_kv and scales is not None
        return attend_layer(backend, q, *kv_layer, meta, self.scale, self.window, self.sinks, scales, turned)

    def query(self, x: torch.Tensor, rope: Rope, cache: fused.KVWrite) -> torch.Tensor:
        """q [T, Hq, D] of the tokens ``x``, their K/V written to the cache: the work before attention
        (a KV-shared layer writes none: ``_gemma4_rotated`` leaves its cache alone)."""
        return self._rotated(x, rope, cache)[0]

    def output(
        self, out: torch.Tensor, for_norm: bool = False
    ) -> torch.Tensor | fused.PeerSum:  # attention output [T, Hq, D] -> [T, hidden] (or [S, T, hidden])
        """o_proj of the attention output, the ranks' partial products summed (with ``for_norm``,
        maybe by the norm that follows: ``RowParallelLinear.reduced``'s ``ATTENTION_SLOT``). With
        ``for_norm`` in one process it may be fp32 split-K partials [S, T, hidden] that norm sums
        (``decode_split.partials``)."""
        if self.gated:
            out = gated_output(self, out)
        flat = out.reshape(out.shape[0], self.num_heads * self.head_dim)
        if hasattr(self, "o_bias"):  # the sum, then the bias once
            return self.o_proj.reduced(flat, self.shard) + self.o_bias
        if for_norm and not self.shard.parallel and flat.is_cuda:  # the norm may sum split-K partials
            parts = decode_split.partials(flat, self.o_proj)
            if parts is not None:
                return parts
        return self.o_proj.reduced(flat, self.shard, slot=ATTENTION_SLOT if for_norm else None)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, intermediate_size: int | None = None) -> None:
        """``intermediate_size``: the layer's own (Gemma 4's double-wide MLPs), else the config's."""
        super().__init__()
        self.shard = shard
        self.act = config.hidden_act  # silu (Llama, Qwen) or gelu_pytorch_tanh (Gemma)
        inter = intermediate_size or config.intermediate_size
        cols = shard.span(inter)
        parts = [("gate_proj", cols, inter), ("up_proj", cols, inter)]
        self.gate_up_proj = MergedLinear(config.hidden_size, parts, bias=False)
        self.down_proj = RowParallelLinear(inter, cols, config.hidden_size)

    @property
    def takes_rows(self) -> bool:
        """Whether the norm before may hand the gate-up product its input's FP8 codes (``fp8.takes_rows``)."""
        return fp8.takes_rows(self.gate_up_proj)

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor | fused.PeerSum:  # [T, hidden]
        """The MLP's output; with ``partials`` (for a norm next: ``fused.add_rms_norm`` takes them)
        maybe the down projection's fp32 split-K partials [S, T, hidden] instead (one process), or
        on the fused path (``product_slot``) the ranks' products unsummed (``PeerSum``, ``MLP_SLOT``)."""
        # [T, I] (this rank's columns: on a GPU without the [T, 2I] product), then the ranks' sums added
        gelu = self.act == "gelu_pytorch_tanh"
        if x.is_cuda and not self.gate_up_proj.fp8:
            act = fused.linear_silu_and_mul(x, self.gate_up_proj.weight, gelu)
        else:  # FP8 weights: one kernel at a decode step's rows, else the product then SiLU-and-mul
            quantize = fp8.takes_rows(self.down_proj)
            act = fp8.gated(self.gate_up_proj, x, gelu, quantize)
            if act is None:
                act = fused.silu_and_mul(self.gate_up_proj(x), gelu, quantize)
        if partials and not self.shard.parallel and act.is_cuda:
            parts = decode_split.partials(act, self.down_proj)
            if parts is not None:
                return parts
            if not self.down_proj.fp8:
                return fused.linear_partials(act, self.down_proj.weight)
        return self.down_proj.reduced(act, self.shard, slot=MLP_SLOT if partials else None)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with ``sandwich_norms`` (Gemma) each block's output is
    normed too before its residual add: ``post_attention_layernorm`` then follows attention and
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` surround the MLP (HF's names).

    Gemma 4's MoE layers add experts beside the MLP (``router``, ``experts``, their norms: HF's
    ``enable_moe_block``). Gemma 4 adds, after the MLP's residual add, the layer's per-layer input
    (``per_layer_input_gate``, ``per_layer_projection``, ``post_per_layer_input_norm``:
    ``_add_per_layer_input``) and scales the stream by ``layer_scalar``; such a layer hands the next
    the whole stream (residual None)."""

    def __init__(
        self, config: ModelConfig, shard: Shard, spec: LayerSpec, rope_index: int = 0, index: int = 0
    ) -> None:
        super().__init__()
        self.spec, self.rope_index = spec, rope_index  # rope_index: which of the step's angles
        self.index = index
        self.linear = spec.kind == LINEAR  # Gated DeltaNet in place of attention (``gated_delta.py``)
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, index)
        else:
            self.self_attn = Attention(config, shard, spec)
        self.mlp = MoE(config, shard) if spec.moe else MLP(config, shard, spec.intermediate_size)
        if spec.moe and config.shared_expert_intermediate_size:  # Qwen3-Next, Qwen3.5-MoE
            self.mlp.shared_expert = MLP(config, shard, config.shared_expert_intermediate_size)
            self.mlp.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        width = config.hidden_size_per_layer_input
        if width:  # replicated under tensor parallelism: each rank has the whole stream
            self.per_layer_input_gate = Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection = Linear(width, config.hidden_size, bias=False)
            self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.layer_scalar:  # a checkpoint tensor of one element (HF's buffer)
            self.layer_scalar = nn.Parameter(torch.ones(1))
        if config.moe_beside_mlp:  # Gemma 4's experts beside the dense MLP (HF's names)
            self.shard = shard
            self.router = Gemma4Router(config)
            self.experts = Experts(config, shard, GATE_UP_STACKED)
            for name in (
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ):
                setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.whole_stream = bool(width) or config.layer_scalar

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
        if self.linear:  # the step's state slots, not the KV cache
            x, residual = self.input_layernorm.with_stream(h, residual)
            step = meta.linear or LinearStep.scratch(meta.query_lens_host, meta.seq_lens_host)
            x, residual = self.post_attention_layernorm(self.linear_attn(x, step), residual)
            return self.mlp(x, partials=True), residual
        q, residual = self.before_attention(h, residual, rope, kv_write(kv_layer, meta.slot_mapping))
        out = self.self_attn.attend(q, kv_layer, meta, backend, queried=True)
        return self.after_attention(out, residual, rope)

    def before_attention(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: Ropes, cache: fused.KVWrite
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, residual stream): the input norm, then q/k/v with RoPE, K/V written to ``cache``."""
        x, residual = self.input_layernorm.with_stream(h, residual, self.self_attn.takes_rows)
        return self.self_attn.query(x, rope[self.rope_index], cache), residual

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, rope: Ropes
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(MLP output, residual stream before it): o_proj, the post-attention norm, the MLP. Gemma 4's
        layers return (the whole stream, None): the per-layer input and the scalar follow the add."""
        if self.sandwich:  # the block outputs are normed before their residual adds
            # the attention's norm and the MLP's input norm in one kernel
            x, residual = self.pre_feedforward_layernorm.after(
                self.post_attention_layernorm, self.self_attn.output(out), residual
            )
            if hasattr(self, "experts"):  # Gemma 4: the experts, on the stream, beside the MLP
                routed = self.experts(self.pre_feedforward_layernorm_2(residual), *self.router(residual))
                mlp = self.post_feedforward_layernorm_1(self.mlp(x)) + self.post_feedforward_layernorm_2(
                    self.shard.all_reduce(routed)
                )
            else:  # the down projection's split-K partials (or the ranks' products) summed by its norm
                mlp = self.mlp(x, partials=True)
            mlp = self.post_feedforward_layernorm(mlp, dtype=residual.dtype)
            if not self.whole_stream:
                return mlp, residual
            stream = residual + mlp
            if hasattr(self, "per_layer_input_gate"):
                stream = self._add_per_layer_input(stream, rope.per_layer)
            if hasattr(self, "layer_scalar"):
                stream = stream * self.layer_scalar
            return stream, None
        quantize = isinstance(self.mlp, MLP) and self.mlp.takes_rows
        attn = self.self_attn.output(out, for_norm=True)
        x, residual = self.post_attention_layernorm(attn, residual, quantize)
        return self.mlp(x, partials=True), residual  # the next norm sums split-K partials or ranks

    def _add_per_layer_input(
        self,
        stream: torch.Tensor,
        inputs: torch.Tensor | None,  # [T, hidden], [T, layers, P]
    ) -> torch.Tensor:
        """Gemma 4: ``stream + norm(proj(act(gate(stream)) * per_layer_input))``, the layer's slice of
        the step's per-layer inputs (``LlamaBody.per_layer_inputs``, carried in the step's ``Ropes``)."""
        assert inputs is not None, "a layer with per-layer inputs in a step that made none"
        per_layer = inputs[:, self.index]  # [T, P]
        gated = fused.activation(self.per_layer_input_gate(stream), self.mlp.act) * per_layer
        return stream + self.post_per_layer_input_norm(self.per_layer_projection(gated))


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        ropes = distinct_ropes(config)
        specs = [config.layer_spec(i) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(
            DecoderLayer(config, shard, s, ropes.index(s.rope), i) for i, s in enumerate(specs)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.embed_scale  # Gemma: sqrt(hidden), applied in the model's dtype
        width = self.per_layer_width = config.hidden_size_per_layer_input
        if width:  # Gemma 4's per-layer input embeddings, every layer's packed in one row
            layers, vocab = config.num_hidden_layers, config.vocab_size_per_layer_input
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, layers * width, shard)
            self.per_layer_model_projection = Linear(config.hidden_size, layers * width, bias=False)
            self.per_layer_projection_norm = RMSNorm(width, config.rms_norm_eps)
        self.hidden_size = config.hidden_size

    def per_layer_inputs(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:  # [T, L, P]
        """Gemma 4's per-layer inputs: the embeddings ``embeds`` [T, hidden] (scaled) projected to
        every layer's slice, times ``hidden ** -0.5``, RMS-normed per slice, plus the tokens' rows of
        ``embed_tokens_per_layer`` times ``sqrt(P)``; the sum times ``2 ** -0.5`` (HF's order and
        dtypes: the Python-float scales are applied as such, the table's in the model's dtype)."""
        tokens, width = ids.shape[0], self.per_layer_width
        proj = self.per_layer_model_projection(embeds) * self.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(-1, width)).view(tokens, -1, width)
        table = self.embed_tokens_per_layer(ids)
        table = (table * torch.tensor(width**0.5, dtype=table.dtype)).view(tokens, -1, width)
        return (proj + table) * 2.0**-0.5

    def embed(self, ids: torch.Tensor) -> torch.Tensor | fused.PeerSum:  # [T] -> [T, hidden]
        """The embeddings of ``ids``, scaled where the family scales them (then summed over ranks here)."""
        if self.embed_scale is None:
            return self.embed_tokens.summed_later(ids)
        h = self.embed_tokens(ids)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)


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
        rope = self.step_inputs(input_ids, positions, h)
        residual = None
        for i, (layer, kv_layer) in enumerate(zip(self.model.layers, kv_cache, strict=True)):
            if before_layer is not None:
                before_layer(i)
            h, residual = layer(h, residual, rope, kv_layer, meta.for_layer(i), backend)
        return self.model.norm.with_stream(h, residual)[0]  # residual None after a Gemma 4 layer

    def cos_sin(self, positions: torch.Tensor) -> Ropes:
        """The step's RoPE angles, once per distinct RoPE, shared by the layers that use it."""
        return Ropes(rotary.cos_sin(positions) for rotary in self.ropes)

    def step_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, h: torch.Tensor) -> Ropes:
        """The step's ``Ropes``: its angles and, with Gemma 4's per-layer inputs, those (from the ids
        and their embeddings ``h``); every layer gets them."""
        rope = self.cos_sin(positions)
        if self.model.per_layer_width:
            assert isinstance(h, torch.Tensor)  # Gemma's embeddings are scaled: summed already
            rope.per_layer = self.model.per_layer_inputs(input_ids, h)
        return rope

    def reset_ropes(self, device: torch.device) -> None:
        """Recompute the RoPE tables on ``device`` (after building on the meta device)."""
        for rotary in self.ropes:
            rotary.inv_freq = rope_inv_freq(self.full_config, rotary.spec).to(device)

    # ---- the forward in pieces between attentions (``worker/piecewise_graph.py`` replays them) ----
    # forward == first_piece, then for each layer l: attention, then piece(l + 1) (last_piece after
    # the last layer); the same ops in the same order.
    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: fused.KVWrite
    ) -> tuple[torch.Tensor, torch.Tensor, Ropes]:
        """(layer 0's q, the residual stream, the step's RoPE angles) from the token ids."""
        h = self.model.embed(input_ids)
        rope = self.step_inputs(input_ids, positions, h)
        q, residual = self.model.layers[0].before_attention(h, None, rope, cache)
        return q, residual, rope

    def middle_piece(
        self, layer: int, out: torch.Tensor, residual: torch.Tensor, rope: Ropes, cache: fused.KVWrite
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer - 1``'s attention output ``out`` -> (layer ``layer``'s q, the residual stream)."""
        h, residual = self.model.layers[layer - 1].after_attention(out, residual, rope)
        return self.model.layers[layer].before_attention(h, residual, rope, cache)

    def last_piece(self, out: torch.Tensor, residual: torch.Tensor, rope: Ropes) -> torch.Tensor:
        """The last layer's attention output -> final hidden states [T, hidden]."""
        h, residual = self.model.layers[-1].after_attention(out, residual, rope)
        return self.model.norm.with_stream(h, residual)[0]

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
        layers, h = self.model.layers, self.model.embed(input_ids)
        rope = self.step_inputs(input_ids, positions, h)
        first = layers[0]
        x, residual = first.input_layernorm.with_stream(h)
        if len(layers) == 1:
            _, k, v = first.self_attn.project(x, positions, self.rotary, rope[first.rope_index])
            return k, v
        q, _, _ = first.self_attn.project(x, positions, self.rotary, rope[first.rope_index])
        out = first.self_attn.attend(q, kv_cache[0], meta, backend)
        h, residual = first.after_attention(out, residual, rope)
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
