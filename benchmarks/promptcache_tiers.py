"""The Prompt Cache benchmark's measures of the KV tiers themselves: bytes a module token moves, and
the host tier's copy path timed on its own (``benchmarks/promptcache.py`` reports both)."""

from __future__ import annotations

import time

import torch

from prefixserve import LLM


def kv_bytes_per_token(llm: LLM) -> int:
    """Bytes of one token's KV, every layer and head (what a tier moves per module token)."""
    kv = llm.engine.modules.kv
    layers, two, _, _, _, dim = kv.tensor.shape
    return layers * two * kv.total_kv_heads * dim * kv.tensor.element_size()


def host_copy_gbs(llm: LLM, limit: int = 2 << 30) -> float | None:
    """GB/s of the host tier's copy path over the entries now in host memory (up to ``limit`` bytes,
    into free blocks of the pool): ``KVCache.scatter_rows_layered``, a copy per layer, K or V and run
    of blocks straight into them, as a restore makes; timed to the last byte on the device. None off
    CUDA or with no entries."""
    if llm.engine.device.type != "cuda":
        return None
    modules, pool = llm.engine.modules, llm.engine.pool
    kv, bs = modules.kv, pool.block_size
    entries, total = [], 0
    keys = modules.host.keys()  # least recently used first
    for key in keys:
        found = modules.host.get(key)
        if found is None or total >= limit or pool.num_free < -(-found[0].shape[2] // bs):
            break
        entries.append((found[0], pool.allocate(-(-found[0].shape[2] // bs))))
        total += found[0].numel() * found[0].element_size()
    if not entries:
        return None
    try:
        kv.scatter_rows_layered(entries[0][1], entries[0][0])  # warm-up: the copy stream's first use
        kv.settle()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for packed, blocks in entries:
            kv.scatter_rows_layered(blocks, packed)
        kv.settle()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        for _, blocks in entries:
            pool.release(blocks)
    return total / seconds / 1e9


__all__ = ["host_copy_gbs", "kv_bytes_per_token"]
