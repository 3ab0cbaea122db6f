"""Triton attention backends: "triton" (shared segments + own parts + LSE merge) and "triton_paged".

"triton" runs a step as DESIGN.md's one idea: ``prepare`` plans the shared segments once per step
(``make_plan``); each layer's ``forward`` then launches the shared-segment kernel (holders' rows
stacked, segment KV read once per M-tile) and the paged kernel over each sequence's own part, both
writing fp32 partials into one buffer, and one merge kernel combines every row's partials. With no
segment in the batch it runs the plain paged kernel alone (one launch, plus a split merge for long KV).

"triton_paged" is the same paged kernel over whole block tables, no sharing: the baseline to beat.

This module imports without Triton so that the backends register; the kernels load on first use and
raise ImportError with the fix when Triton is missing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prefixserve.attention.backend import AttentionBackend, register_backend
from prefixserve.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Layout:
    """Per (q_heads, kv_heads, head_dim) launch layout of one step; shared by all layers."""

    own_splits: int
    own_split_size: int
    work: Any = None  # SharedWork, when the step has segments
    num_slots: int = 0  # shared slots + own slots
    row_ptr: torch.Tensor | None = None  # [T+1] int32: CSR over the merged partials
    part_idx: torch.Tensor | None = None  # [nnz] int32
    o_part: torch.Tensor | None = None  # [num_slots, Hq, D] fp32, reused by every layer
    lse_part: torch.Tensor | None = None  # [num_slots, Hq] fp32


@dataclass(slots=True)
class TritonStep:
    """What ``prepare`` leaves in ``meta.plan``: the shared plan (or None) and lazily-built layouts."""

    shared: Any  # SharedPlan | None
    max_query_len: int
    layouts: dict[tuple[int, int, int, str, str], _Layout] = field(default_factory=dict)


def _kernels() -> tuple[Any, Any, Any]:
    from prefixserve.attention.kernels import merge, paged_attention, shared_attention

    return paged_attention, shared_attention, merge


@register_backend
class TritonPagedBackend(AttentionBackend):
    """The paged kernel over every sequence's whole KV (no sharing): GQA-packed, split-KV."""

    name = "triton_paged"

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        meta.plan = TritonStep(shared=None, max_query_len=max(meta.query_lens_host, default=1))

    def _step(self, meta: AttentionMetadata) -> TritonStep:
        if not isinstance(meta.plan, TritonStep):
            self.prepare(meta)
        return meta.plan

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        paged, _, _ = _kernels()
        step = self._step(meta)
        out, _ = paged.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            step.max_query_len,
            max_seq_len=max(meta.seq_lens_host, default=0),
        )
        return out


