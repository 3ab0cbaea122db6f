"""``x @ W^T`` with W held as e4m3 codes and fp32 scales (W8A16): the skinny kernel's FP8 twin.

At a decode step's few rows a linear layer is a read of its weight; FP8 codes halve it. Each program
takes ``BLOCK_N`` output columns (and, past ``MAX_ROWS`` rows, ``BLOCK_M`` rows) over the whole of
K, streams its code tile through a software pipeline, converts it to x's dtype in registers and
multiplies on the tensor cores with fp32 accumulation. Per-channel scales [N, 1] multiply the sum
once at the end; a block-scaled checkpoint's [N, K/128] scales multiply each 128-column step's
product (``GROUPED``, BLOCK_K = 128 = the block's edge), so one kernel serves both at every M.
K need not be a multiple of 128 (masked loads). The tiles are ``skinny_matmul.skinny_config``'s
for bf16 at the same shapes; swept for FP8 on an H200 (``benchmarks/probes/fp8_tiles.py``), they
were within 2% of the best at one row and 8% at 64, where a long K (the down product's 14,336)
took 8 loads in flight over 4-6 (28 us against 35 at 64 rows: ``LONG_K_STAGES``), and more stages
slowed the shorter products.
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels import skinny_matmul
from prefixserve.model.kernels.e4m3 import row_launch, row_scale, to_codes
from prefixserve.model.kernels.silu_mul import silu_mul
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.bound import BoundKernel
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()

BLOCK_K = 128  # = the block-scaled format's group of columns (GROUPED indexes scales by k0 // BLOCK_K)
CHANNEL_BLOCK_K = 256  # per-channel scales: a step loads as many bytes as the bf16 kernel's 128 columns
LARGE_TILE = (64, 128, 3)  # BLOCK_M, BLOCK_N, STAGES past MAX_ROWS (block-scaled prefill)
SHARED_BYTES = 192 << 10  # the pipeline's stages kept under this (an H100/H200 SM has 228 KiB)
LONG_K, LONG_K_STAGES = 8192, 8  # W8A8 over K >= LONG_K: this many stages (fp8_tiles.py, H200)
# the gated form's (BLOCK_N of each half, STAGES) up to 16 rows and past them (fp8_tiles.py --gated, H200:
# the 8B gate-up at 1 / 64 rows 41.5 / 43.9 us against 44.7 / 45.9 with the unfused product's tiles)
GATED_TILES = ((64, 3), (64, 2))
# W8A8 with per-channel weights past MAX_ROWS up to MID_ROWS rows (a batched decode step, where the
# products run in K slices for the norm after them: ``decode_split``): (BLOCK_M, BLOCK_N, BLOCK_K,
# STAGES, warps), from ``benchmarks/probes/fp8_mid_rows.py`` (H200). BLOCK_K is ``block_k_for``'s
# past MAX_ROWS (BLOCK_K), which ``fp8_partials`` cuts K's slices by; the gated form's the same
# (None: such a gate-up runs on cuBLASLt, then SiLU-and-mul)
MID_ROWS = 128
MID_TILE = (128, 128, BLOCK_K, 4, 8)
MID_GATED_TILE: tuple[int, int, int, int, int] | None = (128, 128, BLOCK_K, 4, 8)


def mid_rows(m: int) -> bool:
    """Whether ``m`` rows are past the decode tiles and up to ``MID_ROWS``: the mid tiles' range."""
    return skinny_matmul.MAX_ROWS < m <= MID_ROWS


