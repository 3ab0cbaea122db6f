"""``x @ W^T`` for a few rows of x (a decode step's tokens): the weight streamed once, near the copy rate.

At 1-64 rows a linear layer is a weight read: its FLOPs are a few percent of what the tensor cores
could do while the weight arrives. cuBLAS's kernels for these shapes read Llama-3.1-8B's o and qkv
projections at 66-79% of the copy rate on an H100 (docs/kernels.md §7). Here each program takes
``BLOCK_N`` output columns over the whole of K, streams its weight tile through a software pipeline
(``STAGES`` loads in flight) and multiplies it by the rows of x (small, from L2) on the tensor cores,
fp32 accumulation. Splitting K with a second kernel to sum the parts measured no faster at any
shape; where the next kernel is a norm that sums fp32 partials, ``skinny_partials`` hands it K
slices instead (``decode_split.partials``: narrow products, whose few column tiles leave SMs idle).
``skinny_config`` picks the tiles, from a sweep on the H100;
other GPUs keep cuBLAS (the tiles are Hopper's: 128 x 128-column tiles four deep need more shared
memory than an sm_86 / sm_89 SM has, and nothing was measured there).
"""

from __future__ import annotations

import functools
import os

import torch

from prefixserve.model.kernels.silu_mul import silu_mul
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.bound import BoundKernel
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()

MAX_ROWS = 64  # rows of x this kernel takes; more rows make a matmul compute-bound (cuBLAS)
BLOCK_K = 128  # K must be a multiple (every projection of the supported models is)


@triton.jit
def k_range(K, K_SLICE, slice_id, SPLIT: tl.constexpr):
    """(first, end) of the K columns a program sums: all of K, or with ``SPLIT`` its slice's
    ``K_SLICE`` (split-K partials, one plane a slice)."""
    if SPLIT:
        return slice_id * K_SLICE, slice_id * K_SLICE + K_SLICE
    return 0, K


@triton.jit(do_not_specialize=["M"])  # a step's rows: one compile for all (compile_watch)
def _skinny_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    bias_ptr,  # [N], or x_ptr when there is none
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # out = silu(x W[:N]^T) * (x W[N:2N]^T): the fused gate-up, its activation applied
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    GELU: tl.constexpr = False,  # GATED with the tanh GELU instead of SiLU (Gemma)
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
    SPLIT: tl.constexpr = False,  # program_id(1) takes K_SLICE columns of K: fp32 partials [S, M, N]
    K_SLICE=0,
    stride_os=0,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo, k_hi = k_range(K, K_SLICE, tl.program_id(1), SPLIT)
    if SPLIT:
        out_ptr += tl.program_id(1).to(tl.int64) * stride_os
    if PDL:
        wait()
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + N * stride_wn  # GATED: the up half's rows, N below the gate's
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None], other=0.0)
        if GATED:
            w_up = tl.load(up_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None], other=0.0)
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    if PDL:
        launch_dependents()
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:
        acc = silu_mul(acc, acc_up, dtype, GELU)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


_skinny = BoundKernel(_skinny_kernel)


SHORT_ROWS = 2048  # K at most this: 64 columns a program at a mid-width N (``skinny_config``)


def skinny_config(m: int, n: int, k: int = 0) -> tuple[int, int] | None:
    """(BLOCK_N, STAGES) for an [m, K] x [K, n] product, or None where cuBLAS was faster: the H100
    sweep at Llama-3.1-8B's shapes (``benchmarks/probes/skinny_gemm.py``, docs/kernels.md §7). 32
    columns a program and six loads in flight; 64 (m <= 16) or 128 columns for the wide gate-up and
    lm_head. Over 16 rows, a mid-width N (the fused qkv: 192 programs of 32 columns, one a program's
    SM at that height) ran 4% slower than cuBLAS. Rows of ``k`` <= 2048 (given) at a mid-width N
    (Qwen3-30B-A3B's qkv, 5120 x 2048) take 64 columns: a 32-column program reads only 128 KB."""
    if n >= 16384:
        return (64, 6) if m <= 16 else (128, 4)
    if m <= 16 and n > 4096 and 0 < k <= SHORT_ROWS:
        return 64, 6
    if m <= 16 or n <= 4096:
        return 32, 6
    return None


MIN_GATED_COLUMNS = 8192  # the gated form's rules were measured at 14,336 columns (Llama-3.1-8B)


def gated_config(m: int, n: int) -> tuple[int, int] | None:
    """(BLOCK_N, STAGES) of the gated form (``n`` output columns, 2n weight rows), or None where
    cuBLAS and the SiLU-and-mul kernel should run: narrower than ``MIN_GATED_COLUMNS`` (a
    tensor-parallel shard of the gate-up, a small model), where too few programs would fill the SMs
    and nothing was measured."""
    if n < MIN_GATED_COLUMNS:
        return None
    return (32, 6) if m <= 16 else (64, 4)


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def hopper(device: torch.device) -> bool:
    """Whether a CUDA device is a Hopper GPU (sm_90), where the dense kernels' tiles were measured."""
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


