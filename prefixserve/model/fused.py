"""The dense path's work between attentions, each piece one call: Triton kernels on CUDA, torch elsewhere.

The model calls these instead of chains of small torch ops (issue 28): on a GPU each piece is one
kernel of ``prefixserve/model/kernels/`` (graph-safe: no host syncs, no value-dependent branches);
on a CPU, or without Triton, it is the torch code below, whose arithmetic is exactly the unfused
model's (the same ops in the same order, so fp32 outputs are bit-identical to it and to HF's).

``triton_kernels(False)`` forces the torch path on CUDA too: tests and benchmarks compare the two.
``linear`` is a matmul: a decode step's few rows through the skinny kernel where it beat cuBLAS
(Hopper), ``F.linear`` everywhere else; ``linear_silu_and_mul`` is the MLP's gate-up matmul with its
activation, one kernel on Hopper where that beat the pair; ``moe_route`` / ``moe_experts`` a mixture
of experts' routing and routed experts (``kernels/fused_moe.py`` on CUDA, ``moe_reference`` elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from prefixserve.attention.kv_quant import scales_of, store_kv, turn_query
from prefixserve.model.partial_sums import check_partials_dtype, summed_partials
from prefixserve.model.peer_allreduce import PeerSum
from prefixserve.triton_support import triton_available

# the A/B switches below, read on every call
_SWITCHES = {
    "triton": True,
    "skinny": True,
    "gate_up": True,
    "moe_route_in_up": True,
    "router_split": True,
    "split_k": True,
    "staged_allreduce": True,
    "peer_norm": True,
    "moe_parts": True,
    "fp8_mid": True,
}
# k_cache, v_cache, slot per token (int64); an FP8 cache's carries its scales (kv_quant.with_scales)
KVWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _use_triton(x: torch.Tensor) -> bool:
    return _SWITCHES["triton"] and x.is_cuda and triton_available()


def split_k_taken(x: torch.Tensor) -> bool:
    """Whether a product of ``x`` may hand the next kernel split-K partials: the switch on
    (``split_k_products``) and x on the Triton path."""
    return _SWITCHES["split_k"] and _use_triton(x)


def router_split_taken(x: torch.Tensor) -> bool:
    """Whether a direct MoE step of ``x`` routes in the up kernel and may hand it the router's
    split-K partials: the switches on (``moe_routing_in_experts``, ``router_split_k``,
    ``split_k_products``) and x on the Triton path."""
    return _SWITCHES["moe_route_in_up"] and _SWITCHES["router_split"] and split_k_taken(x)


def fp8_mid_taken() -> bool:
    """Whether FP8 W8A8 products past 64 rows (up to ``fp8_matmul.MID_ROWS``) before a norm run on
    the Triton kernel in K slices (``decode_split``): the switch (``fp8_mid_products``)."""
    return _SWITCHES["fp8_mid"]


def fp8_mid_products(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, FP8 products past 64 rows before a norm may run in K slices on the Triton
    kernel (True) or as cuBLASLt's one GEMM (False): A/B runs."""
    return _switched("fp8_mid", enabled)


def gate_up_taken(x: torch.Tensor) -> bool:
    """Whether a decode step's gate-up product of ``x`` may run with its activation fused (an FP8
    layer's ``fp8.gated``): the switch on (``gate_up_kernels``) and x on the Triton path."""
    return _SWITCHES["gate_up"] and _use_triton(x)


@contextmanager
def _switched(name: str, enabled: bool) -> Iterator[None]:
    before, _SWITCHES[name] = _SWITCHES[name], enabled
    try:
        yield
    finally:
        _SWITCHES[name] = before


