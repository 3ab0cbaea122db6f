"""``x @ W^T`` of a tensor-parallel row-parallel layer, each output tile also written into the peer rank's
memory, then the peer signalled: the all-reduce's transfer under the matmul's own time.

At two ranks and a decode batch of 65-512 rows the o and down projections are cuBLAS's, and the
fused all-reduce that follows reads the peer's product over NVLink after a barrier: 12.7 us a call at
[256, 4096] bf16 on 2 x H100, 0.82 ms of a 6.27 ms step (docs/kernels.md §8). Here a plain tiled
matmul (fp32 accumulation, ``STAGES`` loads in flight) stores each finished tile twice, here and
into the peer's incoming slot, and its last program signals the peer (``push_signal.signal_done``);
the peer's norm then reads both products from its own memory after a wait on a local count.

Programs take ``BLOCK_M`` x ``BLOCK_N`` tiles with the row bands fastest, so the programs sharing a
weight tile run together and read it from HBM about once (the x rows come from L2). Whether this
matches cuBLAS at these shapes is for the GPU to say (``benchmarks/probes/peer_norm.py``); until
then ``fused.linear_pushed`` takes it only where ``PREFIXSERVE_PEER_PUSH`` asks for a producer push.
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels.bound import BoundKernel
from prefixserve.model.kernels.push_signal import PushTarget, signal_done
from prefixserve.triton_support import require_triton

triton, tl = require_triton()

MIN_ROWS, MAX_ROWS = 65, 512  # below: the skinny kernel pushes; above: not a decode step's product
BLOCK_K = 64
CONFIG = (64, 128, 3, 8)  # (BLOCK_M, BLOCK_N, STAGES, num_warps), not yet tuned


@triton.jit(do_not_specialize=["M"])  # a step's rows (compile_watch)
def _push_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N] here
    peer_out_ptr,  # [M, N] in the peer's memory
    tickets_ptr,
    expected_ptr,
    peer_calls_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m  # row bands fastest: a weight tile's programs run side by side
    pid_n = pid // tiles_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tile = acc.to(out_ptr.dtype.element_ty)
    at = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + at, tile, mask=ok)
    tl.store(peer_out_ptr + at, tile, mask=ok)
    signal_done(tickets_ptr, expected_ptr, peer_calls_ptr, tl.num_programs(0))


_bound = BoundKernel(_push_matmul_kernel)


def supported(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """65-512 rows of 16-bit x of the weight's dtype, contiguous rows, K a multiple of BLOCK_K, a
    [M, N] ``out`` with unit column stride, on a Hopper GPU or the CPU interpreter."""
    from prefixserve.model.kernels.skinny_matmul import device_ok

    return (
        x.dim() == 2
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and device_ok(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % BLOCK_K == 0
        and out.shape == (x.shape[0], weight.shape[0])
        and out.dtype == x.dtype
        and out.stride(1) == 1
    )


def push_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    push: PushTarget,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight)`` into ``out`` and into ``push.peer_out``, then the peer signalled, for
    ``supported`` inputs; ``config``: (BLOCK_M, BLOCK_N, STAGES, num_warps), else ``CONFIG``."""
    if not supported(x, weight, out):
        raise ValueError(
            f"push_linear takes {MIN_ROWS}-{MAX_ROWS} 16-bit rows with K % {BLOCK_K} == 0 and a matching "
            f"out: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}, out {tuple(out.shape)}"
        )
    if push.peer_out.shape != out.shape or push.peer_out.stride() != out.stride():
        raise ValueError(f"the peer's buffer {tuple(push.peer_out.shape)} must match out {tuple(out.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, stages, warps = config or CONFIG
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _bound(
        grid, x, weight, out, push.peer_out, push.tickets, push.expected, push.peer_calls, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return out


__all__ = ["MAX_ROWS", "MIN_ROWS", "push_linear", "supported"]