def device_ok(x: torch.Tensor) -> bool:
    """A Hopper GPU (where the tiles were measured), or the CPU interpreter (tests)."""
    if x.is_cuda:
        return hopper(x.device)
    return os.environ.get("TRITON_INTERPRET") == "1"


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``skinny_linear`` takes this product: 1 to MAX_ROWS rows of 16-bit x of the weight's
    dtype, both with contiguous rows, K a multiple of BLOCK_K, a contiguous bias of N if any, on a
    Hopper GPU (or the CPU interpreter)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS  # first: a prefill's many rows leave here
        and device_ok(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % BLOCK_K == 0
        and (bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.shape[0] == weight.shape[0]))
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``supported`` inputs, into a new [M, N] tensor (or ``out``);
    ``config``: (BLOCK_N, STAGES), by default ``skinny_config``'s (32 columns, six stages where it
    names none: cuBLAS is the faster choice there, ``fused.linear`` takes it)."""
    if not supported(x, weight, bias):
        raise ValueError(
            f"skinny_linear takes 1-{MAX_ROWS} 16-bit rows with K % {BLOCK_K} == 0, the weight's dtype "
            f"and a contiguous bias of N, on a Hopper GPU: x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    config = config or skinny_config(x.shape[0], *weight.shape) or (32, 6)
    return _launch(x, weight, bias, config, out=out)


def linear_if_faster(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` through the kernel where it takes the product and its rule names
    tiles (``supported``, ``skinny_config``); None where cuBLAS should do it (``fused.linear``).
    ``out``: a [M, N] tensor with unit column stride to write into (a peer all-reduce buffer)."""
    if not supported(x, weight, bias):
        return None
    config = skinny_config(x.shape[0], *weight.shape)
    return None if config is None else _launch(x, weight, bias, config, out=out)


def skinny_gated(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int] | None = None, gelu: bool = False
) -> torch.Tensor:
    """``silu(x W[:n]^T) * (x W[n:]^T)`` of the fused gate-up weight [2n, K] (``gelu``: the tanh
    GELU's), into a new [M, n] tensor (``supported`` inputs, no bias); ``config`` by default
    ``gated_config``'s."""
    if not supported(x, weight) or weight.shape[0] % 2:
        raise ValueError(
            f"skinny_gated takes 1-{MAX_ROWS} 16-bit rows with K % {BLOCK_K} == 0 and a [2n, K] weight "
            f"of their dtype, on a Hopper GPU: x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    n = weight.shape[0] // 2
    return _launch(x, weight, None, config or gated_config(x.shape[0], n) or (32, 6), gated=True, gelu=gelu)


def gated(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int], gelu: bool = False) -> torch.Tensor:
    """The gated form's launch for inputs the caller has checked (``gate_up.supported``)."""
    return _launch(x, weight, None, config, gated=True, gelu=gelu)


def skinny_partials(
    x: torch.Tensor, weight: torch.Tensor, splits: int, config: tuple[int, int] | None = None
) -> torch.Tensor:
    """fp32 partials [splits, M, N] of ``x @ weight.T`` over equal slices of K, for ``supported``
    inputs with K a multiple of ``splits * BLOCK_K`` (no bias): the product's programs times
    ``splits``, where too few column tiles would leave SMs idle; the next kernel, an add-RMSNorm,
    sums them (``decode_split.partials``, ``fused.add_rms_norm``)."""
    m, k = x.shape
    if not supported(x, weight) or splits < 1 or k % (splits * BLOCK_K):
        raise ValueError(
            f"skinny_partials takes supported inputs with K a multiple of {splits} x {BLOCK_K}: x "
            f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    out = torch.empty(splits, m, weight.shape[0], dtype=torch.float32, device=x.device)
    config = config or skinny_config(m, weight.shape[0]) or (32, 6)
    return _launch(x, weight, None, config, out=out, splits=splits)


def check_partials(
    out: torch.Tensor | None, splits: int, m: int, n: int, device: torch.device, plain: bool
) -> None:
    """A split launch writes fp32 planes [splits, m, n] into ``out``, each plane a slice's product:
    a bias or an activation (``plain`` False) would be applied to every plane."""
    if not plain:
        raise ValueError("split-K partials take no bias and no activation: the next kernel sums the planes")
    if out is None or out.shape != (splits, m, n) or out.dtype != torch.float32 or not out.is_contiguous():
        got = None if out is None else (tuple(out.shape), out.dtype)
        raise ValueError(f"split-K partials need a contiguous fp32 out of [{splits}, {m}, {n}]: {got}")
    if out.device != device:
        raise ValueError(f"out on {out.device}, x on {device}")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: tuple[int, int],
    gated: bool = False,
    out: torch.Tensor | None = None,
    gelu: bool = False,
    splits: int = 1,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    block_n, stages = config
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if splits > 1:
        check_partials(out, splits, m, n, x.device, bias is None and not gated)
    elif out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with unit column stride on {x.device}")
    # every argument by keyword, the split ones too: a bound launch is kept only so (``launch.record``)
    split = {"SPLIT": splits > 1, "K_SLICE": k // splits, "stride_os": out.stride(0) if splits > 1 else 0}
    grid = (triton.cdiv(n, block_n),) if splits == 1 else (triton.cdiv(n, block_n), splits)
    _skinny(
        grid, x, weight, out, x if bias is None else bias, m, n, k,
        x.stride(0), weight.stride(0), out.stride(-2),
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        STAGES=stages, GELU=gelu, num_warps=4, **split, **pdl.chained(x.device),
    )  # fmt: skip
    return out


__all__ = [
    "MAX_ROWS",
    "MIN_GATED_COLUMNS",
    "check_partials",
    "device_ok",
    "gated",
    "gated_config",
    "hopper",
    "linear_if_faster",
    "skinny_config",
    "skinny_gated",
    "skinny_linear",
    "skinny_partials",
    "supported",
]
