"""FlashInfer's side of ``peers_gpu.py``: its batch decode and multi-level cascade over our pages.

Used as a server would: each wrapper made with ``use_cuda_graph=True`` and fixed device buffers, planned
once outside the timing (the host plan is timed on its own), and its ``run`` captured in a CUDA graph.
K and V are our two caches, ``[pages, 16, Hkv, D]`` each: FlashInfer's "NHD" layout as a (K, V) tuple.
FlashInfer (``flashinfer-python`` 0.7.2) comes from the slim copy ``peers_gpu_wheel.py`` made; it is a
benchmark-only dependency, never imported by the engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.attention_grid import BS
from benchmarks.peers_gpu_batch import Batch, Csr

WORKSPACE_BYTES = 512 << 20  # FlashInfer asks for 128 MB; more never slows it (split-KV partials)
_workspace: dict[str, torch.Tensor] = {}


def load(fi_dir: Path) -> Any:
    """``flashinfer`` from the carried slim copy (unpacked into /tmp once), or the installed one."""
    from benchmarks.peers_gpu_wheel import TARBALL, install

    if (fi_dir / TARBALL).exists():
        install(fi_dir)
    import flashinfer

    return flashinfer


def workspace(device: torch.device) -> torch.Tensor:
    """One float workspace for every wrapper (their runs never overlap)."""
    key = str(device)
    if key not in _workspace:
        _workspace[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspace[key]


def _dev(csr: Csr, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The fixed device buffers a CUDA-graph wrapper is made with."""
    return tuple(x.to(device) for x in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.last_page_len))


def decode(fi: Any, batch: Batch, tensor_cores: bool) -> tuple[Any, float]:
    """(run closure, host plan ms): ``BatchDecodeWithPagedKVCacheWrapper`` over every whole table
    (shared pages listed in each sequence's table); ``tensor_cores`` picks its prefill-kernel decode,
    which FlashInfer recommends for grouped-query heads."""
    q, hq, hkv, d = batch.q, *batch.heads
    _, indptr, indices, last = _dev(batch.whole, q.device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace(q.device),
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last,
    )
    w = batch.whole
    t0 = time.perf_counter()
    wrapper.plan(
        w.kv_indptr,
        w.kv_indices,
        w.last_page_len,
        hq,
        hkv,
        d,
        BS,
        q_data_type=q.dtype,
        kv_data_type=batch.k_cache.dtype,
        sm_scale=batch.scale,
    )
    plan_ms = (time.perf_counter() - t0) * 1e3
    out = torch.empty_like(q)
    kv = (batch.k_cache, batch.v_cache)
    return (lambda: wrapper.run(q, kv, out=out)), plan_ms


def cascade(fi: Any, batch: Batch) -> tuple[Any, float]:
    """(run closure, host plan ms): ``MultiLevelCascadeAttentionWrapper`` with one level a tree level
    (its batch prefill per level, then its state merge)."""
    q, hq, hkv, d = batch.q, *batch.heads
    bufs = [_dev(lv, q.device) for lv in batch.levels]
    wrapper = fi.MultiLevelCascadeAttentionWrapper(
        len(batch.levels),
        workspace(q.device),
        "NHD",
        use_cuda_graph=True,
        qo_indptr_buf_arr=[b[0] for b in bufs],
        paged_kv_indptr_buf_arr=[b[1] for b in bufs],
        paged_kv_indices_buf_arr=[b[2] for b in bufs],
        paged_kv_last_page_len_buf_arr=[b[3] for b in bufs],
    )
    lv = batch.levels
    t0 = time.perf_counter()
    wrapper.plan(
        [x.qo_indptr for x in lv],
        [x.kv_indptr for x in lv],
        [x.kv_indices for x in lv],
        [x.last_page_len for x in lv],
        hq,
        hkv,
        d,
        BS,
        causal=False,
        sm_scale=batch.scale,
        q_data_type=q.dtype,
        kv_data_type=batch.k_cache.dtype,
    )
    plan_ms = (time.perf_counter() - t0) * 1e3
    kv = (batch.k_cache, batch.v_cache)
    return (lambda: wrapper.run(q, kv)), plan_ms
