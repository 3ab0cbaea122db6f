"""The MLP's first half in one kernel: ``silu(x W_gate^T) * (x W_up^T)`` from the fused gate-up weight.

Unfused, the gate-up GEMM writes a [T, 2I] tensor and SiLU-and-mul reads it back to write [T, I]:
at 1-128 rows of Llama-3.1-8B that is a kernel a layer and 2-5% of the projection's time
(docs/kernels.md §7). Here each program computes matching [BLOCK_M, BLOCK_N] tiles of the gate and
the up products (two accumulators over the same x tiles; the weight stays [gate; up] as loaded) and
applies the activation in the epilogue, so only [T, I] is written. The activation rounds exactly as
the unfused path does (``silu_mul``): the two products to the model dtype, the SiLU to it.

Rows up to ``skinny_matmul.MAX_ROWS`` take the skinny kernel's gated form (a weight read); up to 128
rows the tiled kernel below (TMA loads, a software pipeline of ``STAGES`` k-steps, tiles grouped
along M so a band of weight columns is read from L2 by the programs of nearby rows). ``gate_up_silu``
returns None where its rule says the unfused pair (cuBLAS, then the SiLU-and-mul kernel) is as fast:
more rows, where cuBLAS's tiles fit the row count better and, further on, the product is
compute-bound and the saved bytes hide under the FLOPs anyway.
"""

from __future__ import annotations

import functools

import torch

from prefixserve.model.kernels import skinny_matmul
from prefixserve.model.kernels.silu_mul import silu_mul
from prefixserve.triton_support import require_triton

triton, tl = require_triton()

TileConfig = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps


@triton.jit(do_not_specialize=["M"])  # a step's rows: one compile for all (compile_watch)
def _gate_up_kernel(
    x_desc,  # TMA descriptor of x [M, K], tiles [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of the weight [2 N, K], tiles [BLOCK_N, BLOCK_K]
    out_ptr,  # [M, N]
    M,
    N,  # I: columns of the output, rows of each half of the weight
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP_M: tl.constexpr,
    GELU: tl.constexpr = False,  # the tanh GELU instead of SiLU (Gemma)
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n  # GROUP_M bands of rows walk the columns together (L2 reuse)
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([m0, k0])  # rows past M read as zeros
        gate = w_desc.load([n0, k0])  # rows past N (a last partial tile) are masked at the store
        up = w_desc.load([N + n0, k0])
        acc_gate = tl.dot(x, gate.T, acc_gate)
        acc_up = tl.dot(x, up.T, acc_up)
    dtype = out_ptr.dtype.element_ty
    out = silu_mul(acc_gate, acc_up, dtype, GELU).to(dtype)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


GROUP_M = 8


def tiled_config(m: int, n: int) -> TileConfig | None:
    """Tiles for ``m`` rows over 64 and ``n`` output columns, or None where cuBLAS plus the SiLU-and-mul
    kernel should run: narrower than ``skinny_matmul.MIN_GATED_COLUMNS`` (unmeasured, as for the
    gated form), or where it was as fast or
    faster (``benchmarks/probes/gate_up_gemm.py --ab``, alternating calls, Llama-3.1-8B's gate-up;
    docs/kernels.md §7). Up to 128 rows the product is a weight read and the fused kernel saves the
    [T, 2I] round trip: 5% a call on an H100 and an H200. From 129 rows the tiles quantize badly
    against cuBLAS's: 27% slower at 160 rows on an H200 (10% on an H100), 5-9% slower at 192-224 on
    an H200; at 256 rows 2-5% faster a call but level in whole H200 decode steps (0.993x), and from
    768 rows cuBLAS's compute-bound GEMM is about 7% faster than this kernel's."""
    if n < skinny_matmul.MIN_GATED_COLUMNS:
        return None
    return (128, 64, 64, 5, 4) if m <= 128 else None


@functools.cache
def _have_descriptors() -> bool:
    """Host-side TMA descriptors (Triton 3.4 and later)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # pragma: no cover - older Triton
        return False
    return True


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernels take ``x`` [M, K] through ``weight`` [2 I, K]: 16-bit, one dtype,
    contiguous (TMA needs 16-byte aligned rows), K a multiple of 128, on Hopper or the interpreter."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.shape[0] > 0
        and skinny_matmul.device_ok(x)
        and _have_descriptors()
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.data_ptr() % 16 == 0  # TMA's base alignment
        and weight.data_ptr() % 16 == 0
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % skinny_matmul.BLOCK_K == 0
        and weight.shape[0] % 2 == 0
    )


def gate_up_tiled(
    x: torch.Tensor, weight: torch.Tensor, config: TileConfig, gelu: bool = False
) -> torch.Tensor:
    """``silu(x W[:I]^T) * (x W[I:]^T)`` through the tiled kernel, into a new [M, I] tensor.

    Launched through Triton's own path (the descriptors are new objects each call): tens of host
    microseconds in an eager step, nothing in the decode graphs that replay it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    inter = weight.shape[0] // 2
    block_m, block_n, block_k, stages, warps = config
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(inter, block_n),)
    _gate_up_kernel[grid](
        x_desc, w_desc, out, m, inter, k, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, GROUP_M=GROUP_M, GELU=gelu,
        num_warps=warps,
    )  # fmt: skip
    return out


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, gelu: bool = False) -> torch.Tensor | None:
    """``silu_and_mul(F.linear(x, weight), gelu)`` in one kernel where a rule names one; None where the
    unfused pair should run (``fused.linear_silu_and_mul``): unsupported inputs, rows the rules
    leave to cuBLAS, or fewer than ``skinny_matmul.MIN_GATED_COLUMNS`` output columns."""
    if not supported(x, weight):
        return None
    m, inter = x.shape[0], weight.shape[0] // 2
    if m <= skinny_matmul.MAX_ROWS:
        config = skinny_matmul.gated_config(m, inter)  # None below MIN_GATED_COLUMNS
        return None if config is None else skinny_matmul.gated(x, weight, config, gelu)
    tiles = tiled_config(m, inter)
    return None if tiles is None else gate_up_tiled(x, weight, tiles, gelu)


__all__ = ["gate_up_silu", "gate_up_tiled", "supported", "tiled_config"]
