"""Host side shared by the Triton kernels: argument checks, tile sizes fitted to shared memory, launches.

``fit_tiles`` models Triton's shared-memory use (``tile_smem_bytes``) so a kernel's tiles fit the GPU's
limit for every dtype and head size; ``launch_fitting`` is the safety net where the model is off (it
retries with fewer stages, then narrower KV tiles, and remembers what fitted). Nothing here needs
Triton at import: the host planners (``shared_plan``) use it without a GPU toolchain.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from prefixserve.triton_support.launch import Launch, record

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the 1e-5 promise), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """Triton 3.x's CPU interpreter computes bf16 tl.dot wrongly; upcast the tiles there only."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill (a fixed small number on the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


SMEM_LIMIT_HOPPER = 232_448  # opt-in shared memory per block on the H100 / H200 (bytes)


def smem_limit(device: torch.device) -> int:
    """Shared memory one program may use: read off the GPU, the Hopper value elsewhere (interpreter)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", SMEM_LIMIT_HOPPER))
    return SMEM_LIMIT_HOPPER


def tile_smem_bytes(block_m: int, block_n: int, dim: int, elt: int, stages: int) -> int:
    """Shared memory of ``attend_range``'s pipelined loop: ``stages`` copies of the K and V tiles, plus q.

    The K/V term is what Triton 3.6 reported on the H200 (fp32, 128 x 128 tiles, d=128, 2 stages:
    2 x 2 x 128 x 128 x 4 = 262,144 B); the q tile is added because wgmma may read it from shared
    memory, in a buffer of a power-of-two rows (the Gluon kernel's 192-row tiles hold q in 256 rows).
    Scores and probabilities stay in registers.
    """
    q_rows = 1 << max(block_m - 1, 0).bit_length()
    return stages * 2 * block_n * dim * elt + q_rows * dim * elt


MIN_BLOCK_N = 16  # the narrowest KV tile ``fit_tiles`` and ``launch_fitting`` narrow a launch to


def fit_tiles(
    block_m: int, block_n: int, stages: int, dim: int, elt: int, limit: int = SMEM_LIMIT_HOPPER
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages) shrunk until ``tile_smem_bytes`` fits ``limit``.

    Why this order: pipelining depth beyond 2 is a tuning gain, BLOCK_N only sets how many keys one
    iteration covers, while BLOCK_M sets how often the KV is re-read, so it is given up last. fp32
    (4-byte elements, the exactness path) is where the bf16-tuned 128 x 128 tiles overflow.
    """
    while tile_smem_bytes(block_m, block_n, dim, elt, stages) > limit:
        if stages > 2:
            stages -= 1
        elif block_n > 64:
            block_n //= 2
        elif block_m > 64:
            block_m //= 2
        elif block_n > MIN_BLOCK_N:
            block_n //= 2
        elif stages > 1:
            stages -= 1
        elif block_m > 16:
            block_m //= 2
        else:
            break
    return block_m, block_n, stages


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1): ``triton.next_power_of_2`` without importing Triton."""
    return 1 << (n - 1).bit_length()


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q / cache dtypes (the cache q's, or e4m3), shapes and strides; return (Hq, Hkv, D,
    block_size)."""
    kv_ok = k_cache.dtype in (q.dtype, torch.float8_e4m3fn) and v_cache.dtype == k_cache.dtype
    if q.dtype not in _DTYPES or not kv_ok:
        raise TypeError(
            f"q must be one of {_DTYPES} and k_cache, v_cache q's dtype or float8_e4m3fn (an FP8 KV "
            f"cache); got {q.dtype}/{k_cache.dtype}/{v_cache.dtype}"
        )
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("q must be [T, Hq, D]; k_cache and v_cache [num_blocks, block_size, Hkv, D]")
    _, q_heads, dim = q.shape
    _, block_size, kv_heads, kdim = k_cache.shape
    if kdim != dim or q_heads % kv_heads:
        raise ValueError(f"head_dim {dim} vs {kdim}, q_heads {q_heads} must be a multiple of {kv_heads}")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"head_dim {dim} must be a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim")
    if q.device != k_cache.device or q.device != v_cache.device:
        raise ValueError("q and the caches must be on one device")
    if k_cache.dtype == torch.float8_e4m3fn and any(  # read as int32 words (attend.fetch_kv_words)
        t.stride(i) % 4 or t.data_ptr() % 4 for t in (k_cache, v_cache) for i in range(3)
    ):
        raise ValueError("an e4m3 cache needs strides and a start that are multiples of 4 bytes")
    return q_heads, kv_heads, dim, block_size


def _out_of_resources() -> type[Exception]:
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - older Triton
        return RuntimeError
    return OutOfResources


_FALLBACK: dict[tuple[Any, ...], tuple[int, int]] = {}  # (kernel, constexprs) -> (BLOCK_N, stages) that fit


def launch_fitting(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    args_for: Callable[[dict[str, Any]], tuple[Any, ...]] | None = None,
    **kw: Any,
) -> Launch:
    """Launch ``kernel``; if Triton still runs out of shared memory, retry with fewer stages, then a
    narrower BLOCK_N (both keep the result: KV ranges are walked in any tile width).

    ``args_for(kw)``, when given, remakes the arguments for the tiles being tried (TMA descriptors
    carry BLOCK_N in their block shape). Returns the launch that ran, recorded so that later layers
    can ``relaunch`` it cheaply.

    ``fit_tiles`` is a model of Triton's allocator, and this is the safety net for where the model is
    off; the config that fitted is remembered, so the retry costs one failed compile per shape.
    """
    fixed = sorted((k, v) for k, v in kw.items() if k not in ("num_stages", "BLOCK_N"))
    key = (id(kernel), str(args[0].dtype), *fixed)  # args[0] is q: its dtype sets the tile bytes
    if key in _FALLBACK:
        kw["BLOCK_N"], kw["num_stages"] = _FALLBACK[key]
    while True:
        try:
            if args_for is not None:
                args = args_for(kw)
            compiled = kernel[grid](*args, **kw)
            return record(kernel, grid, args, kw, compiled)
        except _out_of_resources():
            if kw["num_stages"] > 1:
                kw["num_stages"] -= 1
            elif kw["BLOCK_N"] > MIN_BLOCK_N:
                kw["BLOCK_N"] //= 2
            else:
                raise
            _FALLBACK[key] = (kw["BLOCK_N"], kw["num_stages"])