@triton.jit(do_not_specialize=["M"])
def _fp8_kernel(
    x_ptr,  # [M, K] bf16 / fp16
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [N, G] fp32
    out_ptr,  # [M, N]
    bias_ptr,  # [N], or x_ptr when there is none
    sx_ptr,  # X_CODES: [M] fp32 per-row scales of x's e4m3 codes, else x_ptr
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,  # scales per 128-column group (G = ceil(K / 128)), else per row (G = 1)
    X_CODES: tl.constexpr,  # x is e4m3 codes with row scales (W8A8): e4m3 wgmma from 64 rows a block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
    SPLIT: tl.constexpr = False,  # program_id(2) takes K_SLICE columns of K: fp32 partials [S, M, N]
    K_SLICE=0,
    stride_os=0,
    GATED: tl.constexpr = False,  # out = silu(x W[:N]^T) * (x W[N:2N]^T): the fused gate-up (per-channel)
    GELU: tl.constexpr = False,  # GATED with the tanh GELU instead of SiLU (Gemma)
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo, k_hi = skinny_matmul.k_range(K, K_SLICE, tl.program_id(2), SPLIT)
    if SPLIT:
        out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    if PDL:
        wait()
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn
    up_rows = w_rows + N * stride_wn  # GATED: the up half's rows, N below the gate's
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        k_ok = (k0 + offs_k) < K
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            w_up = tl.load(up_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED and X_CODES:
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        elif GATED:
            acc_up = tl.dot(x, tl.trans(w_up.to(dtype)), acc_up)
        if X_CODES:
            acc = tl.dot(x, tl.trans(w), acc)
        elif GROUPED:
            s = tl.load(s_rows + k0 // BLOCK_K, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(dtype))) * s[None, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(dtype)), acc)
    if PDL:
        launch_dependents()
    if not GROUPED:
        acc *= tl.load(s_rows, mask=n_ok, other=0.0)[None, :]
    if X_CODES:
        acc *= tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:  # the up half scaled as the gate's (per-channel weights, no bias), then the activation
        acc_up *= tl.load(s_rows + N * stride_sn, mask=n_ok, other=0.0)[None, :]
        if X_CODES:
            acc_up *= tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
        acc = silu_mul(acc, acc_up, out_ptr.dtype.element_ty, GELU)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_fp8 = BoundKernel(_fp8_kernel)


def supported(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether ``fp8_linear`` takes this product: 2-D 16-bit x with unit column stride, e4m3 codes
    [N, K] and fp32 scales [N, 1] or [N, ceil(K/128)] with unit inner strides, a contiguous bias of
    N if any; on an sm_89+ GPU or the CPU interpreter (tests)."""
    k = x.shape[-1]
    return (
        x.dim() == 2
        and x.shape[0] > 0
        and (not x.is_cuda or x.device == codes.device)
        and (x.is_cuda or skinny_matmul.device_ok(x))
        and x.dtype in (torch.bfloat16, torch.float16)
        and codes.dtype == torch.float8_e4m3fn
        and scale.dtype == torch.float32
        and x.stride(1) == 1
        and codes.stride(1) == 1
        and codes.shape[1] == k
        and scale.dim() == 2
        and scale.shape[0] == codes.shape[0]
        and scale.shape[1] in (1, -(-k // BLOCK_K))
        and scale.stride(1) == 1
        and (bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.shape[0] == codes.shape[0]))
    )


def tiles(m: int, n: int, block_k: int = BLOCK_K) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES): up to ``MAX_ROWS`` rows one program column holds them all and the
    skinny kernel's bf16 tiles apply, with as many stages as ``SHARED_BYTES`` holds; past it
    ``LARGE_TILE``."""
    if m > skinny_matmul.MAX_ROWS:
        return LARGE_TILE
    block_n, stages = skinny_matmul.skinny_config(m, n) or (32, 6)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    per_stage = block_k * (2 * block_m + block_n)  # a 16-bit x tile and an e4m3 weight tile
    return block_m, block_n, max(2, min(stages, SHARED_BYTES // per_stage))


def _check_x_codes(x: torch.Tensor, scale: torch.Tensor, x_codes: tuple | None) -> None:
    """W8A8's x codes (``quantize_rows``) must match x and come with per-channel weight scales."""
    if x_codes is not None and (scale.shape[1] != 1 or x_codes[0].shape != x.shape):
        raise ValueError("x codes need per-channel weight scales and x's shape")


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x @ (codes * scale)^T + bias`` into a new [M, N] tensor of x's dtype (or ``out``), for
    ``supported`` inputs. ``x_codes`` = (e4m3 codes [M, K], fp32 scales [M, 1]) of x
    (``quantize_rows``): W8A8 (per-channel weight scales only; x then only names the output's
    dtype): e4m3 wgmma products for a 64-row block, fp16 mma with both tiles widened below it
    (docs/kernels.md §10)."""
    _check_x_codes(x, scale, x_codes)
    if not supported(x, codes, scale, bias):
        raise ValueError(
            f"fp8_linear takes 16-bit x [M, K] and e4m3 codes [N, K] with fp32 scales [N, 1] or "
            f"[N, K/128]: x {tuple(x.shape)} {x.dtype}, codes {tuple(codes.shape)} {codes.dtype}, "
            f"scales {tuple(scale.shape)} {scale.dtype}"
        )
    return launch(x, codes, scale, bias, out, x_codes)


def block_k_for(m: int, grouped: bool) -> int:
    """The columns of K a pipeline stage loads: a block-scaled format's group, and past
    ``MAX_ROWS`` rows the large tile's; else ``CHANNEL_BLOCK_K``."""
    return BLOCK_K if grouped or m > skinny_matmul.MAX_ROWS else CHANNEL_BLOCK_K


def fp8_partials(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    splits: int,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """fp32 partials [splits, M, N] of ``fp8_linear``'s product (scales applied, no bias) over equal
    slices of K, each a multiple of the stage's columns (``block_k_for``): as
    ``skinny_matmul.skinny_partials``, the next kernel sums them."""
    m, k = x.shape
    _check_x_codes(x, scale, x_codes)
    block_k = block_k_for(m, scale.shape[1] > 1)
    if not supported(x, codes, scale) or splits < 1 or k % (splits * block_k):
        raise ValueError(
            f"fp8_partials takes supported inputs with K a multiple of {splits} x {block_k}: x "
            f"{tuple(x.shape)}, codes {tuple(codes.shape)}, scales {tuple(scale.shape)}"
        )
    out = torch.empty(splits, m, codes.shape[0], dtype=torch.float32, device=x.device)
    return launch(x, codes, scale, None, out, x_codes, splits)


def fp8_gated(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """``silu(x Wg^T) * (x Wu^T)`` of a fused gate-up layer held as e4m3 codes [2n, K] with per-channel
    scales [2n, 1] (``gelu``: the tanh GELU's), into a new [M, n] tensor of x's dtype: one kernel,
    the [M, 2n] product never written, rounded as the unfused pair (``fp8_linear``, then SiLU-and-mul)
    rounds. ``x_codes``: W8A8, as ``fp8_linear``'s."""
    if scale.shape[1] != 1 or codes.shape[0] % 2 or not supported(x, codes, scale):
        raise ValueError(
            f"fp8_gated takes supported inputs with per-channel scales and an even row count: x "
            f"{tuple(x.shape)}, codes {tuple(codes.shape)}, scales {tuple(scale.shape)}"
        )
    _check_x_codes(x, scale, x_codes)
    return launch(x, codes, scale, x_codes=x_codes, gated=True, gelu=gelu)


def launch(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    splits: int = 1,
    gated: bool = False,
    gelu: bool = False,
) -> torch.Tensor:
    """``fp8_linear`` for inputs its caller has found ``supported`` (``fp8.linear`` asks once a
    product, not once to choose the path and again here); ``splits`` > 1: ``out`` is fp32 partials
    [splits, M, N] (``fp8_partials``); ``gated``: ``fp8_gated``'s product (codes [2N, K])."""
    m, k = x.shape
    rows = codes.shape[0]  # weight rows a launch streams: both halves of a gated one
    n = rows // 2 if gated else rows
    if splits > 1:
        skinny_matmul.check_partials(out, splits, m, n, x.device, bias is None and not gated)
    elif out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with unit column stride on {x.device}")
    grouped = scale.shape[1] > 1
    block_k = block_k_for(m, grouped)
    block_m, block_n, stages = tiles(m, rows, block_k)
    if x_codes is not None and k >= LONG_K and block_k * (block_m + block_n) * LONG_K_STAGES <= SHARED_BYTES:
        stages = LONG_K_STAGES  # x's codes are a byte a value: 8 stages of 256 columns fit
    warps = 4
    # W8A8 past the decode tiles: its x tiles are e4m3 codes, so the mid tiles fit shared memory
    mid = x_codes is not None and not grouped and mid_rows(m)
    if gated and mid and MID_GATED_TILE is not None:
        block_m, block_n, block_k, stages, warps = MID_GATED_TILE
    elif gated:  # a program streams both halves' rows of its columns
        block_n, stages = GATED_TILES[m > 16]
    elif mid:
        block_m, block_n, block_k, stages, warps = MID_TILE
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    # every argument by keyword, the split ones too: a bound launch is kept only so (``launch.record``)
    split = {"SPLIT": splits > 1, "K_SLICE": k // splits, "stride_os": out.stride(0) if splits > 1 else 0}
    if splits > 1:
        grid = (*grid, splits)
    xin, sx = (x, x) if x_codes is None else (x_codes[0], x_codes[1])
    _fp8(
        grid, xin, codes, scale, out, x if bias is None else bias, sx, m, n, k,
        xin.stride(0), codes.stride(0), scale.stride(0), out.stride(-2),
        HAS_BIAS=bias is not None, GROUPED=grouped, X_CODES=x_codes is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps, **split, GATED=gated, GELU=gelu,
        **pdl.chained(x.device),
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(
    x_ptr,  # [M, K] 16-bit
    q_ptr,  # [M, K] e4m3 (contiguous)
    s_ptr,  # [M] fp32
    static_ptr,  # [1] fp32: the checkpoint's input scale (STATIC), else x_ptr
    M,
    K,
    stride_xm,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    WHOLE: tl.constexpr = False,  # BLOCK >= K: the row held in registers, read once
    PDL: tl.constexpr = False,  # launched as a dependent: the next product may start at once
):
    if PDL:
        launch_dependents()
        wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if WHOLE:  # names of their own: the compiler reads a name set here and in the loops as carried
        whole = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        if STATIC:
            row_s = tl.load(static_ptr)
        else:
            row_s = row_scale(tl.max(tl.abs(whole), axis=0))
            tl.store(s_ptr + row, row_s)
        tl.store(q_ptr + row * K + offs, to_codes(whole, row_s, q_ptr.dtype.element_ty), mask=offs < K)
        return
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        q = to_codes(x, scale, q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * K + k0 + offs, q, mask=k0 + offs < K)


_quantize = BoundKernel(_quantize_rows_kernel)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_tokens`` in one kernel: each row of x read once (held whole, ``e4m3.row_launch``)
    or twice (its amax, then its codes), the codes written once; torch's ops took six passes over a
    prefill's activations per product."""
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if static is None:
        scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    else:
        scale = static.float().reshape(1, 1).expand(m, 1).contiguous()
    if m:
        block, whole, warps = row_launch(k)
        _quantize(
            (m,), x, codes, scale, x if static is None else static, m, k, x.stride(0),
            STATIC=static is not None, BLOCK=block, WHOLE=whole, num_warps=warps,
            **pdl.chained(x.device),
        )  # fmt: skip
    return codes, scale


__all__ = [
    "BLOCK_K",
    "CHANNEL_BLOCK_K",
    "LARGE_TILE",
    "MID_GATED_TILE",
    "MID_ROWS",
    "MID_TILE",
    "block_k_for",
    "fp8_gated",
    "fp8_linear",
    "fp8_partials",
    "launch",
    "mid_rows",
    "quantize_rows",
    "supported",
    "tiles",
]
