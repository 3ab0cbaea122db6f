"""SiLU-and-mul: ``silu(gate) * up`` from the fused gate-up projection, one read and one write; and
GELU-and-mul (Gemma's ``gelu_pytorch_tanh``), the same kernel with the other activation.

The torch path is an activation over the gate half and a multiply by the up half: two kernels, and
the activation's output makes a round trip through memory. The rounding follows it: the activation
is rounded to the model dtype before the multiply.

``silu_and_mul_quantize``: the product also as e4m3 codes with one fp32 scale a row, for an FP8 down
projection that quantizes its input per token: one program a row holds the row's product whole
(``e4m3.row_launch``; past 16K columns it computes it twice, for its amax and for its codes, the
inputs coming back from L2), where the quantize kernel after it read the product again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixserve.model.kernels.e4m3 import row_launch, row_scale, to_codes
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.bound import BoundKernel
from prefixserve.triton_support.pdl import launch_dependents, wait

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


def _product(x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(T, I, the new [T, I] output) of a gate-up product x [T, 2 I] with contiguous rows."""
    tokens, width = x.shape
    if width % 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [T, 2 I] with contiguous rows")
    return tokens, width // 2, torch.empty(tokens, width // 2, dtype=x.dtype, device=x.device)


def silu_and_mul(x: torch.Tensor, gelu: bool = False) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]`` (``gelu``: the tanh GELU's) into a new contiguous tensor."""
    tokens, n, out = _product(x)
    if tokens == 0:
        return out
    grid = (tokens, triton.cdiv(n, BLOCK))
    _bound(grid, x, out, x.stride(0), out.stride(0), n, BLOCK=BLOCK, GELU=gelu, num_warps=4)
    return out


@triton.jit
def _silu_and_mul_quantize_kernel(
    x_ptr,  # [T, 2 I]: gate | up
    out_ptr,  # [T, I] the model dtype
    codes_ptr,  # [T, I] e4m3, contiguous
    scales_ptr,  # [T] fp32
    stride_x,
    stride_o,
    n_cols,  # I
    BLOCK: tl.constexpr,
    GELU: tl.constexpr = False,
    WHOLE: tl.constexpr = False,  # BLOCK >= I: the row held in registers, its inputs read once
    PDL: tl.constexpr = False,  # launched as a dependent: the product after may start at once
):
    if PDL:
        launch_dependents()
        wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    gate_row, up_row = x_ptr + row * stride_x, x_ptr + row * stride_x + n_cols
    if WHOLE:  # names of their own: the compiler reads a name set here and in the loops as carried
        in_row = offs < n_cols
        whole = silu_mul(
            tl.load(gate_row + offs, mask=in_row, other=0.0).to(tl.float32),
            tl.load(up_row + offs, mask=in_row, other=0.0).to(tl.float32),
            dtype,
            GELU,
        ).to(dtype)
        tl.store(out_ptr + row * stride_o + offs, whole, mask=in_row)
        whole32 = whole.to(tl.float32)
        row_s = row_scale(tl.max(tl.abs(whole32), axis=0))
        tl.store(scales_ptr + row, row_s)
        row_codes = to_codes(whole32, row_s, codes_ptr.dtype.element_ty)
        tl.store(codes_ptr + row * n_cols + offs, row_codes, mask=in_row)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        mask = c0 + offs < n_cols
        gate = tl.load(gate_row + c0 + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_row + c0 + offs, mask=mask, other=0.0).to(tl.float32)
        act = silu_mul(gate, up, dtype, GELU).to(dtype)
        tl.store(out_ptr + row * stride_o + c0 + offs, act, mask=mask)
        amax = tl.maximum(amax, tl.abs(act.to(tl.float32)))
    scale = row_scale(tl.max(amax, axis=0))
    tl.store(scales_ptr + row, scale)
    for c0 in range(0, n_cols, BLOCK):
        mask = c0 + offs < n_cols
        gate = tl.load(gate_row + c0 + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_row + c0 + offs, mask=mask, other=0.0).to(tl.float32)
        act = silu_mul(gate, up, dtype, GELU).to(dtype).to(tl.float32)
        codes = to_codes(act, scale, codes_ptr.dtype.element_ty)
        tl.store(codes_ptr + row * n_cols + c0 + offs, codes, mask=mask)


_bound_quantize = BoundKernel(_silu_and_mul_quantize_kernel)


def silu_and_mul_quantize(
    x: torch.Tensor, gelu: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, 2 I] -> [T, I], its codes, scales [T, 1]
    """``silu_and_mul`` and its e4m3 codes with fp32 row scales (``fp8_matmul.quantize_rows`` of it)."""
    tokens, n, out = _product(x)
    codes = torch.empty(tokens, n, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    if tokens:
        block, whole, warps = row_launch(n)
        _bound_quantize(
            (tokens,), x, out, codes, scales, x.stride(0), out.stride(0), n, BLOCK=block, GELU=gelu,
            WHOLE=whole, num_warps=warps, **pdl.chained(x.device),
        )  # fmt: skip
    return out, codes, scales


def silu_and_mul_ref(x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """Torch reference: what the unfused MLP computed from its two projections."""
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


__all__ = ["silu_and_mul", "silu_and_mul_quantize", "silu_and_mul_ref", "silu_mul"]
