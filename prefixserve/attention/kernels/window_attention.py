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
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixserve.attention.kernels.attend import attend_range, attend_two_runs, finish_rows, widened_q
from prefixserve.attention.kernels.shared_attention import launch_shared
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.shared_plan import ITEM_FIELDS
from prefixserve.attention.planning.step_plan import to_device_packed
from prefixserve.attention.planning.tiles import (
    LOG2E,
    check_cache,
    dot_precision,
    interpreter_upcast,
    next_power_of_2,
)
from prefixserve.attention.planning.window_work import window_work
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
        q = widened_q(q, k_ptr)
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
        if SKIP:  # both sides of the shared run in one pipelined loop (7% faster than two loops)
            m_i, l_i, acc = attend_two_runs(
                q, m_i, l_i, acc, k_base, v_base, table, kv_lo, first_stop, tl.maximum(first_stop, skip_hi),
                kv_hi, hi, lo, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE,
                HEAD_DIM, DOT_PREC, UPCAST,
            )  # fmt: skip
        else:
            m_i, l_i, acc = attend_range(
                q, m_i, l_i, acc, k_base, v_base, table, kv_lo, kv_hi, hi, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST,
                lower=lo, WINDOWED=True,
            )  # fmt: skip
        o, lse = finish_rows(m_i, l_i, acc)
        o_rows = o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_rows, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        if SKIP:
            tl.store(lse_ptr + tok * stride_lt + head, lse, mask=row_ok)


_bound = BoundKernel(_window_kernel)  # every sliding layer of a step: Triton's launch cost paid once


@dataclass(slots=True)
class WalkInputs:
    """What the window walk reads of a step besides q, K and V (the step's metadata eagerly, a decode
    graph's buffers in one)."""

    tables: torch.Tensor  # [S, K] int32: block ids (from column ``table_base[s]`` on, if given)
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    table_base: torch.Tensor | None  # [S] int32, or None: column c is block c
    num_seqs: int
    longest_query: int


def walk_inputs(meta: AttentionMetadata) -> WalkInputs:
    q_lens = meta.query_lens_np if meta.query_lens_np is not None else meta.query_lens_host
    return WalkInputs(
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.table_base,
        meta.num_seqs,
        int(max(q_lens)),
    )


