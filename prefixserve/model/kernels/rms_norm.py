"""RMSNorm with the residual add fused in: ``(norm(x + residual) * w, x + residual)`` in one pass.

The torch path is an add, a cast to fp32, a square, a mean, an rsqrt, two multiplies and two casts:
nine kernels and as many trips through memory for a [T, hidden] row block, twice per layer. Here one
program holds a whole row in registers (hidden <= 16K), reads x and the residual once and writes the
two outputs once. The rounding follows the torch path (HF's RMSNorm): the sum is rounded to the model
dtype before it is normalised and stored, the normalised row is rounded before the weight multiply,
so the two paths differ only in the order of the sum of squares.
"""

from __future__ import annotations

import torch

from prefixserve.attention.kernels import require_triton
from prefixserve.model.kernels.bound import BoundKernel

triton, tl = require_triton()

MAX_HIDDEN = 16384  # one row per program, in registers


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N]
    res_ptr,  # [T, N] (read when HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    res_out_ptr,  # [T, N] (written when HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the model dtype's add
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


_bound = BoundKernel(_add_rms_norm_kernel)  # launched by shape, so a step pays Triton's bind once


def add_rms_norm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``; without a residual, ``(rms_norm(x) * weight, x)``.

    Both outputs are new tensors (no input is written), so callers may hold on to their inputs.
    """
    tokens, n = x.shape
    if n > MAX_HIDDEN or x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError(f"hidden {n} must be <= {MAX_HIDDEN} with contiguous rows")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else x
    if tokens == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    _bound(
        (tokens,),
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    return out, res_out


def add_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: HF's RMSNorm (fp32 statistics, cast back before the weight) after the add."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


__all__ = ["add_rms_norm", "add_rms_norm_ref"]