def triton_kernels(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, CUDA tensors take the Triton kernels (True) or the torch path (False)."""
    return _switched("triton", enabled)


def skinny_matmuls(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, a decode step's linear layers take the skinny kernel where its rule says
    (True) or cuBLAS always (False): A/B runs of that kernel alone."""
    return _switched("skinny", enabled)


def gate_up_kernels(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, the MLP's gate-up projection and SiLU-and-mul run as one kernel where its
    rule says (True) or as the matmul then the SiLU-and-mul kernel (False): A/B runs."""
    return _switched("gate_up", enabled)


def moe_routing_in_experts(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, a direct MoE step (one or two tokens) routes in the up kernel's prologue
    (True) or in the route kernel before it (False): A/B runs."""
    return _switched("moe_route_in_up", enabled)


def router_split_k(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, a direct MoE step's router hands the up kernel split-K partials (True) or
    runs whole (False): A/B runs."""
    return _switched("router_split", enabled)


def moe_parts_to_norm(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, a mixture of experts followed by a norm hands it each token's k weighted
    expert outputs to sum (True) or sums them in its combine kernel first (False): A/B runs."""
    return _switched("moe_parts", enabled)


def peer_norms(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Turn the fused two-rank all-reduce + add + RMSNorm on or off (A/B runs)."""
    return _switched("peer_norm", enabled)


def split_k_products(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, the projections before a norm may hand it split-K partials where the rule
    says (True) or always run as one matmul (False): A/B runs."""
    return _switched("split_k", enabled)


# (first row, last row, K splits) of a projection whose output goes to the next norm (the down
# projection, K >= SPLIT_K_MIN_K): a batched matmul over K slices writes fp32 partials and the norm
# sums them, in place of cuBLAS's split-K GEMM and its reduce kernel (``benchmarks/probes/split_k.py``).
SPLIT_K_ROWS: list[tuple[int, int, int]] = [(65, 320, 2)]
SPLIT_K_MIN_K = 8192  # the o projection (K = hidden) timed level with cuBLAS at 128 and 256 rows
# The same for the attention's qkv projection where it has at most QKV_SPLIT_K_MAX_N columns (a
# narrow tensor-parallel shard's): the RoPE kernel sums the partials (``split_k.py --qkv``). Wider
# shards (the 8B's 3,072 at TP=2) ran faster as a pair but slower in whole steps at the power cap.
QKV_SPLIT_K_ROWS: list[tuple[int, int, int]] = [(64, 256, 2)]
QKV_SPLIT_K_MAX_N = 2048


def split_k_for(
    x: torch.Tensor,
    weight: torch.Tensor,
    rows_rule: list[tuple[int, int, int]] | None = None,
    min_k: int | None = None,
) -> int:
    """How many K slices ``linear_partials`` cuts this product into (0: one matmul): ``rows_rule``
    (default ``SPLIT_K_ROWS``) for products with K >= ``min_k`` (default ``SPLIT_K_MIN_K``). Hopper
    only, where it was measured; 16-bit, contiguous rows, K slices of whole 64-column steps."""
    if not (_SWITCHES["split_k"] and _use_triton(x) and x.dtype in (torch.float16, torch.bfloat16)):
        return 0
    from prefixserve.model.kernels import skinny_matmul

    rows, k = x.shape
    if (
        k < (SPLIT_K_MIN_K if min_k is None else min_k)
        or not (x.is_contiguous() and weight.is_contiguous())
        or weight.dtype != x.dtype
    ):
        return 0
    if not _bmm_takes_out_dtype():
        return 0
    for lo, hi, splits in SPLIT_K_ROWS if rows_rule is None else rows_rule:
        if lo <= rows <= hi and k % (splits * 64) == 0:
            return splits if skinny_matmul.hopper(x.device) else 0
    return 0


@functools.cache
def _bmm_takes_out_dtype() -> bool:
    """Whether this torch has ``torch.bmm(..., out_dtype=)`` (fp32 products of 16-bit inputs; 2.11 has it)."""
    return "dtype" in torch.ops.aten.bmm.overloads()


def split_k_matmul(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """fp32 partials [S, T, N] of ``x @ weight.T`` over S equal slices of K: one strided batched
    cuBLAS matmul (the slices are views, nothing is copied). Their sum is the product."""
    return torch.bmm(*split_k_operands(x, weight, splits), out_dtype=torch.float32)


def split_k_operands(x: torch.Tensor, weight: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views a [S, T, K/S] of x [T, K] and b [S, K/S, N] of weight [N, K]: a[s] @ b[s] is the product
    over K's s-th slice (strides cuBLAS's strided batched matmul takes as they are)."""
    tokens, k = x.shape
    part = k // splits
    a = x.view(tokens, splits, part).transpose(0, 1)
    b = weight.view(weight.shape[0], splits, part).permute(1, 2, 0)
    return a, b


def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(x, weight)`` [T, N], or where ``split_k_for`` says so its fp32 split-K partials
    [S, T, N], which ``add_rms_norm`` takes as its x and sums (one kernel fewer than cuBLAS's own
    split K, which reduces its partials in a kernel of its own)."""
    splits = split_k_for(x, weight)
    return split_k_matmul(x, weight, splits) if splits else linear(x, weight)


def qkv_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The qkv projection ``linear(x, weight, bias)`` [T, W], or where ``QKV_SPLIT_K_ROWS`` says so
    (a shard's few columns, no bias) its fp32 split-K partials [S, T, W], which ``rope_qkv`` sums:
    cuBLAS's one matmul leaves SMs idle at those shapes."""
    splits = 0
    if bias is None and weight.shape[0] <= QKV_SPLIT_K_MAX_N:
        splits = split_k_for(x, weight, QKV_SPLIT_K_ROWS, min_k=0)
    return split_k_matmul(x, weight, splits) if splits else linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on CUDA, a decode step's few rows through the skinny kernel wherever its sweep
    read the weight faster than cuBLAS (``kernels/skinny_matmul.py``)."""
    if _SWITCHES["skinny"] and _use_triton(x):
        from prefixserve.model.kernels import skinny_matmul

        out = skinny_matmul.linear_if_faster(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def staged_allreduce(x: torch.Tensor) -> bool:
    """Whether a row-parallel product goes straight into the peer all-reduce buffer (``linear_into``)
    rather than into a tensor of its own and a copy in."""
    return _SWITCHES["staged_allreduce"] and x.is_cuda


def peer_norm_enabled() -> bool:
    """Whether a two-rank all-reduce followed by a residual add and an RMSNorm runs as one kernel
    (``kernels/peer_norm.py``) rather than the two-shot all-reduce and ``add_rms_norm``."""
    return _SWITCHES["peer_norm"] and triton_available()


def shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, out: torch.Tensor) -> torch.Tensor:
    """A vocabulary shard's lookups of ``ids`` (zeros for ids other ranks hold) written into ``out``:
    one kernel (``kernels/embedding.py``) where Triton runs, else the torch path."""
    if _use_triton(ids):
        from prefixserve.model.kernels.embedding import shard_embedding as kernel

        return kernel(ids, weight, start, out)
    return out.copy_(shard_lookup(ids, weight, start))


def shard_lookup(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """The torch path of a vocabulary shard's lookups: rows of ``weight`` for the ids this shard
    holds (``start`` is its first), zeros for the others."""
    local = ids - start
    mine = (local >= 0) & (local < weight.shape[0])
    return F.embedding(torch.where(mine, local, 0), weight) * mine[:, None].to(weight.dtype)


def linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``linear(x, weight)`` (no bias) written into ``out`` [M, N]: the skinny kernel where it wins,
    else cuBLAS (``torch.mm(..., out=)``)."""
    if skinny_wins(x, weight):
        from prefixserve.model.kernels import skinny_matmul

        written = skinny_matmul.linear_if_faster(x, weight, None, out=out)
        if written is not None:
            return written
    return torch.mm(x, weight.t(), out=out)


def skinny_wins(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes the skinny kernel for this product (it writes a tensor of its own)."""
    if not (_SWITCHES["skinny"] and _use_triton(x)):
        return False
    from prefixserve.model.kernels import skinny_matmul

    rows, cols = x.shape[0], weight.shape[0]
    return skinny_matmul.supported(x, weight) and skinny_matmul.skinny_config(rows, cols) is not None


def add_rms_norm(
    x: torch.Tensor | PeerSum,  # [T, N], [S, T, N] partials (``partial_sums``), or the ranks' products
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
    quantize: bool = False,
    pre: tuple[torch.Tensor, float] | None = None,  # a norm of x first: (weight, eps)
    dtype: torch.dtype | None = None,  # what partials without a residual are rounded to
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``; with no residual, ``(rms_norm(x) * weight, x)``.
    ``quantize``: an FP8 projection that quantizes per token reads the first next; on the kernel's
    path it carries its e4m3 codes (``fp8_rows.attach_rows``), made in the same pass. ``pre``:
    Gemma's sandwich, x normed by its own weight before the add (one kernel for the two norms).

    The add is done in the model dtype, the statistics in fp32 and the result cast back before the
    weight multiply, as HF's RMSNorm after its residual add. Partials are summed in fp32 and rounded
    to the model dtype first (the residual's, else ``dtype``), as a split-K matmul's own reduce does.
    Two ranks' products (``PeerSum``) are summed over NVLink in the same kernel; without a residual
    (the embedding's lookups) the second output is that sum, a new tensor.
    """
    if isinstance(x, PeerSum):
        if pre is not None:
            raise ValueError("a norm before the add takes the ranks' sum, not their products")
        return x.add_rms_norm(residual, weight, eps)
    if _use_triton(x):
        from prefixserve.model.kernels import rms_norm

        if x.shape[-1] <= rms_norm.MAX_HIDDEN:  # a row must fit one program's registers
            if not quantize:
                return rms_norm.add_rms_norm(x, weight, eps, residual, pre=pre, dtype=dtype)
            from prefixserve.model.fp8_rows import attach_rows

            out, summed, codes, scales = rms_norm.add_rms_norm(
                x, weight, eps, residual, quantize=True, pre=pre, dtype=dtype
            )
            return attach_rows(out, codes, scales), summed
    if x.dim() == 3:
        dtype = residual.dtype if residual is not None else dtype
        check_partials_dtype(x, dtype)
        x = summed_partials(x, dtype)
    if pre is not None:
        x = add_rms_norm(x, *pre)[0]
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,  # [T], [D/2] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, D] fp32
    """cos and sin of every token's angles in HF's [T, D] layout (both halves equal).

    Computed once per step for all layers (the unfused model did it in every layer), from the
    positions themselves: positions are data, so no table bounds them.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] (any strides) into a new contiguous tensor, without a cat.

    ``x * cos`` first, then the halves' cross terms are subtracted and added in place: the same
    products and sums as HF's ``x * cos + cat(-x2, x1) * sin``, so the result is bit-identical.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
    out = xf * c  # [T, H, D] fp32, new
    out[..., :half] -= xf[..., half:] * s[..., :half]
    out[..., half:] += xf[..., :half] * s[..., half:]
    return out.to(x.dtype)


def rope_qkv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
    cos: torch.Tensor,  # [T, D] fp32
    sin: torch.Tensor,  # [T, D] fp32
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache: KVWrite | None = None,
    dtype: torch.dtype | None = None,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection into q [T, Hq, D] and k [T, Hkv, D] (RoPE applied, contiguous) and
    v [T, Hkv, D]; with ``cache``, also write k and v into their cache slots (an e4m3 cache with its
    scales: q then comes as attention over it takes it, ``kv_quant.turn_query``). ``qkv`` may be the
    projection's fp32 split-K partials [S, T, W] (``qkv_partials``), with ``dtype`` the model's:
    their sum rounded to it is the projection. ``norms`` (q's and k's RMSNorm weights over a head's
    dims, eps): QK-norm before RoPE (Qwen3, Gemma 3), in the same kernel on CUDA."""
    if _use_triton(qkv):
        from prefixserve.model.kernels.rope import rope_qkv as kernel

        return kernel(qkv, cos, sin, num_heads, num_kv_heads, head_dim, cache, dtype, norms)
    if qkv.dim() == 3:
        if dtype is None:
            raise ValueError("split-K partials need the model's dtype")
        qkv = qkv.sum(0).to(dtype)
    tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, num_heads, head_dim), k.reshape(tokens, num_kv_heads, head_dim)
    if norms is not None:  # over each head's dims: heads as rows
        q = add_rms_norm(q.reshape(-1, head_dim), norms[0], norms[2])[0].view(q.shape)
        k = add_rms_norm(k.reshape(-1, head_dim), norms[1], norms[2])[0].view(k.shape)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    v = v.view(tokens, num_kv_heads, head_dim)
    if cache is not None:  # quantized to e4m3 with the layer's scales for an FP8 cache
        store_kv(cache, k, v, num_kv_heads, head_dim)
        scales = scales_of(cache)
        if scales is not None:  # q as attention over that cache takes it (as the kernel's)
            q = turn_query(q, scales[0])
    return q, k, v


def rope_q(
    q: torch.Tensor,  # [T, Hq, D], any strides
    cos: torch.Tensor,  # [T, D] fp32
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None = None,  # q's RMSNorm weight over a head's dims, eps
) -> torch.Tensor:  # [T, Hq, D], new and contiguous
    """q alone, QK-normed if ``norm``, RoPE applied: a Gemma 4 KV-shared layer, which projects no K or
    V. Torch on CUDA too: the RoPE kernel (``rope_qkv``) needs at least one KV head."""
    if norm is not None:  # over each head's dims: heads as rows
        q = add_rms_norm(q.reshape(-1, q.shape[-1]), norm[0], norm[1])[0].view(q.shape)
    return apply_rope(q, cos, sin)


def qkv_with_v(
    qkv: torch.Tensor,  # [T, (Hq + Hkv) D] with k_eq_v, else [T, (Hq + 2 Hkv) D]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_eq_v: bool,
    v_eps: float | None,  # V's weightless RMSNorm (Gemma 4's ``v_norm``); None: none
) -> torch.Tensor:  # [T, (Hq + 2 Hkv) D]: the row ``rope_qkv`` takes
    """Gemma 4's V before the RoPE kernel: with ``k_eq_v`` the K projection as it comes out of the
    matmul (before K's norm and RoPE), appended as V; then each V head normed by ``x / sqrt(mean(x^2)
    + eps)`` in fp32 and cast back (HF's ``Gemma4RMSNorm(with_scale=False)``, its ``pow(.., -0.5)``
    too). Torch on every device (a few elementwise ops on the KV columns only)."""
    tokens, q_cols = qkv.shape[0], num_heads * head_dim
    kv_cols = num_kv_heads * head_dim
    v = qkv[:, q_cols : q_cols + kv_cols] if k_eq_v else qkv[:, q_cols + kv_cols :]
    if v_eps is not None:
        vf = v.reshape(tokens, num_kv_heads, head_dim).float()
        v = (vf * torch.pow(vf.pow(2).mean(-1, keepdim=True) + v_eps, -0.5)).to(qkv.dtype).view(tokens, -1)
    if k_eq_v:
        return torch.cat((qkv, v), dim=-1)
    qkv[:, q_cols + kv_cols :] = v  # the projection's own output, written in place
    return qkv


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """The MLP activation ``act`` (``silu`` or ``gelu_pytorch_tanh``) alone: Gemma 4's per-layer
    input gate (torch on every device)."""
    return F.gelu(x, approximate="tanh") if act == "gelu_pytorch_tanh" else F.silu(x)


def silu_and_mul(x: torch.Tensor, gelu: bool = False, quantize: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate-up projection's two halves [T, 2 I] -> [T, I] (``gelu``:
    the tanh GELU's, Gemma's ``gelu_pytorch_tanh``). ``quantize``: as ``add_rms_norm``'s (an FP8 down
    projection next)."""
    if _use_triton(x):
        from prefixserve.model.kernels import silu_mul

        if not quantize:
            return silu_mul.silu_and_mul(x, gelu)
        from prefixserve.model.fp8_rows import attach_rows

        return attach_rows(*silu_mul.silu_and_mul_quantize(x, gelu))
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight), gelu)`` of the fused gate-up weight [2 I, K] ([T, K] ->
    [T, I]); on a Hopper GPU one kernel with the activation in its epilogue where its sweep beat the
    pair (``kernels/gate_up.py``): the [T, 2 I] product is never written. ``gelu``: the tanh GELU
    (Gemma) instead of SiLU, in the same kernels."""
    if _SWITCHES["gate_up"] and _use_triton(x):
        from prefixserve.model.kernels import gate_up

        out = gate_up.gate_up_silu(x, weight, gelu)
        if out is not None:
            return out
    return silu_and_mul(linear(x, weight), gelu)


def moe_route(
    logits: torch.Tensor, top_k: int, rule: str, norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] -> weights [T, k] fp32, ids [T, k]
    """Each token's ``top_k`` experts and weights by the family's ``rule`` (``moe_reference.route_ref``):
    one kernel on CUDA (``kernels/fused_moe.py``), a stable sort elsewhere; ties to the lower index."""
    if _use_triton(logits):
        from prefixserve.model.kernels import fused_moe

        return fused_moe.route(logits, top_k, rule, norm)
    from prefixserve.model.moe_reference import route_ref

    return route_ref(logits, top_k, rule, norm)


def _hands_parts(parts: bool) -> bool:
    """Whether the fused MoE kernels leave a token's k rows for the norm next (asked for and switched
    on: ``moe_parts_to_norm``) rather than combine them."""
    return parts and _SWITCHES["moe_parts"]


def moe_routed_experts(
    x: torch.Tensor,  # [T, H]
    logits: torch.Tensor,  # [T, E] the router's, or its split-K partials [S, T, E] (``decode_split``)
    route: tuple[int, str, bool],  # top k, rule, norm (``moe_route``'s)
    w_up: torch.Tensor,  # [E 2I, H]
    w_down: torch.Tensor,  # [E H, I]
    act: str,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    parts: bool = False,
) -> torch.Tensor:  # [T, H], or [k, T, H] parts
    """``moe_experts`` weighted by ``moe_route(logits, *route)``: on CUDA, a decode step of one or
    two tokens (``fused_moe.DIRECT_MAX`` assignments) routes inside the up kernel
    (``fused_moe.routed_forward``: one launch fewer, the same bits). ``parts``: as ``moe_experts``'."""
    if _SWITCHES["moe_route_in_up"] and _use_triton(x):
        from prefixserve.model.kernels import fused_moe

        if x.shape[0] * route[0] <= fused_moe.DIRECT_MAX:
            kind = fused_moe.ACTIVATIONS[act]
            return fused_moe.routed_forward(
                x, logits, *route, w_up, w_down, kind, up_bias, down_bias, alpha, limit,
                summed=not _hands_parts(parts),
            )  # fmt: skip
    if logits.dim() == 3:
        logits = summed_partials(logits, x.dtype)
    weights, ids = moe_route(logits, *route)
    return moe_experts(x, w_up, w_down, weights, ids, act, up_bias, down_bias, alpha, limit, parts)


def moe_experts(
    x: torch.Tensor,  # [T, H]
    w_up: torch.Tensor,  # [E 2I, H]
    w_down: torch.Tensor,  # [E H, I]
    weights: torch.Tensor,  # [T, k] fp32
    ids: torch.Tensor,  # [T, k]
    act: str,
    up_bias: torch.Tensor | None = None,  # [E 2I]
    down_bias: torch.Tensor | None = None,  # [E H]
    alpha: float = 1.702,  # gpt-oss's clamped SwiGLU (act "swiglu_oai")
    limit: float = 7.0,
    parts: bool = False,
) -> torch.Tensor:  # [T, H], or [k, T, H] parts
    """The routed experts' gated MLPs (``act``), weighted and summed per token: on CUDA the fused
    kernels (``kernels/fused_moe.py``), else the reference loop over the experts touched. ``parts``
    (for an ``add_rms_norm`` next, which sums them alike): on the fused kernels, each token's k
    weighted outputs unsummed, [k, T, H] (``fused_moe.hand_parts``: no combine launch)."""
    if _use_triton(x):
        from prefixserve.model.kernels import fused_moe

        ids32 = ids if ids.dtype == torch.int32 else ids.to(torch.int32)
        kind = fused_moe.ACTIVATIONS[act]
        return fused_moe.experts_forward(
            x, w_up, w_down, weights, ids32, kind, up_bias, down_bias, alpha, limit,
            summed=not _hands_parts(parts),
        )  # fmt: skip
    from prefixserve.model.moe_reference import experts_ref

    return experts_ref(x, w_up, w_down, weights, ids, act, up_bias, down_bias, alpha, limit)


__all__ = [
    "PeerSum",
    "activation",
    "add_rms_norm",
    "apply_rope",
    "gate_up_kernels",
    "linear",
    "linear_partials",
    "linear_silu_and_mul",
    "moe_experts",
    "moe_parts_to_norm",
    "moe_route",
    "moe_routed_experts",
    "moe_routing_in_experts",
    "qkv_partials",
    "qkv_with_v",
    "rope_cos_sin",
    "rope_q",
    "rope_qkv",
    "router_split_k",
    "router_split_taken",
    "shard_embedding",
    "shard_lookup",
    "silu_and_mul",
    "skinny_matmuls",
    "split_k_for",
    "split_k_matmul",
    "split_k_operands",
    "split_k_products",
    "split_k_taken",
    "summed_partials",
    "triton_kernels",
]
