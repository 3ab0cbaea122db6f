"""The FP8 fused gate-up product of a decode step's rows as persistent programs walking narrow tiles.

``fp8_matmul.fp8_gated`` runs a program a 64-column tile of each half: the 8B shape's I = 14,336
columns are 224 programs on 132 SMs, so some SMs stream two programs' weights and others one, and
the step waits for the busiest. Here one program an SM walks every PROGRAMS-th tile of ``BLOCK_N``
columns (16 a half: 896 tiles, six or seven a program), its loop flattened over (tile, K step) so the
software pipeline keeps loading across a tile's end, where the epilogue (the scales, the activation
rounded as the unfused pair rounds, the store) runs under a branch: Triton's persistent matmul
pattern. Each output is the same fp32 sum in the same K order as the per-tile kernel's.
"""

from __future__ import annotations

import torch

from prefixserve.attention.planning.tiles import num_sms
from prefixserve.model.kernels.silu_mul import silu_mul
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()

# (BLOCK_N of each half, BLOCK_K, STAGES, warps) up to 16 rows and past them
# (``benchmarks/probes/fp8_tiles.py --gated --walk``)
WALK_TILES = ((16, 256, 6, 4), (16, 256, 4, 4))


@triton.jit(do_not_specialize=["M"])
def _gated_walk_kernel(
    x_ptr,  # [M, K] e4m3 codes of x
    sx_ptr,  # [M] fp32 row scales of x
    w_ptr,  # [2N, K] e4m3: the gate rows, then the up rows
    s_ptr,  # [2N, 1] fp32 per-channel scales
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PROGRAMS: tl.constexpr,
    GELU: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles = n_tiles * tl.cdiv(M, BLOCK_M)
    k_steps = tl.cdiv(K, BLOCK_K)
    mine = tl.cdiv(tiles - pid, PROGRAMS)
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    if PDL:
        wait()
    tile = pid
    ki = -1
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in tl.range(0, mine * k_steps, num_stages=STAGES):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0 and it > 0:
            tile += PROGRAMS
        offs_m = (tile // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k0 = ki * BLOCK_K
        k_ok = (k0 + offs_k) < K
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
        w = tl.load(w_rows, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w_up = tl.load(w_rows + N * stride_wn, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        acc = tl.dot(x, tl.trans(w), acc)
        if ki == k_steps - 1:
            s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn
            sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
            gate = acc * tl.load(s_rows, mask=n_ok, other=0.0)[None, :] * sx
            up = acc_up * tl.load(s_rows + N * stride_sn, mask=n_ok, other=0.0)[None, :] * sx
            out = silu_mul(gate, up, dtype, GELU)
            tl.store(
                out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                out.to(dtype),
                mask=m_ok[:, None] & n_ok[None, :],
            )
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PDL:
        launch_dependents()


def gated_walk(
    x: torch.Tensor,  # [M, K] 16-bit (its shape and dtype; the product reads its codes)
    codes: torch.Tensor,  # [2N, K] e4m3
    scale: torch.Tensor,  # [2N, 1] fp32
    x_codes: tuple[torch.Tensor, torch.Tensor],  # x's e4m3 codes [M, K] and row scales [M]
    gelu: bool = False,
    tile: tuple[int, ...] | None = None,  # (BLOCK_N, BLOCK_K, STAGES[, warps]); default ``WALK_TILES``
) -> torch.Tensor:
    """``fp8_matmul.fp8_gated``'s W8A8 output (per-channel weights, x's codes), one program an SM."""
    m, k = x.shape
    n = codes.shape[0] // 2
    block_n, block_k, stages, warps = (*(tile or WALK_TILES[m > 16]), 4)[:4]
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    programs = min(num_sms(x.device), triton.cdiv(n, block_n) * triton.cdiv(m, block_m))
    xq, sx = x_codes
    _gated_walk_kernel[(programs,)](
        xq, sx, codes, scale, out, m, n, k, xq.stride(0), codes.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PROGRAMS=programs, GELU=gelu,
        num_warps=warps, **pdl.chained(x.device),
    )  # fmt: skip
    return out


__all__ = ["WALK_TILES", "gated_walk"]
