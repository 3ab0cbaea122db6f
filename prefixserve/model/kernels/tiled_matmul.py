"""``x @ W^T`` into a given output for a few hundred rows: tiles sized so one wave fills the GPU.

At 128-512 rows a tensor-parallel shard's product is too small for cuBLAS's tiles to fill the SMs
evenly: the o_proj shard of Llama-3.1-8B at two ranks ([256, 2048] x [2048, 4096]) ran 96 x 64
tiles, 192 of them on 132 SMs (two waves, the second half empty). Here each program takes a
[BLOCK_M, BLOCK_N] tile over ``1 / SPLIT`` of K (TMA loads, a software pipeline of ``STAGES``
k-steps, tiles grouped along M so a band of weight columns is read from L2 by nearby rows), so the
grid can be shaped to one full wave. With ``SPLIT`` > 1 each program writes its fp32 partial tile to
a workspace and counts itself in; the last of a tile's programs to arrive sums the partials in slice
order (the same rounding whoever is last) and writes the tile, then resets the count, so the
kernel needs no second launch and leaves nothing to clear between graph replays.
"""

from __future__ import annotations

import functools

import torch

from prefixserve.model.kernels import gate_up
from prefixserve.triton_support import require_triton

triton, tl = require_triton()

TileConfig = tuple[int, int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps, SPLIT
GROUP_M = 8


@triton.jit(do_not_specialize=["M"])  # a step's rows: one compile for all (compile_watch)
def _tiled_kernel(
    x_desc,  # TMA descriptor of x [M, K], tiles [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of the weight [N, K], tiles [BLOCK_N, BLOCK_K]
    out_ptr,  # [M, N], rows ``stride_om`` apart
    part_ptr,  # fp32 [tiles, SPLIT, BLOCK_M, BLOCK_N] workspace (SPLIT > 1)
    count_ptr,  # int32 [tiles], zero between calls (SPLIT > 1)
    M,
    N,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    part = pid % SPLIT  # a tile's slices are neighbours in launch order: they run together
    tile = pid // SPLIT
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows_in_group
    pid_n = (tile % per_group) // rows_in_group
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    k_len = K // SPLIT
    k_first = part * k_len
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_first, k_first + k_len, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([m0, k0])  # rows past M read as zeros
        w = w_desc.load([n0, k0])  # rows past N are masked at the store
        acc = tl.dot(x, w.T, acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    dtype = out_ptr.dtype.element_ty
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(dtype), mask=out_mask)
    else:
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        slots = part_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_M * BLOCK_N)
        tl.store(slots + part * (BLOCK_M * BLOCK_N) + in_tile, acc)
        tl.debug_barrier()  # every warp's partial stored before the count says so
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last slice in: the others' partials are complete
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # slice order: the same sum whichever program is last
                if s == part:
                    total += acc
                else:
                    total += tl.load(slots + s * (BLOCK_M * BLOCK_N) + in_tile, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(dtype), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call


class _Workspace:
    """Per device: the split programs' fp32 partial tiles and arrival counts. Buffers only grow and
    are never freed, since a captured CUDA graph keeps the addresses it was recorded with."""

    def __init__(self) -> None:
        self.parts: dict[torch.device, list[torch.Tensor]] = {}
        self.counts: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.parts.setdefault(device, [])
        counts = self.counts.setdefault(device, [])
        if not parts or parts[-1].numel() < floats:
            parts.append(torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device))
        if not counts or counts[-1].numel() < tiles:
            counts.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
        return parts[-1], counts[-1]


_WORKSPACE = _Workspace()


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def supported(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` [M, K] through ``weight`` [N, K] into ``out`` [M, N]: 16-bit, one
    dtype, TMA-aligned rows, K a multiple of 128, on Hopper or the interpreter."""
    return (
        gate_up.supported(x, weight)  # the same TMA conditions (the even row count it asks is harmless)
        and out.dtype == x.dtype
        and out.dim() == 2
        and out.shape == (x.shape[0], weight.shape[0])
        and out.stride(1) == 1
    )


def tiled_linear_into(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: TileConfig
) -> torch.Tensor:
    """``x @ weight^T`` written into ``out`` through the tiled kernel with ``config``'s tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, stages, warps, split = config
    if k % (split * block_k):
        raise ValueError(f"K={k} is not a multiple of {split} slices of {block_k}")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    parts, counts = (
        _WORKSPACE.get(x.device, tiles * split * block_m * block_n, tiles) if split > 1 else (out, out)
    )
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _tiled_kernel[(tiles * split,)](
        x_desc, w_desc, out, parts, counts, m, n, k, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, GROUP_M=GROUP_M, SPLIT=split,
        num_warps=warps,
    )  # fmt: skip
    return out


__all__ = ["TileConfig", "supported", "tiled_linear_into"]
