"""SiLU-and-mul: ``silu(gate) * up`` from the fused gate-up projection, one read and one write; and
GELU-and-mul (Gemma's ``gelu_pytorch_tanh``), the same kernel with the other activation.

The torch path is an activation over the gate half and a multiply by the up half: two kernels, and
the activation's output makes a round trip through memory. The rounding follows it: the activation
is rounded to the model dtype before the multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, tl = require_triton()

BLOCK = 1024  # columns per program


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr, GELU: tl.constexpr = False):
    """``silu(gate) * up`` of fp32 values (with ``GELU``: the tanh GELU's), rounded as the unfused
    model rounds: both inputs to the model dtype (the projection's output), the activation to it
    before the multiply. Returns fp32 holding a ``dtype`` value. Shared by this kernel and the matmul
    epilogues that fuse it."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = (gate / (1.0 + tl.exp(-2.0 * u))).to(dtype).to(tl.float32)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return act * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 I]: gate | up
    out_ptr,  # [T, I]
    stride_x,
    stride_o,
    n_cols,  # I
    BLOCK: tl.constexpr,
    GELU: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up, dtype, GELU).to(dtype), mask=mask)


_bound = BoundKernel(_silu_and_mul_kernel)  # launched by shape, so a step pays Triton's bind once


def silu_and_mul(x: torch.Tensor, gelu: bool = False) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]`` (``gelu``: the tanh GELU's) into a new contiguous tensor."""
    tokens, width = x.shape
    if width % 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [T, 2 I] with contiguous rows")
    n = width // 2
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    grid = (tokens, triton.cdiv(n, BLOCK))
    _bound(grid, x, out, x.stride(0), out.stride(0), n, BLOCK=BLOCK, GELU=gelu, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """Torch reference: what the unfused MLP computed from its two projections."""
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


__all__ = ["silu_and_mul", "silu_and_mul_ref", "silu_mul"]
