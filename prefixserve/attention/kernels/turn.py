"""The Hadamard turn of an FP8 KV cache (``kv_quant.rotate``) inside Triton kernels.

K is stored in e4m3 turned by the normalized Hadamard matrix H of the head size, and q is turned the
same way before attention, so that ``(q H) . (k H) = q . k``. In torch that is an fp32 matmul per
tensor and a few more launches for the fold of K's scale: per layer of a small decode step those
launches cost more than the products. Here a head's turn happens where its values already sit in
registers: the RoPE kernel's e4m3 store of k (``model/kernels/rope.py``) and one launch for q with the
fold (``turn_query``).

Sylvester's H_D is [[H, H], [H, -H]] over H = H_{D/2}, so [x1, x2] H_D = [(x1 + x2) H, (x1 - x2) H]:
a head held as its two halves (as the RoPE kernel holds it) takes one add, one subtract and two
products with H_{D/2}, whose +-1 entries (-1)^popcount(i & j) are made from indices, never loaded.
A head of 16-bit values (what both kernels turn: k and q rounded to the model's dtype) multiplies H
on the tensor cores: each half's product with H in the 16-bit dtype is exact (H's entries are +-1),
summed by the tensor cores' fp32 accumulation (whose additions round their own way, not IEEE's: a
stored K code may sit one e4m3 step from the ieee form's where a value is on a rounding boundary), and
the two halves' products added after, so ``[x1 H + x2 H, x1 H - x2 H]``; fp32 heads take ``ieee``
products of the sum and difference, which differ from torch's fp32 matmul only in their order. On
the 8B shape's decode step the fp32 form on CUDA cores cost a one-token launch about 4 us a layer
(docs/kernels.md §2.13).
"""

from __future__ import annotations

import torch

from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.bound import BoundKernel
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()


@triton.jit
def _sylvester(HALF: tl.constexpr):
    """H_{HALF} [HALF, HALF] fp32: +-1 at (i, j) by the parity of popcount(i & j) (the folds cover
    HALF <= 256)."""
    i = tl.arange(0, HALF)[:, None]
    j = tl.arange(0, HALF)[None, :]
    v = i & j
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def turn_halves(x1, x2, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """A head's halves [rows, HALF] fp32 (rows >= 16, for the products; HALF <= 128, ``turns``) times
    the normalized Hadamard matrix of size 2 HALF: the turned halves, fp32. ``DTYPE``: the dtype
    whose values x holds (16-bit: products on the tensor cores, exact; see the module)."""
    h = _sylvester(HALF)
    norm = 1.0 / tl.sqrt(2.0 * HALF)
    if DTYPE.primitive_bitwidth == 16:
        h16 = h.to(DTYPE)
        a = tl.dot(x1.to(DTYPE), h16)
        b = tl.dot(x2.to(DTYPE), h16)
        return (a + b) * norm, (a - b) * norm
    y1 = tl.dot(x1 + x2, h, input_precision="ieee") * norm
    y2 = tl.dot(x1 - x2, h, input_precision="ieee") * norm
    return y1, y2


@triton.jit
def _turn_query_kernel(
    q_ptr,  # [T, Hq, D]
    out_ptr,  # [T, Hq, D] contiguous
    scale_ptr,  # [Hkv] fp32: K's scale per KV head
    stride_t,
    stride_h,
    NUM_Q: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < NUM_Q
    src = q_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    scale = tl.load(scale_ptr + h // GROUP, mask=mask, other=1.0)
    y1, y2 = turned_query(x1, x2, HALF, dtype, scale)
    dst = out_ptr + t * NUM_Q * 2 * HALF + h * 2 * HALF + d
    tl.store(dst, y1.to(dtype), mask=mask)
    tl.store(dst + HALF, y2.to(dtype), mask=mask)


@triton.jit
def turned_query(x1, x2, HALF: tl.constexpr, DTYPE: tl.constexpr, scale):
    """q's halves (``DTYPE`` values, fp32) as attention over an e4m3 cache takes them: turned, rounded
    to ``DTYPE`` as torch's turn, then times the K scale (exact: a power of two); fp32. This kernel's
    and the RoPE kernel's (``TURN_Q``) one rule."""
    y1, y2 = turn_halves(x1, x2, HALF, DTYPE)
    return y1.to(DTYPE).to(tl.float32) * scale, y2.to(DTYPE).to(tl.float32) * scale


_turn = BoundKernel(_turn_query_kernel)  # a prefill's eager attention launches it every layer


@triton.jit
def _unfold_kernel(
    o_ptr,  # [T, Hq, D] contiguous: scaled in place
    scale_ptr,  # [Hkv] fp32: V's scale per KV head
    NUM_Q: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent: the product after may start at once
):
    if PDL:
        launch_dependents()
        wait()
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_Q) & (d < HEAD_DIM)
    row = o_ptr + tl.program_id(0).to(tl.int64) * NUM_Q * HEAD_DIM + h * HEAD_DIM + d
    o = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + h // GROUP, mask=h < NUM_Q, other=1.0)
    tl.store(row, (o * scale).to(o_ptr.dtype.element_ty), mask=mask)


_unfold = BoundKernel(_unfold_kernel)


def unfold_output(o: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """``kv_quant.unfold_output`` (o [T, Hq, D] contiguous times its KV head's V scale, in place, in
    fp32 and rounded) in one launch chained to the kernels around it (``pdl``): torch's product cannot
    let the next product's programs start early, and a one-token step paid it 3.6 us a layer."""
    tokens, heads, dim = o.shape
    if heads % v_scale.numel():
        raise ValueError(f"{heads} query heads do not group over {v_scale.numel()} V scales")
    if tokens:
        _unfold(
            (tokens,), o, v_scale.contiguous(), NUM_Q=heads, GROUP=heads // v_scale.numel(), HEAD_DIM=dim,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim), num_warps=4,
            **pdl.chained(o.device),
        )  # fmt: skip
    return o


def turns(head_dim: int) -> bool:
    """Whether these kernels turn a head of this size: a power of two (Sylvester's construction) whose
    halves make products of at least 16 (Triton's smallest ``tl.dot``), up to 256: at 512 the fp32
    H_256 and its products need 272 KiB of shared memory, past an H100's 227 (Gemma 4's global layers
    turn in torch)."""
    return head_dim & (head_dim - 1) == 0 and 32 <= head_dim <= 256  # (kv_quant imports this module)


def turn_query(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D] (``turns(D)``) turned by the normalized Hadamard matrix and times its
    KV head's K scale: ``fold_query(rotate(q), k_scale)`` in one launch."""
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    _turn(
        (tokens,),
        q,
        out,
        k_scale,
        q.stride(0),
        q.stride(1),
        NUM_Q=heads,
        GROUP=heads // k_scale.numel(),
        HALF=dim // 2,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        num_warps=4,
    )
    return out


__all__ = ["turn_halves", "turn_query", "turned_query", "turns", "unfold_output"]
