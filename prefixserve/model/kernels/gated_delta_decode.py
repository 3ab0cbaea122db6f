"""One decode step of the gated delta rule over the state slots, in place (Triton).

A decode step brings one token per sequence; each sequence's state [Hv, Dk, Dv] (fp32) lives in its
slot of the layer's state pool. fla's recurrent kernel takes a batch of initial states and returns
new final states, so a step over slots gathered them first and scattered the results back: on an H200
at 64 samples of a Qwen3.5-27B shape, the gather, fla's kernel and the scatter took 5.1 + 6.7 + 7.5 ms
of a 53.9 ms step for 19.7 GB of state traffic that needs 4.1 ms at the copy rate
(``docs/kernels.md`` §11). Here each program reads its tile of a sequence's state from the slot once,
applies the token (``gated_delta_ref.recurrent_ref``'s update: q and k L2-normed, q scaled by
Dk^-0.5; S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q) and writes it back in place:
one read and one write of the state, nothing else.

Grid: (sequence, value head, Dv tile); each program holds a [Dk, BLOCK_V] fp32 tile (the whole key
dimension: the update's S^T k and S^T q sum over it) and recomputes the key head's norms, which cost
Dk loads against Dk x BLOCK_V of state. A fresh sequence (its chunk starts at token 0) starts from a
zero state; the slot is written, never read, then.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # state columns a program: 128 x 32 fp32 is 16 KB of registers at Dk = 128
EPS = 1e-6  # the L2 norm's, as the reference's (fla's and HF's)


@triton.jit
def _decode_kernel(
    q, k, v, g, beta, state, slots, fresh, out,
    stride_q, stride_k, stride_v,  # row strides (the heads of a row are contiguous)
    scale, eps,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_FRESH: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // (HV // HK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    bq = tl.load(q + s * stride_q + kh * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    bk = tl.load(k + s * stride_k + kh * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    bq = bq * tl.rsqrt(tl.sum(bq * bq, 0) + eps) * scale
    bk = bk * tl.rsqrt(tl.sum(bk * bk, 0) + eps)
    bv = tl.load(v + s * stride_v + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g + s * HV + h).to(tl.float32))
    bb = tl.load(beta + s * HV + h).to(tl.float32)
    slot = tl.load(slots + s).to(tl.int64)
    tile = state + (slot * HV + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    m2 = mk[:, None] & mv[None, :]
    st = tl.load(tile, mask=m2, other=0.0)
    if HAS_FRESH:
        st = tl.where(tl.load(fresh + s) != 0, 0.0, st)
    st = st * decay
    u = (bv - tl.sum(st * bk[:, None], 0)) * bb
    st = st + bk[:, None] * u[None, :]
    o = tl.sum(st * bq[:, None], 0)
    tl.store(tile, st, mask=m2)
    tl.store(out + (s * HV + h) * DV + offs_v, o.to(out.dtype.element_ty), mask=mv)


def decode(
    q: torch.Tensor,  # [S, Hk, Dk] (not normed), rows may be strided
    k: torch.Tensor,  # [S, Hk, Dk]
    v: torch.Tensor,  # [S, Hv, Dv]
    g: torch.Tensor,  # [S, Hv] log decay
    beta: torch.Tensor,  # [S, Hv]
    slots: torch.Tensor,  # [S] int64: each sequence's slot
    fresh: torch.Tensor | None,  # [S] bool: starts from zeros (None: none does)
    state: torch.Tensor,  # [N, Hv, Dk, Dv] fp32, contiguous: the layer's slots, updated in place
) -> torch.Tensor:  # [S, Hv, Dv] in v's dtype
    """The step's outputs; each sequence's state in its slot moved past its token."""
    seqs, hk, dk = q.shape
    hv, dv = v.shape[1:]
    for t, heads, dim in ((q, hk, dk), (k, hk, dk), (v, hv, dv)):
        if t.stride(2) != 1 or t.stride(1) != dim or t.shape[1] != heads:
            raise ValueError(f"a decode input's heads must be contiguous in its rows: {tuple(t.stride())}")
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("the state pool must be contiguous fp32")
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(seqs, hv, dv, dtype=v.dtype, device=v.device)
    if seqs == 0:
        return out
    flags = fresh.to(torch.int8) if fresh is not None else slots  # unread without HAS_FRESH
    grid = (seqs, hv, triton.cdiv(dv, BLOCK_V))
    _decode_kernel[grid](
        q, k, v, g, beta, state, slots, flags, out,
        q.stride(0), k.stride(0), v.stride(0), dk**-0.5, EPS,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V,
        HAS_FRESH=fresh is not None, num_warps=4,
    )  # fmt: skip
    return out


__all__ = ["BLOCK_V", "decode"]
