"""``F.linear`` for decode steps of a few hundred to a thousand rows, where cuBLAS's tiles fill the SMs badly.

A GEMM of M x N output in tiles of BLOCK_M x BLOCK_N runs in waves of one tile per SM; the last wave's
idle SMs are time lost. At 1,024 rows of Llama-3.1-8B's o projection (N = 4,096) cuBLAS picks
192 x 128 tiles (6 x 32 = 192 tiles: 1.45 waves on 132 SMs) and runs at about 440 TFLOP/s, where
its other projections reach 730; 128 x 256 tiles make 128 tiles, one wave. The kernel is the plain
Hopper recipe: TMA loads of x and weight tiles through a software pipeline of ``STAGES`` k-steps,
wgmma through ``tl.dot`` with fp32 accumulation, the bias in the epilogue, tiles grouped along M so
the programs of nearby rows read a band of weight columns from L2. ``tiled_config`` names the shapes
where a measured sweep (``benchmarks/probes/tiled_gemm.py``) found it faster than cuBLAS;
``fused.linear`` asks it after the skinny kernel's rule.
"""

from __future__ import annotations

import functools

import torch

from prefixserve.attention.kernels import require_triton
from prefixserve.model.kernels import skinny_matmul

triton, tl = require_triton()

TileConfig = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps
GROUP_M = 8  # row bands that walk the weight's columns together


@triton.jit
def tile_origin(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(first row, first column) of program ``pid``'s output tile: GROUP_M bands of rows take the
    columns in turn, so a band of weight columns is read once from memory and then from L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _matmul_kernel(
    x_desc,  # TMA descriptor of x [M, K], tiles [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of the weight [N, K], tiles [BLOCK_N, BLOCK_K]
    out_ptr,  # [M, N]
    bias_ptr,  # [N] or a dummy
    M,
    N,
    K,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    m0, n0 = tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([m0, k0])  # rows past M (and weight rows past N) read as zeros
        w = w_desc.load([n0, k0])
        acc = tl.dot(x, w.T, acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@functools.cache
def have_descriptors() -> bool:
    """Host-side TMA descriptors (Triton 3.4 and later)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # pragma: no cover - older Triton
        return False
    return True


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes ``x`` [M, K] through ``weight`` [N, K]: 16-bit, one dtype, contiguous
    and 16-byte aligned (TMA), K a multiple of 128, a contiguous bias of N if any, on Hopper or the
    CPU interpreter."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.shape[0] > 0
        and skinny_matmul.device_ok(x)
        and have_descriptors()
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % skinny_matmul.BLOCK_K == 0
        and (
            bias is None
            or (bias.shape == (weight.shape[0],) and bias.is_contiguous() and bias.dtype == x.dtype)
        )
    )


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: TileConfig
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the kernel with ``config``'s tiles, into a new [M, N] tensor.

    The descriptors are new objects each call: host microseconds in an eager step, nothing in the
    decode graphs that replay it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, stages, warps = config
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](
        x_desc, w_desc, out, out if bias is None else bias, m, n, k, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        GROUP_M=GROUP_M, num_warps=warps,
    )  # fmt: skip
    return out


def tiled_config(m: int, n: int, k: int) -> TileConfig | None:
    """Tiles for an [m, k] x [k, n] product where the sweep found this kernel faster than cuBLAS; None
    elsewhere (cuBLAS runs)."""
    return None


def linear_if_faster(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` through the kernel where ``tiled_config`` names tiles; None where
    cuBLAS should do it (``fused.linear``)."""
    if x.dim() != 2 or x.shape[0] <= skinny_matmul.MAX_ROWS:
        return None
    config = tiled_config(x.shape[0], weight.shape[0], x.shape[1])
    if config is None or not supported(x, weight, bias):
        return None
    return tiled_linear(x, weight, bias, config)


__all__ = [
    "GROUP_M",
    "have_descriptors",
    "linear_if_faster",
    "supported",
    "tile_origin",
    "tiled_config",
    "tiled_linear",
]