def _launch_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    walk: WalkInputs,
    scale: float,
    window: int,
    skip: tuple[torch.Tensor, torch.Tensor] | None,
    out: tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[tuple[int, int], tuple, dict]:
    """The window kernel's grid, arguments and constexprs (q, k_cache, v_cache at 0-2, o at 3)."""
    q_heads, kv_heads, dim, block_size = check_cache(q, k_cache, v_cache)
    group = q_heads // kv_heads
    longest = walk.longest_query
    block_m = max(16, next_power_of_2(group * min(longest, max(1, 64 // group))))
    # K and V tiles of BLOCK_N x head_dim: wide heads (Gemma's 256) take half the keys a tile
    block_n = 32 if q.element_size() == 4 or dim > 128 else 64
    warps, stages = 4, 2  # two stages: the walks are short, a third buffer only waits
    if longest == 1 and dim > 128 and q.element_size() == 2:
        # a decode walk of wide heads: 16-key tiles on two warps, three stages, 84 us against 100 us
        # at 32 keys on four warps (Gemma-3-12B's sliding layer at B=256 beside a 16K shared prefix,
        # H200; benchmarks/probes/window_tiles.py): four warps held 182 registers a thread, two
        # programs an SM
        block_n, warps, stages = 16, 2, 3
    q_tiles = -(-longest // max(1, block_m // group))
    o, lse = out
    tables = walk.tables
    skip_lo, skip_hi = skip if skip is not None else (walk.seq_lens, walk.seq_lens)
    base = walk.table_base if walk.table_base is not None else walk.seq_lens
    args = (
        q, k_cache, v_cache, o, lse if lse is not None else o, tables, walk.seq_lens, walk.query_start_loc,
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
        "BASE": walk.table_base is not None,
        "num_warps": warps,
        "num_stages": stages,
    }
    return (walk.num_seqs * q_tiles, kv_heads), args, kw


WALK_OUT = (0, 1, 2, 3)  # the walk's q, K, V and output argument positions (a layer's own)


def launch_walk(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, walk: WalkInputs, scale: float,
    window: int, out: torch.Tensor,
) -> Launch:  # fmt: skip
    """Every row's walk over its whole window, straight into ``out``; recorded for relaunches."""
    grid, args, kw = _launch_args(q, k_cache, v_cache, walk, scale, window, None, (out, None))
    return record(_window_kernel, grid, args, kw, _window_kernel[grid](*args, **kw))


def window_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    with_lse: bool = False,
) -> Any:  # [T, Hq, D]; with_lse: (o [T, Hq, D] fp32, lse [T, Hq])
    """Attention of every query row within its window (``attention/window.py`` says the rule); with
    ``with_lse`` (attention sinks) the walk writes fp32 rows and their LSE, skipping nothing (an empty
    skip run at each sequence's end)."""
    walk = walk_inputs(meta)
    if with_lse:
        o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        skip = (walk.seq_lens, walk.seq_lens)
        grid, args, kw = _launch_args(q, k_cache, v_cache, walk, scale, window, skip, (o, lse))
        _window_kernel[grid](*args, **kw)
        return o, lse
    out = torch.empty_like(q)
    grid, args, kw = _launch_args(q, k_cache, v_cache, walk, scale, window, None, (out, None))
    _bound(grid, *args, **kw)
    return out


@dataclass(slots=True)
class WindowLaunches:
    """A step's lists and partials on the device for one window plan, and the launches recorded over
    them: the walk, the shared kernel and the merge (made by the step's first sliding layer, replayed
    by the others; in a decode graph, made once per captured key). A walk alone (no kept segment)
    has no lists or partials."""

    slots_at: int  # walk slots before the shared kernel's: the merge's rows
    segments: tuple[Any, ...] = ()  # (blocks, starts, rows, work); a group's blocks and work replace 0, 3
    skip: tuple[torch.Tensor, torch.Tensor] | None = None  # [rows] int32 each
    row_ptr: torch.Tensor | None = None
    part_idx: torch.Tensor | None = None
    o_part: torch.Tensor | None = None  # [slots_at + shared slots, Hq, D] fp32
    lse_part: torch.Tensor | None = None
    out_lse: torch.Tensor | None = None  # [T, Hq] fp32: each row's LSE (attention sinks)
    # per sliding group under the freeing KV layout: its "tables", "blocks", "items" and "work"
    groups: list[dict[str, Any]] | None = None
    launches: list[Any] = field(default_factory=list)
    group_args: list[list[tuple[int, str]]] = field(default_factory=list)
    signature: tuple[Any, ...] = ()


GROUP_ARRAYS = ("tables", "blocks", "items")  # what differs between the sliding groups' launches
SOLO = "solo"


def launch_window_path(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, walk: WalkInputs, lay: WindowLaunches,
    group: dict[str, Any] | None, scale: float, window: int, out: torch.Tensor,
) -> None:  # fmt: skip
    """Launch the walk (skipping each row's shared run), the shared kernel and the merge through
    Triton's normal path, and record them in ``lay`` with where each holds a group's arrays."""
    o_part, lse_part, at = lay.o_part, lay.lse_part, lay.slots_at
    segments = lay.segments if group is None else (group["blocks"], *lay.segments[1:3], group["work"])
    if group is not None:
        walk = dataclasses.replace(walk, tables=group["tables"])

    def walk_launch() -> Launch:
        grid, args, kw = _launch_args(q, k_cache, v_cache, walk, scale, window, lay.skip, (o_part, lse_part))
        return record(_window_kernel, grid, args, kw, _window_kernel[grid](*args, **kw))

    def shared() -> Launch | None:
        return launch_shared(q, k_cache, v_cache, *segments, scale, o_part[at:], lse_part[at:])

    merge = csr_merge(o_part, lse_part, at, lay.row_ptr, lay.part_idx, out, lay.out_lse)
    lay.launches = launch_split_path(shared, walk_launch, merge, None)
    lay.group_args = group_args(lay.launches, group) if group is not None else []


def group_args(launches: list[Any], group: dict[str, Any]) -> list[list[tuple[int, str]]]:
    """Where each recorded launch holds ``group``'s arrays (by identity): the arguments a replay for
    another sliding group swaps for its own."""
    mine = {id(group[name]): name for name in GROUP_ARRAYS if name in group}
    return [
        [(i, mine[id(a)]) for i, a in enumerate(launch.args) if id(a) in mine] for launch, _, _ in launches
    ]


def replay_window_path(lay: WindowLaunches, tensors: tuple[torch.Tensor, ...], group: dict | None) -> None:
    """Replay the recorded launches with this layer's (q, K, V, out) and, for a sliding group, its
    group's tables, segment blocks and work items."""
    if group is None:
        replay_launches(lay.launches, tensors, None)
        return
    for (launch, pos, _), swaps in zip(lay.launches, lay.group_args, strict=True):
        mine = [(i, t) for i, t in zip(pos, tensors, strict=True) if i >= 0]
        relaunch(launch, mine + [(i, group[name]) for i, name in swaps])


def window_shared_attention(
    q: torch.Tensor,  # [T, Hq, D]: a decode step's rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: object,  # window_plan.WindowPlan
    scale: float,
    window: int,
    with_lse: bool = False,
) -> Any:  # [T, Hq, D]; with_lse: (it, each row's LSE [T, Hq] fp32, the step's buffer)
    """A decode step of a sliding layer: the plan's segments once for their stacked rows (the shared
    kernel), each row's walk over the rest of its window (fp32 partials with their LSE), merged by
    LSE. The step's first sliding layer launches through Triton and records; the others relaunch the
    records with their own q, K, V and output (``step_launch.replay_launches``), as the full layers'
    shared path does."""
    tokens, q_heads, dim = q.shape
    key = (q_heads, k_cache.shape[2], dim, q.dtype, q.device, with_lse)
    lay = plan.derived.get(key)
    if lay is SOLO:  # the groups' work lists differ: each group plans alone
        key = (key, plan.group)
        lay = plan.derived.get(key)
    if lay is None:
        lay = _layout(q, k_cache, plan, family=True)
        if lay is None:
            plan.derived[key] = SOLO
            key = (key, plan.group)
            lay = _layout(q, k_cache, plan, family=False)
        if with_lse:
            lay.out_lse = torch.empty(tokens, q_heads, dtype=torch.float32, device=q.device)
        plan.derived[key] = lay
    group = lay.groups[plan.group] if lay.groups is not None else None
    if group is not None:  # a sliding group under the freeing KV layout: its own pages' arrays
        group.setdefault("tables", meta.block_tables)
    out = torch.empty_like(q)
    sig = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), scale, window)
    if lay.signature == sig:
        replay_window_path(lay, (q, k_cache, v_cache, out), group)
    else:
        launch_window_path(q, k_cache, v_cache, walk_inputs(meta), lay, group, scale, window, out)
        lay.signature = sig
    return (out, lay.out_lse) if with_lse else out


def _layout(q: torch.Tensor, k_cache: torch.Tensor, plan: object, family: bool) -> WindowLaunches | None:
    """A step's launch layout of one plan (made by its first sliding layer, used by every one), with
    every int array on the device in one asynchronous copy (a blocking copy would wait for the step
    in flight, where launch-ahead has the host a step ahead); None where ``family`` and the groups
    must plan alone (``window_work``)."""
    tokens, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    heads = (q_heads, kv_heads, dim, q.dtype, q.device)
    made = window_work(plan, tokens, *heads, k_cache.shape[1], family, k_cache.dtype)
    if made is None:
        return None
    host = [made.seg_blocks, made.seg_block_start, made.seg_rows, made.skip_lo, made.skip_hi]
    host += [made.items, made.row_ptr, made.part_idx]
    for blocks_g, items_g in made.groups or ():
        host += [blocks_g, items_g]
    moved = to_device_packed(host, q.device)
    blocks, block_start, rows, skip_lo, skip_hi, items, row_ptr, part_idx = moved[:8]
    work = dataclasses.replace(made.work, items=items.view(-1, ITEM_FIELDS))
    groups = None
    if made.groups is not None:
        groups = []
        for b, i in zip(moved[8::2], moved[9::2], strict=True):
            mine = dataclasses.replace(work, items=i.view(-1, ITEM_FIELDS))
            groups.append({"blocks": b, "items": mine.items, "work": mine})
    slots = tokens + work.num_slots
    f32 = {"dtype": torch.float32, "device": q.device}
    return WindowLaunches(
        segments=(blocks, block_start, rows, work),
        skip=(skip_lo, skip_hi),
        row_ptr=row_ptr,
        part_idx=part_idx,
        o_part=torch.empty(slots, q_heads, dim, **f32),
        lse_part=torch.empty(slots, q_heads, **f32),
        slots_at=tokens,
        groups=groups,
    )
