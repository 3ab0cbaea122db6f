"""Shared helpers of the kernel tests (conftest.py has set TRITON_INTERPRET where needed)."""

from __future__ import annotations

import math

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def paged_cache(
    seq_lens: list[int],
    block_size: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare: int = 3,
    device: torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random K/V caches and shuffled block tables (one table per sequence, no block reused)."""
    need = sum(math.ceil(s / block_size) for s in seq_lens) + spare
    k = torch.randn(need, block_size, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(need, block_size, kv_heads, dim, generator=gen).to(device, dtype)
    perm = torch.randperm(need, generator=gen).tolist()
    tables, at = [], 0
    for s in seq_lens:
        n = math.ceil(s / block_size)
        tables.append(perm[at : at + n])
        at += n
    return k, v, tables


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; NaN (an unwritten, poisoned row) fails every comparison."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))
