"""The expert GEMMs' tile code, shared by the grouped kernels (``fused_moe``) and the direct step's
one-pass kernel (``moe_direct``): the activation, one product (plain or transposed onto the tensor
cores' wide side) and a block's activated up tile."""

from __future__ import annotations

from prefixserve.model.kernels.silu_mul import silu_mul
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.pdl import launch_dependents

triton, tl = require_triton()


@triton.jit
def activation(gate, up, dtype: tl.constexpr, ACTIVATION: tl.constexpr, alpha, limit):
    """The experts' activation of fp32 gate and up products (rounded as the unfused model rounds)."""
    if ACTIVATION == 2:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
        g = tl.minimum(gate.to(dtype).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
        return (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    return silu_mul(gate, up, dtype, ACTIVATION == 1)


@triton.jit
def product(rows, w, acc, DOT_PREC: tl.constexpr, SWAP: tl.constexpr):
    """``acc`` + ``rows`` [BM, BK] @ ``w`` [BK, BN]; with ``SWAP`` the transposed product into ``acc``
    [BN, BM]: the weight's columns fill the tensor core's 64-row side and the block's few tokens its
    narrow side (Hopper's wgmma needs 64 rows; BM = 16 or 32 takes the older, slower mma)."""
    if SWAP:
        out = tl.dot(tl.trans(w), tl.trans(rows), acc, input_precision=DOT_PREC)
    else:
        out = tl.dot(rows, w, acc, input_precision=DOT_PREC)
    return out


@triton.jit
def up_values(
    x_ptr, w_ptr, bias_ptr, expert, real, assign, col, hidden, inter, stride_x, alpha, limit,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, SWAP: tl.constexpr, SIGNAL: tl.constexpr,
    dtype: tl.constexpr,
):  # fmt: skip
    """One block's tokens gathered from x, times its expert's gate and up rows of column tile ``col``,
    the activation: (values [BM, BN] fp32, rounded as the model rounds, its columns, which are real);
    ``SIGNAL``: let the dependent launch after the products."""
    token = (assign // TOP_K).to(tl.int64)
    n = col * BN + tl.arange(0, BN)
    n_ok = n < inter
    gate_rows = (expert.to(tl.int64) * 2 * inter + n) * hidden
    up_rows = gate_rows + inter * hidden
    acc_g = tl.zeros([BN, BM] if SWAP else [BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM] if SWAP else [BM, BN], dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < hidden
        xs = tl.load(
            x_ptr + token[:, None] * stride_x + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0
        )
        wmask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_ptr + gate_rows[None, :] + k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_ptr + up_rows[None, :] + k[:, None], mask=wmask, other=0.0)
        acc_g = product(xs, wg, acc_g, DOT_PREC, SWAP)
        acc_u = product(xs, wu, acc_u, DOT_PREC, SWAP)
    if SIGNAL:
        launch_dependents()
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if HAS_BIAS:
        cols = expert.to(tl.int64) * 2 * inter + n
        acc_g += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + cols + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return activation(acc_g, acc_u, dtype, ACTIVATION, alpha, limit), n, n_ok


__all__ = ["activation", "product", "up_values"]
