"""RoPE of q and k straight from the fused qkv projection, and optionally the KV-cache write.

The torch path splits the projection, and for q and for k casts to fp32, multiplies by cos, rotates
the halves, multiplies by sin, adds and casts back; then two ``index_copy_`` write k and v into the
cache. Here one program per token reads its row of the projection once, rotates every q and k head
in fp32 registers, writes q and k (contiguous, as the attention kernels take them) and, when asked,
writes the rotated k and the untouched v into the token's cache slot: one kernel instead of about a
dozen.

The projection may also come as fp32 split-K partials [S, T, W] (``fused.qkv_partials``): the
kernel sums a row's S planes in fp32 and rounds the sum to the model dtype once, which is what the
one-matmul product holds, before it rotates; it then writes v as well (no view of a product to give).

cos and sin come in as [T, D] fp32 (HF's layout, computed once per step from the positions by
``RotaryEmbedding.cos_sin``, so positions stay data and any position works); the kernel reads their
first halves. Inside a CUDA graph the slot of a padding row is the cache's scratch slot, as for
``index_copy_``.

With QK-norm (Qwen3, Gemma 3) each q and k head is RMS-normed over its dims before it rotates, in the
same program: the head's two halves are in registers already, so the norm costs no extra read.
"""

from __future__ import annotations

import torch

from prefixserve.attention.kernels.turn import turn_halves, turned_query, turns
from prefixserve.attention.kv_quant import scales_of, store_kv, stores_turned, turn_query
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, tl = require_triton()


@triton.jit
def _load_row_part(ptr, mask, stride_split, SPLITS: tl.constexpr, dtype: tl.constexpr):
    """fp32 values of the product at ``ptr``: the product as it is (SPLITS 0), or the SPLITS fp32
    partial planes summed in order and rounded once to ``dtype`` (what the one-matmul product holds)."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if SPLITS > 0:
        for s in tl.static_range(1, SPLITS):
            x += tl.load(ptr + s * stride_split, mask=mask, other=0.0)
        x = x.to(dtype).to(tl.float32)
    return x


@triton.jit
def _rotate_heads(
    src_ptr,  # the token's first head of this group in the qkv row (partials: in the first plane)
    cos,  # [1, HALF_BLOCK] fp32
    sin,
    dst_ptr,  # the token's row of q or k
    cache_ptr,  # the token's cache slot (used when WRITE)
    stride_ch,  # cache head stride
    stride_split,  # elements between partial planes (SPLITS > 0)
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    WRITE: tl.constexpr,
    SPLITS: tl.constexpr,
    norm_ptr,  # [HEAD_DIM] the heads' RMSNorm weight (used when NORM)
    eps,
    NORM: tl.constexpr,
    cache_inv=1.0,  # [BLOCK_H, 1] fp32: each head's 1 / scale (FP8)
    FP8: tl.constexpr = False,
    TURN: tl.constexpr = False,  # FP8: stored turned (``kv_quant.rotate``; BLOCK_H >= 16)
    fold=1.0,  # [BLOCK_H, 1] fp32: each q head's K scale (TURN_Q)
    TURN_Q: tl.constexpr = False,  # q written turned and folded, as ``turn_query`` (BLOCK_H >= 16)
):
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (h < NUM_HEADS) & (d < half)
    off = h * HEAD_DIM + d
    dtype: tl.constexpr = dst_ptr.dtype.element_ty
    x1 = _load_row_part(src_ptr + off, mask, stride_split, SPLITS, dtype)
    x2 = _load_row_part(src_ptr + off + half, mask, stride_split, SPLITS, dtype)
    if NORM:  # rounded as the model's RMSNorm: normed to the dtype, times the weight, to the dtype
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(norm_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if TURN_Q:  # the rounded q as ``turn_query``'s kernel takes it (the one rule)
        o1, o2 = turned_query(
            o1.to(dtype).to(tl.float32), o2.to(dtype).to(tl.float32), HALF_BLOCK, dtype, fold
        )
    tl.store(dst_ptr + off, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + off + half, o2.to(dst_ptr.dtype.element_ty), mask=mask)
    if WRITE:
        c_off = h * stride_ch + d
        if TURN:  # as store_kv: the rounded values turned in fp32, then quantized once
            y1, y2 = turn_halves(o1.to(dtype).to(tl.float32), o2.to(dtype).to(tl.float32), HALF_BLOCK, dtype)
            tl.store(cache_ptr + c_off, _quantize(y1, cache_ptr, cache_inv), mask=mask)
            tl.store(cache_ptr + c_off + half, _quantize(y2, cache_ptr, cache_inv), mask=mask)
        else:
            tl.store(cache_ptr + c_off, _to_cache(o1, dtype, cache_ptr, cache_inv, FP8), mask=mask)
            tl.store(cache_ptr + c_off + half, _to_cache(o2, dtype, cache_ptr, cache_inv, FP8), mask=mask)


@triton.jit
def _quantize(x, cache_ptr, cache_inv):
    """fp32 ``x`` as e4m3: times the head's inverse scale, saturated at +-448 (``kv_quant.quantize``)."""
    return tl.minimum(tl.maximum(x * cache_inv, -448.0), 448.0).to(cache_ptr.dtype.element_ty)


