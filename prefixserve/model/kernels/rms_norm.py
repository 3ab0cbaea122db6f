"""RMSNorm with the residual add fused in: ``(norm(x + residual) * w, x + residual)`` in one pass.

The torch path is an add, a cast to fp32, a square, a mean, an rsqrt, two multiplies and two casts:
nine kernels and as many trips through memory for a [T, hidden] row block, twice per layer. Here one
program holds a whole row in registers (hidden <= 16K), reads x and the residual once and writes the
two outputs once. The rounding follows the torch path (HF's RMSNorm): the sum is rounded to the model
dtype before it is normalised and stored, the normalised row is rounded before the weight multiply,
so the two paths differ only in the order of the sum of squares.

x may also come as a matmul's fp32 split-K partials [S, T, N] (``linear_partials``): the kernel sums
them and rounds to the model dtype, as cuBLAS's split-K reduce kernel would, so the matmul needs no
reduce kernel of its own. Parts in the model dtype are summed so too (in fp32, in order): a mixture of
experts' weighted expert outputs ([k, T, N], a strided view of its [T, k, N] rows,
``fused_moe.experts_forward(summed=False)``), which its combine kernel would have summed alike.

``pre``: Gemma's sandwich, where a block's output is normed (its own weight) before the residual
add and the next norm: ``norm(norm(x) * w0 + residual) * w``, both norms in one pass, rounded as the
two kernels would round them. Partials may then come without a residual (a down projection's, into
Gemma's post-MLP norm): their sum rounded to ``dtype``.

``quantize``: the normed rows also as e4m3 codes with one fp32 scale a row (amax / 448 of the stored
16-bit row, ``e4m3.py``'s rule: exactly ``fp8_matmul.quantize_rows`` of the output), for an FP8
projection next that quantizes its input per token; the row is already in registers, so that
kernel's two reads go.
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels.e4m3 import row_scale, to_codes
from prefixserve.model.partial_sums import check_partials_dtype
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.bound import BoundKernel
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()

MAX_HIDDEN = 16384  # one row per program, in registers


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N], or [SPLITS, T, N] partials (fp32, or the model dtype) to sum first
    res_ptr,  # [T, N] (read when HAS_RESIDUAL)
    w_ptr,  # [N]
    pre_w_ptr,  # [N]: PRE's weight
    out_ptr,  # [T, N]
    res_out_ptr,  # [T, N] (written when STREAM)
    codes_ptr,  # QUANT: [T, N] e4m3, contiguous
    scales_ptr,  # QUANT: [T] fp32
    stride_split,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    pre_eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLITS: tl.constexpr,  # 0: x is [T, N] in the model dtype; else the number of partials
    QUANT: tl.constexpr = False,  # the output's e4m3 codes and row scale too
    PRE: tl.constexpr = False,  # x normed with pre_w first (a sandwich norm)
    STREAM: tl.constexpr = True,  # the stream (x + residual, or a new x) stored to res_out
    PDL: tl.constexpr = False,  # launched as a dependent: the product after may start at once
):
    if PDL:
        launch_dependents()
        wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty  # the model dtype
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if SPLITS:  # partials: the matmul's split-K reduce (or the experts' combine) in fp32, one rounding
        x = x.to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        x += tl.load(x_ptr + s * stride_split + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    x = x.to(dtype)
    if PRE:  # the block output's own norm, rounded as its own kernel would store it
        pf = x.to(tl.float32)
        prstd = tl.math.rsqrt(tl.sum(pf * pf, axis=0) / n_cols + pre_eps)
        pw = tl.load(pre_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = ((pf * prstd).to(dtype).to(tl.float32) * pw).to(dtype)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the model dtype's add
    if STREAM:
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if QUANT:  # fp8_matmul's quantize_rows of the stored row, op for op
        yf = y.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(yf), axis=0))
        tl.store(scales_ptr + row, scale)
        tl.store(codes_ptr + row * n_cols + cols, to_codes(yf, scale, codes_ptr.dtype.element_ty), mask=mask)


_bound = BoundKernel(_add_rms_norm_kernel)  # launched by shape, so a step pays Triton's bind once


def add_rms_norm(
    x: torch.Tensor,  # [T, N], or [S, T, N] partials: fp32 split-K ones, or parts in the model dtype
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
    quantize: bool = False,
    pre: tuple[torch.Tensor, float] | None = None,  # (weight, eps) of a norm of x first
    dtype: torch.dtype | None = None,  # the model's: partials without a residual are rounded to it
) -> tuple[torch.Tensor, ...]:
    """``(rms_norm(x + residual) * weight, x + residual)``; without a residual, ``(rms_norm(x) * weight, x)``;
    with ``quantize`` also the first's e4m3 codes [T, N] and fp32 row scales [T, 1] (see the module);
    with ``pre``, x is first ``rms_norm(x) * pre[0]`` (the second output then holds that plus the
    residual, or that alone).

    Given partials (fp32, or the model dtype), x is their fp32 sum in order rounded to the residual's
    dtype (the model's), or without a residual to ``dtype``. Both outputs are new tensors (no input
    is written), so callers may hold on to their inputs.
    """
    splits = x.shape[0] if x.dim() == 3 else 0
    tokens, n = x.shape[-2:]
    if n > MAX_HIDDEN or x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError(f"hidden {n} must be <= {MAX_HIDDEN} with contiguous rows")
    if residual is not None:
        dtype = residual.dtype
    if splits:
        check_partials_dtype(x, dtype)
    if residual is not None and (residual.shape != x.shape[-2:] or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape[-2:])}")
    if pre is not None and pre[0].stride(0) != 1:
        raise ValueError("the first norm's weight must be contiguous")
    dtype = dtype or x.dtype
    out = torch.empty((tokens, n), device=x.device, dtype=dtype)
    # the second output: the stream (x + residual), or x itself where the kernel leaves it unchanged
    res_out = torch.empty_like(out) if residual is not None or splits or pre is not None else x
    codes = torch.empty(tokens, n, dtype=torch.float8_e4m3fn, device=x.device) if quantize else out
    scales = torch.empty(tokens, 1, dtype=torch.float32, device=x.device) if quantize else out
    done = (out, res_out, codes, scales) if quantize else (out, res_out)
    if tokens == 0:
        return done
    block = triton.next_power_of_2(n)
    _bound(
        (tokens,),
        x,
        residual if residual is not None else x,
        weight,
        pre[0] if pre is not None else weight,
        out,
        res_out,
        codes,
        scales,
        x.stride(0) if splits else 0,
        x.stride(-2),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        pre[1] if pre is not None else eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        SPLITS=splits,
        QUANT=quantize,
        PRE=pre is not None,
        STREAM=res_out is not x,
        num_warps=min(16, max(1, block // 512)),
        **pdl.chained(x.device),
    )
    return done


def add_rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pre: tuple[torch.Tensor, float] | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: HF's RMSNorm (fp32 statistics, cast back before the weight) after the add;
    partials summed in fp32 and rounded to the model dtype (the residual's, else ``dtype``) first;
    ``pre``: x normed by its own weight before the add."""
    if x.dim() == 3:
        x = x.float().sum(0).to(residual.dtype if residual is not None else dtype)
    if pre is not None:
        x = add_rms_norm_ref(x, *pre)[0]
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


__all__ = ["add_rms_norm", "add_rms_norm_ref"]
