"""Sliding-window attention over the paged cache: every row of a step (decode, prefill chunk, mixed) in
one launch, each query reading only the keys its window covers; and a decode step's shared segments
inside the windows read once (``planning/window_plan.py``).

One program owns (sequence, query tile, KV head), with the tile's rows packed as the paged kernel
packs them (``BLOCK_M // G`` query tokens x the G query heads of one KV head, so each K/V tile is read
once for the group). Row i sees keys ``i - window < j <= i``: the program walks keys from the window
start of its first row to its last row, so a sequence's blocks wholly behind the window are never read
and one program reads at most ``window + BLOCK_M // G`` keys, however long the sequence. No KV splits:
the walk is bounded by the window, not by the sequence. With a skip run per sequence (the keys its
shared segments cover) the walk steps over it and writes fp32 partials with their LSE, which the merge
kernel folds with the shared kernel's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from prefixserve.attention.kernels.attend import attend_range, finish_rows
from prefixserve.attention.kernels.shared_attention import launch_shared
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.shared_plan import ITEM_FIELDS, plan_shared_work
from prefixserve.attention.planning.step_plan import to_device_packed
from prefixserve.attention.planning.tiles import (
    LOG2E,
    check_cache,
    dot_precision,
    interpreter_upcast,
    next_power_of_2,
)
from prefixserve.attention.step_launch import csr_merge, launch_split_path, replay_launches
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel
from prefixserve.triton_support.launch import Launch, record, relaunch

triton, tl = require_triton()


@triton.jit(do_not_specialize=["q_tiles", "window", "stride_bt"])
def _window_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    o_ptr,  # [T, Hq, D] (the partials' fp32 with SKIP)
    lse_ptr,  # [T, Hq] fp32 (SKIP only)
    bt_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    qsl_ptr,  # [S+1] int32
    skip_lo_ptr,  # [S] int32 (SKIP only): keys [skip_lo, skip_hi) are not walked
    skip_hi_ptr,
    base_ptr,  # [S] int32 (BASE only): row s of the table starts at block base[s] (a sliding group's)
    qk_scale,  # softmax scale * log2(e)
    q_tiles,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_lt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    SKIP: tl.constexpr,
    BASE: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = pid // q_tiles
    q0 = (pid % q_tiles) * (BLOCK_M // GROUP)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q0 < q_len:
        ctx = tl.load(seq_lens_ptr + seq) - q_len  # keys before this step's first query
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        qi = q0 + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < (BLOCK_M // GROUP) * GROUP) & (qi < q_len)
        tok = (q_start + qi).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        hi = ctx + qi + 1  # [BLOCK_M]: row m sees keys lo[m] <= n < hi[m]
        lo = hi - window
        kv_hi = ctx + tl.minimum(q0 + BLOCK_M // GROUP, q_len)
        kv_lo = tl.maximum(ctx + q0 + 1 - window, 0)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        table = bt_ptr + seq.to(tl.int64) * stride_bt
        if BASE:  # read only at blocks >= base: every block a row's window reaches
            table -= tl.load(base_ptr + seq).to(tl.int64)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        first_stop = kv_hi
        if SKIP:
            skip_lo = tl.load(skip_lo_ptr + seq)
            skip_hi = tl.load(skip_hi_ptr + seq)
            first_stop = tl.where(skip_hi > skip_lo, tl.minimum(kv_hi, skip_lo), kv_hi)
        m_i, l_i, acc = attend_range(
            q, m_i, l_i, acc, k_base, v_base, table, kv_lo, first_stop, hi, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST,
            lower=lo, WINDOWED=True,
        )  # fmt: skip
        if SKIP:  # the keys after the run the shared segments cover
            m_i, l_i, acc = attend_range(
                q, m_i, l_i, acc, k_base, v_base, table, tl.maximum(first_stop, skip_hi), kv_hi, hi,
                qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                DOT_PREC, UPCAST, lower=lo, WINDOWED=True,
            )  # fmt: skip
        o, lse = finish_rows(m_i, l_i, acc)
        o_rows = o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_rows, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        if SKIP:
            tl.store(lse_ptr + tok * stride_lt + head, lse, mask=row_ok)


_bound = BoundKernel(_window_kernel)  # every sliding layer of a step: Triton's launch cost paid once


def _launch_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    skip: tuple[torch.Tensor, torch.Tensor] | None,
    out: tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[tuple[int, int], tuple, dict]:
    """The window kernel's grid, arguments and constexprs (q, k_cache, v_cache at 0-2, o at 3)."""
    q_heads, kv_heads, dim, block_size = check_cache(q, k_cache, v_cache)
    group = q_heads // kv_heads
    q_lens = meta.query_lens_np if meta.query_lens_np is not None else meta.query_lens_host
    longest = int(max(q_lens))
    block_m = max(16, next_power_of_2(group * min(longest, max(1, 64 // group))))
    # K and V tiles of BLOCK_N x head_dim: wide heads (Gemma's 256) take half the keys a tile
    block_n = 32 if q.element_size() == 4 or dim > 128 else 64
    q_tiles = -(-longest // max(1, block_m // group))
    o, lse = out
    tables = meta.block_tables
    skip_lo, skip_hi = skip if skip is not None else (meta.seq_lens, meta.seq_lens)
    base = meta.table_base if meta.table_base is not None else meta.seq_lens
    args = (
        q, k_cache, v_cache, o, lse if lse is not None else o, tables, meta.seq_lens, meta.query_start_loc,
        skip_lo, skip_hi, base, scale * LOG2E, q_tiles, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        o.stride(0), o.stride(1), lse.stride(0) if lse is not None else 0,
    )  # fmt: skip
    kw = {
        "GROUP": group,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "HEAD_DIM": dim,
        "BLOCK_SIZE": block_size,
        "DOT_PREC": dot_precision(q.dtype),
        "UPCAST": interpreter_upcast(q.dtype),
        "SKIP": skip is not None,
        "BASE": meta.table_base is not None,
        # two stages: 95 us against 112 us at three (a decode walk of Gemma-3-12B's shape, B=256,
        # H200; benchmarks/probes/window_tiles.py): the walks are short, a third buffer only waits
        "num_stages": 2,
    }
    return (meta.num_seqs * q_tiles, kv_heads), args, kw


def window_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of every query row within its window (``attention/window.py`` says the rule)."""
    out = torch.empty_like(q)
    grid, args, kw = _launch_args(q, k_cache, v_cache, meta, scale, window, None, (out, None))
    _bound(grid, *args, **kw)
    return out


def window_shared_attention(
    q: torch.Tensor,  # [T, Hq, D]: a decode step's rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: object,  # window_plan.WindowPlan
    scale: float,
    window: int,
) -> torch.Tensor:  # [T, Hq, D]
    """A decode step of a sliding layer: the plan's segments once for their stacked rows (the shared
    kernel), each row's walk over the rest of its window (fp32 partials with their LSE), merged by
    LSE. The step's first sliding layer launches through Triton and records; the others relaunch the
    records with their own q, K, V and output (``step_launch.replay_launches``), as the full layers'
    shared path does."""
    tokens, q_heads, dim = q.shape
    key = (q_heads, k_cache.shape[2], dim, q.dtype, q.device)
    lay = plan.derived.get(key)
    if lay is SOLO:  # the groups' work lists differ: each group plans alone
        key = (key, plan.group)
        lay = plan.derived.get(key)
    if lay is None:
        lay = _layout(q, k_cache, plan)
        if plan.groups and lay["groups"] is None:
            plan.derived[key] = SOLO
            key = (key, plan.group)
        plan.derived[key] = lay
    group = lay["groups"][plan.group] if lay["groups"] is not None else None
    if group is not None:  # a sliding group under the freeing KV layout: its own pages' arrays
        group.setdefault("tables", meta.block_tables)
    out = torch.empty_like(q)
    sig = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), scale, window)
    if lay.get("signature") == sig:
        _replay(lay, (q, k_cache, v_cache, out), group)
        return out
    o_part, lse_part = lay["o_part"], lay["lse_part"]
    segments = lay["segments"] if group is None else (group["blocks"], *lay["segments"][1:3], group["work"])

    def walk() -> Launch:
        grid, args, kw = _launch_args(
            q, k_cache, v_cache, meta, scale, window, lay["skip"], (o_part, lse_part)
        )
        return record(_window_kernel, grid, args, kw, _window_kernel[grid](*args, **kw))

    def shared() -> Launch | None:
        return launch_shared(q, k_cache, v_cache, *segments, scale, o_part[tokens:], lse_part[tokens:])

    merge = csr_merge(o_part, lse_part, tokens, lay["row_ptr"], lay["part_idx"], out)
    lay["launches"] = launch_split_path(shared, walk, merge, None)
    lay["signature"] = sig
    if group is not None:  # where each launch holds this group's arrays: swapped per group later
        mine = {id(group[name]): name for name in GROUP_ARRAYS}
        lay["group_args"] = [
            [(i, mine[id(a)]) for i, a in enumerate(launch.args) if id(a) in mine]
            for launch, _, _ in lay["launches"]
        ]
    return out


GROUP_ARRAYS = ("tables", "blocks", "items")  # what differs between the sliding groups' launches
SOLO = "solo"


def _replay(lay: dict, tensors: tuple[torch.Tensor, ...], group: dict | None) -> None:
    """Replay the step's recorded launches with this layer's tensors and, for a sliding group, its
    group's tables, segment blocks and work items."""
    if group is None:
        replay_launches(lay["launches"], tensors, None)
        return
    for (launch, pos, _), swaps in zip(lay["launches"], lay["group_args"], strict=True):
        mine = [(i, t) for i, t in zip(pos, tensors, strict=True) if i >= 0]
        relaunch(launch, mine + [(i, group[name]) for i, name in swaps])


def _layout(q: torch.Tensor, k_cache: torch.Tensor, plan: object) -> dict[str, object]:
    """A step's launch layout of one plan (made by its first sliding layer, used by every one): the
    shared kernel's work list, the merge CSR (row t's walk in slot t, the shared kernel's slots after),
    the partials' buffers, and every int array on the device in one asynchronous copy (a blocking copy
    would wait for the step in flight, where launch-ahead has the host a step ahead)."""
    tokens, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    work = plan_shared_work(
        plan.seg_row_start,
        plan.seg_num_tokens,
        kv_heads,
        q_heads // kv_heads,
        q.device,
        head_dim=dim,
        dtype=q.dtype,
        items_on_host=True,
        seg_blocks=plan.seg_blocks,
        seg_block_start=plan.seg_block_start,
        block_size=k_cache.shape[1],
    )
    owner = plan.seg_rows[work.slot_row_index.numpy()].astype(np.int64)
    parts = np.concatenate([np.arange(tokens), owner])
    row_ptr = np.zeros(tokens + 1, dtype=np.int64)
    np.cumsum(np.bincount(parts, minlength=tokens), out=row_ptr[1:])
    host = [plan.seg_blocks, np.asarray(plan.seg_block_start), plan.seg_rows, plan.skip_lo, plan.skip_hi]
    host += [work.items.numpy(), row_ptr, np.argsort(parts, kind="stable")]
    family = _group_items(plan, work, k_cache.shape[1]) if plan.groups else None
    for blocks_g, items_g in family or ():
        host += [blocks_g, items_g]
    moved = to_device_packed(host, q.device)
    blocks, block_start, rows, skip_lo, skip_hi, items, row_ptr_d, part_idx = moved[:8]
    work = dataclasses.replace(work, items=items.view(-1, ITEM_FIELDS))
    groups = None
    if family is not None:
        groups = []
        for b, i in zip(moved[8::2], moved[9::2], strict=True):
            mine = dataclasses.replace(work, items=i.view(-1, ITEM_FIELDS))
            groups.append({"blocks": b, "items": mine.items, "work": mine})
    f32 = {"dtype": torch.float32, "device": q.device}
    return {
        "segments": (blocks, block_start, rows, work),
        "skip": (skip_lo, skip_hi),
        "row_ptr": row_ptr_d,
        "part_idx": part_idx,
        "o_part": torch.empty(tokens + work.num_slots, q_heads, dim, **f32),
        "lse_part": torch.empty(tokens + work.num_slots, q_heads, **f32),
        "groups": groups,
    }


def _group_items(plan: object, work: object, block_size: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Each sliding group's segment blocks and work items (the items name the first cache row of a
    contiguous segment, which is the group's own), or None where a group's segments break into runs
    where another's do not (its work list would differ: each group then plans alone)."""
    from prefixserve.attention.planning.shared_plan import contiguous_first_rows

    items = work.items.numpy()
    firsts = [contiguous_first_rows(p.seg_blocks, p.seg_block_start, block_size) for p in plan.groups]
    if any(((f >= 0) != (firsts[0] >= 0)).any() for f in firsts):
        return None
    out = []
    for p, first in zip(plan.groups, firsts, strict=True):
        mine = items.copy()
        row = first[mine[:, 0]]
        mine[:, 6] = np.where((row >= 0) & (mine[:, 6] >= 0), row + mine[:, 3], -1)
        out.append((p.seg_blocks, mine))
    return out