@register_backend
class TritonBackend(TritonPagedBackend):
    """Shared-segment attention: segments once with stacked holders, own parts paged, LSE merge."""

    name = "triton"
    overlap_streams: bool = True  # run shared and own kernels concurrently on CUDA

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda" or not self.overlap_streams:
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def prepare(self, meta: AttentionMetadata) -> None:
        from prefixserve.attention.plan import make_plan

        plan = make_plan(meta)
        meta.stats["kv_tokens_read"] = float(plan.kv_tokens_read)
        meta.stats["kv_tokens_logical"] = float(meta.logical_kv_tokens())
        meta.stats["shared_segments"] = float(plan.num_segments)
        meta.stats["cascade"] = 1.0 if plan.num_segments else 0.0
        shared = plan if plan.num_segments > 0 else None
        meta.plan = TritonStep(shared=shared, max_query_len=max(meta.query_lens_host, default=1))

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        step = self._step(meta)
        if step.shared is None:
            return super().forward(q, k_cache, v_cache, meta, scale)
        paged, shared_mod, merge = _kernels()
        plan = step.shared
        tokens, q_heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        key = (q_heads, kv_heads, dim, str(q.device), str(q.dtype))
        lay = step.layouts.get(key)
        if lay is None:
            lay = step.layouts[key] = build_layout(meta, step, q_heads, kv_heads, dim, q.device, q.dtype)
        ns = lay.work.num_slots
        shared_args = (q, k_cache, v_cache, plan.seg_blocks, plan.seg_block_start, plan.seg_rows, lay.work)
        # the shared kernel (dense, tensor-core bound at large B) and the own kernel (bandwidth bound)
        # run on two streams so they overlap; under CUDA graphs this becomes two parallel branches
        side = self._side_stream(q.device)
        if side is not None:
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared_mod.launch_shared(*shared_args, scale, lay.o_part, lay.lse_part)
        else:
            shared_mod.launch_shared(*shared_args, scale, lay.o_part, lay.lse_part)
        paged.launch_paged(
            q,
            k_cache,
            v_cache,
            plan.own_block_tables,
            plan.own_seq_lens,
            meta.query_start_loc,
            scale,
            step.max_query_len,
            lay.own_splits,
            lay.own_split_size,
            lay.o_part[ns:],
            lay.lse_part[ns:],
            tokens * q_heads * dim,
            tokens * q_heads,
        )
        if side is not None:
            main.wait_stream(side)
        out = torch.empty_like(q)
        merge.merge_partials(
            lay.o_part,
            lay.lse_part,
            tokens,
            row_ptr=lay.row_ptr,
            part_idx=lay.part_idx,
            out=out,
            want_lse=False,
        )
        return out


def build_layout(
    meta: AttentionMetadata,
    step: TritonStep,
    q_heads: int,
    kv_heads: int,
    dim: int,
    device: torch.device,
    dtype: torch.dtype,
) -> _Layout:
    """Host work, once per step, head shape and dtype: shared work list, own splits, merge CSR, buffers.

    The dtype is part of the layout because the shared tiles are fitted to shared memory by element
    size (fp32 needs narrower tiles than bf16).
    """
    paged, shared_mod, _ = _kernels()
    plan = step.shared
    group = q_heads // kv_heads
    tokens = sum(meta.query_lens_host)
    block_n = 64
    block_m = paged.pick_block_m(step.max_query_len * group, group)
    q_tiles = -(-step.max_query_len // (block_m // group))
    own_splits, own_split_size = paged.choose_split(
        max(plan.own_seq_lens_host, default=0), meta.num_seqs * q_tiles * kv_heads, device, block_n
    )
    bs = meta.block_size
    bstart = plan.seg_block_start_host
    seg_tokens = [(b - a) * bs for a, b in itertools.pairwise(bstart)]
    work = shared_mod.plan_shared_work(
        plan.seg_row_start_host, seg_tokens, kv_heads, group, device, head_dim=dim, dtype=dtype
    )
    ns = work.num_slots
    # merge CSR over the step's T rows: each row's own splits, then its slots in every segment
    seg_rows = plan.seg_rows.cpu().numpy().astype(np.int64)  # [R]
    slot_rows = seg_rows[work.slot_row_index.numpy()]  # [ns] query row of each shared slot
    own_rows = np.tile(np.arange(tokens, dtype=np.int64), own_splits)  # [own_splits * T]
    rows = np.concatenate([slot_rows, own_rows])
    order = np.argsort(rows, kind="stable")
    row_ptr = np.zeros(tokens + 1, dtype=np.int64)
    row_ptr[1:] = np.cumsum(np.bincount(rows, minlength=tokens))
    num_slots = ns + own_splits * tokens
    return _Layout(
        own_splits=own_splits,
        own_split_size=own_split_size,
        work=work,
        num_slots=num_slots,
        row_ptr=torch.from_numpy(row_ptr.astype(np.int32)).to(device),
        part_idx=torch.from_numpy(order.astype(np.int32)).to(device),
        o_part=torch.empty(num_slots, q_heads, dim, dtype=torch.float32, device=device),
        lse_part=torch.empty(num_slots, q_heads, dtype=torch.float32, device=device),
    )


__all__ = ["TritonBackend", "TritonPagedBackend", "TritonStep"]