@triton.jit
def _to_cache(x, dtype: tl.constexpr, cache_ptr, cache_inv, FP8: tl.constexpr):
    """fp32 ``x`` as the cache stores it: rounded to the model's dtype, and for an e4m3 cache (FP8) then
    times the head's inverse scale (exact: a power of two) and saturated at +-448, as
    ``kv_quant.quantize`` does to the rounded value."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(dtype).to(tl.float32) * cache_inv, -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) D] (SPLITS 0), or fp32 partials [SPLITS, T, (Hq + 2 Hkv) D]
    cos_ptr,  # [T, D] fp32
    sin_ptr,  # [T, D] fp32
    q_ptr,  # [T, Hq, D] out
    k_ptr,  # [T, Hkv, D] out
    v_ptr,  # [T, Hkv, D] out (SPLITS > 0)
    slot_ptr,  # [T] int64 (WRITE_KV)
    k_cache_ptr,  # [slots, Hkv, D] (WRITE_KV)
    v_cache_ptr,  # [slots, Hkv, D] (WRITE_KV)
    stride_split,
    stride_t,
    stride_cos,
    stride_sin,
    stride_q,
    stride_k,
    stride_v,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    q_norm_ptr,  # [HEAD_DIM] (NORM)
    k_norm_ptr,
    eps,
    inv_ptr,  # [2, NUM_KV] fp32: K's and V's 1 / scale per KV head (FP8)
    k_scale_ptr,  # [NUM_KV] fp32: K's scale per KV head (TURN)
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    WRITE_KV: tl.constexpr,
    SPLITS: tl.constexpr,
    NORM: tl.constexpr = False,
    FP8: tl.constexpr = False,
    TURN: tl.constexpr = False,
    TURN_Q: tl.constexpr = False,  # q written as attention over the e4m3 cache takes it (``turn_query``)
    APART: tl.constexpr = 0,  # 1: grid (T, 2), q in one program, k and v in another
):
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF_BLOCK)
    cos = tl.load(cos_ptr + t * stride_cos + d, mask=d < half, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin + d, mask=d < half, other=0.0)[None, :]
    row = qkv_ptr + t * stride_t
    # APART 1: q in program (t, 0), k and v in (t, 1), a turning token's two halves side by side;
    # APART 0 (a grid of one column): both in (t, 0)
    if tl.program_id(1) == 0:
        _q_part(row, cos, sin, q_ptr + t * stride_q, stride_split, q_norm_ptr, eps, k_scale_ptr,
                NUM_Q, NUM_KV, HEAD_DIM, BLOCK_Q, HALF_BLOCK, SPLITS, NORM, TURN_Q)  # fmt: skip
    if tl.program_id(1) == APART:
        _kv_part(row, cos, sin, t, k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_split, stride_k,
                 stride_v, stride_ks, stride_kh, stride_vs, stride_vh, k_norm_ptr, eps, inv_ptr, NUM_Q,
                 NUM_KV, HEAD_DIM, BLOCK_KV, HALF_BLOCK, WRITE_KV, SPLITS, NORM, FP8, TURN)  # fmt: skip


@triton.jit
def _q_part(
    row, cos, sin, q_row, stride_split, q_norm_ptr, eps, k_scale_ptr,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
    HALF_BLOCK: tl.constexpr, SPLITS: tl.constexpr, NORM: tl.constexpr, TURN_Q: tl.constexpr,
):  # fmt: skip
    """A token's q heads: rotated (and normed), written; with TURN_Q turned and folded."""
    fold = 1.0
    if TURN_Q:  # q turned and folded with its KV head's K scale (GQA: NUM_Q / NUM_KV heads a KV head)
        hq = tl.arange(0, BLOCK_Q)[:, None]
        fold = tl.load(k_scale_ptr + hq // (NUM_Q // NUM_KV), mask=hq < NUM_Q, other=1.0)
    _rotate_heads(row, cos, sin, q_row, q_row, 0, stride_split, NUM_Q, HEAD_DIM, BLOCK_Q, HALF_BLOCK, False,
                  SPLITS, q_norm_ptr, eps, NORM, fold=fold, TURN_Q=TURN_Q)  # fmt: skip


@triton.jit
def _kv_part(
    row, cos, sin, t, k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_split,
    stride_k, stride_v, stride_ks, stride_kh, stride_vs, stride_vh, k_norm_ptr, eps, inv_ptr,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr,
    HALF_BLOCK: tl.constexpr, WRITE_KV: tl.constexpr, SPLITS: tl.constexpr, NORM: tl.constexpr,
    FP8: tl.constexpr, TURN: tl.constexpr,
):  # fmt: skip
    """A token's k heads rotated (and normed) and written, and with WRITE_KV stored with its v."""
    slot = 0
    k_inv = 1.0
    v_inv = 1.0
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if FP8:
            hk = tl.arange(0, BLOCK_KV)[:, None]
            k_inv = tl.load(inv_ptr + hk, mask=hk < NUM_KV, other=1.0)
            v_inv = tl.load(inv_ptr + NUM_KV + hk, mask=hk < NUM_KV, other=1.0)
    _rotate_heads(row + NUM_Q * HEAD_DIM, cos, sin, k_ptr + t * stride_k, k_cache_ptr + slot * stride_ks,
                  stride_kh, stride_split, NUM_KV, HEAD_DIM, BLOCK_KV, HALF_BLOCK, WRITE_KV, SPLITS,
                  k_norm_ptr, eps, NORM, k_inv, FP8, TURN)  # fmt: skip
    if WRITE_KV or SPLITS > 0:  # v goes to the cache as it is (partials: summed, and to v too)
        h = tl.arange(0, BLOCK_KV)[:, None]
        dd = tl.arange(0, 2 * HALF_BLOCK)[None, :]
        mask = (h < NUM_KV) & (dd < HEAD_DIM)
        src = row + (NUM_Q + NUM_KV) * HEAD_DIM + h * HEAD_DIM + dd
        v = _load_row_part(src, mask, stride_split, SPLITS, v_ptr.dtype.element_ty)
        if WRITE_KV:
            dst = v_cache_ptr + slot * stride_vs + h * stride_vh + dd
            tl.store(dst, _to_cache(v, v_ptr.dtype.element_ty, v_cache_ptr, v_inv, FP8), mask=mask)
        if SPLITS > 0:
            tl.store(v_ptr + t * stride_v + h * HEAD_DIM + dd, v.to(v_ptr.dtype.element_ty), mask=mask)


_bound = BoundKernel(_rope_qkv_kernel)  # launched by shape, so a step pays Triton's bind once
# where both turn (an e4m3 cache with its scales), a token's q and its k / v in programs of their own:
# the turns' products and conversions side by side instead of one after the other
APART_TURNING = True


def rope_qkv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D], or fp32 split-K partials [S, T, (Hq + 2 Hkv) D]
    cos: torch.Tensor,  # [T, D] fp32
    sin: torch.Tensor,  # [T, D] fp32
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # k_cache, v_cache, slots
    dtype: torch.dtype | None = None,  # of q, k and v; partials need it (the model's dtype)
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # QK-norm: q's and k's weights, eps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] (new, contiguous, QK-normed if ``norms``, RoPE applied) and
    v [T, Hkv, D] (a view of qkv; from partials, their sum, new).

    With ``cache`` = (k_cache, v_cache, slots), each [.., block_size, Hkv, D] cache gets the token's
    rotated k and its v at row ``slots[t]`` (int64), as ``index_copy_`` would write them; an e4m3
    cache gets them quantized with the scales ``cache`` carries, K turned first where the head size
    is a power of two (``kv_quant.rotate``; ``kernels/turn.py``), as ``kv_quant.store_kv`` stores
    them. k itself is returned unturned; q, when the e4m3 cache carries its scales, comes turned and
    times its KV head's K scale (``kv_quant.turn_query``: what attention over that cache takes), in
    this kernel where it turns K.
    """
    width = (num_heads + 2 * num_kv_heads) * head_dim
    splits = qkv.shape[0] if qkv.dim() == 3 else 0  # 0: the product itself
    if qkv.dim() == 3 and (qkv.dtype != torch.float32 or dtype is None or not qkv[0].is_contiguous()):
        raise ValueError("split-K partials must be fp32 [S, T, W] with contiguous planes, and need dtype")
    if qkv.dim() not in (2, 3) or qkv.shape[-1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [(S,) T, {width}] with contiguous rows")
    tokens, dtype = qkv.shape[-2], dtype or qkv.dtype
    if head_dim % 2 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [T, {head_dim}] (even head_dim)")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("cos/sin need contiguous rows")
    q = torch.empty(tokens, num_heads, head_dim, dtype=dtype, device=qkv.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=dtype, device=qkv.device)
    if splits:
        v = torch.empty(tokens, num_kv_heads, head_dim, dtype=dtype, device=qkv.device)
    else:
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(tokens, num_kv_heads, head_dim)
    if tokens == 0:
        return q, k, v
    inverse = cos  # never read unless the cache is e4m3
    fp8 = cache is not None and cache[0].dtype == torch.float8_e4m3fn
    scales = scales_of(cache) if fp8 else None
    if fp8 and stores_turned(head_dim) and not turns(head_dim):
        # K is stored turned, but not by this kernel at this head size: the torch store turns it
        q, k, v = rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim, None, dtype, norms)
        store_kv(cache, k, v, num_kv_heads, head_dim)
        return (q if scales is None else turn_query(q, scales[0])), k, v
    turn = fp8 and turns(head_dim)
    turn_q = turn and scales is not None
    if cache is not None:
        k_cache, v_cache, slots = cache
        if k_cache.dtype == torch.float8_e4m3fn:
            inverse = getattr(cache, "inverse", None)
            if inverse is None:
                inverse = torch.ones(2, num_kv_heads, device=qkv.device)
            # the kernel reads [2, heads] with a row stride of heads: a layer's view of the cache's
            # [layers, 2, widest] scales is strided where its heads are fewer (Gemma 4's global layers)
            inverse = inverse.contiguous()
        kc = k_cache.view(-1, num_kv_heads, head_dim)
        vc = v_cache.view(-1, num_kv_heads, head_dim)
        if kc.stride(2) != 1 or vc.stride(2) != 1 or slots.shape != (tokens,):
            raise ValueError("the KV caches need a contiguous head_dim and one slot per token")
    else:
        kc = vc = k
        slots = q  # never read
    _bound(
        (tokens, 2 if turn_q and APART_TURNING else 1),
        qkv,
        cos,
        sin,
        q,
        k,
        v,
        slots,
        kc,
        vc,
        qkv.stride(0) if splits else 0,
        qkv.stride(-2),
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        k.stride(0),
        v.stride(0),
        kc.stride(0),
        kc.stride(1),
        vc.stride(0),
        vc.stride(1),
        norms[0] if norms else cos,
        norms[1] if norms else cos,
        norms[2] if norms else 0.0,
        inverse,
        scales[0].contiguous() if turn_q else cos,
        NUM_Q=num_heads,
        NUM_KV=num_kv_heads,
        HEAD_DIM=head_dim,
        # the turn's products take 16 rows at least
        BLOCK_Q=max(16 if turn_q else 1, triton.next_power_of_2(num_heads)),
        BLOCK_KV=max(16 if turn else 1, triton.next_power_of_2(num_kv_heads)),
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
        WRITE_KV=cache is not None,
        SPLITS=splits,
        NORM=norms is not None,
        FP8=fp8,
        TURN=turn,
        TURN_Q=turn_q,
        APART=int(turn_q and APART_TURNING),
        num_warps=4,
    )
    if scales is not None and not turn_q:  # K stored as it is (no power of two): q's fold alone
        q = turn_query(q, scales[0])
    return q, k, v


def rope_qkv_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: HF's rotate-half RoPE in fp32 (with its ``torch.cat``), then ``index_copy_``."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor, heads: int) -> torch.Tensor:
        x = x.reshape(tokens, heads, head_dim)
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * c + rotated.float() * s).to(x.dtype)

    q, k = rotate(q, num_heads), rotate(k, num_kv_heads)
    v = v.view(tokens, num_kv_heads, head_dim)
    if cache is not None:
        store_kv(cache, k, v, num_kv_heads, head_dim)
    return q, k, v


__all__ = ["rope_qkv", "rope_qkv_ref"]
