"""Triton attention for captured decode graphs: the plain paged path and the shared-segment path.

Same kernels as the eager backends (``triton_backend.py``), launched so that a graph can replay them
on any later step (``attention/graph.py`` explains the scheme):
  * grids are sized by capacity: the batch bucket (padding rows have length 0 and write a zero row),
    the work-list capacity (zero items return at once), and a fixed number of KV splits;
  * the paged kernel runs with ``split_size=0``, so each sequence's KV is cut into the grid's splits by
    its own length, read on the device: no length is baked into the graph;
  * shared partials go to slots ``[0, slots_cap)`` and own partials after them at a fixed offset, so
    the merge CSR (refilled each step) can name any slot;
  * a step that ``use_mixed`` takes runs the shared and own tiles as one mixed launch
    (``mixed_gluon.py``), which writes one own partial per row (the step's one own split), then the merge.
The key of a step (``GraphStep.key``) holds every value a graph bakes in: bucket, capacities, tiles,
split counts and, over an e4m3 cache, the paged launch's walk form (``walks_for``). Capacities are
powers of two, so a growing batch re-captures rarely.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prefixserve.attention.graph import GraphAttention, GraphStep, HeadShape, capacity
from prefixserve.attention.kernels import merge, paged_attention, shared_attention
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning import mixed_rule
from prefixserve.attention.planning.e4m3_walks import e4m3_walks
from prefixserve.attention.planning.shared_plan import ITEM_FIELDS, SharedWork
from prefixserve.attention.planning.step_plan import own_pack_rule, plan_step_work
from prefixserve.attention.planning.tiles import num_sms
from prefixserve.attention.step_launch import (
    PAGED_MERGED,
    PAGED_OUT,
    csr_merge,
    launch_mixed_path,
    launch_split_path,
    replay_launches,
)

PAGED_BLOCK_N = 64
MAX_SPLITS = 64
# Block-table columns a graph holds at least (1,024 tokens at block size 16): a decode grows its own
# part by one token a step, and a wider table from the start saves re-captures on the way.
MIN_TABLE_WIDTH = 64


def _splits(max_kv: int, programs: int, shape: HeadShape) -> int:
    """KV splits for ``programs`` (sequence, KV head) programs: a power of two, so keys stay few."""
    splits, _ = paged_attention.choose_split(
        max_kv, programs, shape.device, PAGED_BLOCK_N, kv_dtype=shape.kv_dtype
    )
    return min(MAX_SPLITS, capacity(splits))


def own_splits_for(own_len: int, bucket: int, pack: int, shape: HeadShape) -> int:
    """The own-part KV splits of a shared step of ``bucket`` rows (``pack`` a program) whose longest
    own part is ``own_len`` tokens."""
    return _splits(own_len, -(-bucket // pack) * shape.kv_heads, shape)


def walks_for(max_kv: int, splits: int, rows: int, shape: HeadShape, width: int, block_size: int) -> int:
    """The e4m3 walk form (``e4m3_walks``) of a graph's paged decode launch over ``rows`` rows in
    ``splits`` splits of ``width``-column tables, for a step whose longest row holds ``max_kv``
    tokens: part of the key, since the graph's tables are the bucket's, far wider than most steps'
    walks (a launch would size its walk by them). 1 where the launch walks otherwise (not e4m3, a
    GQA group past 16 rows, block ids read ahead: ``launch_paged``), so those keys stay one a count."""
    if shape.kv_dtype != torch.float8_e4m3fn:  # every step asks: the common case first
        return 1
    ahead = paged_attention.decode_ids_ahead(0, splits, width, block_size, PAGED_BLOCK_N)
    block_m = paged_attention.pick_block_m(shape.group, shape.group)  # a decode row's query tile
    if not paged_attention.fetches_tiles(shape.kv_dtype, block_m, ahead):
        return 1
    split = -(-max(max_kv, 1) // splits)
    run = -(-split // PAGED_BLOCK_N) * PAGED_BLOCK_N  # the kernel's split length (a tile multiple)
    return e4m3_walks(splits, run, rows * shape.kv_heads * splits, num_sms(shape.device))


def _table_width(cols: int, bucket: int, shape: HeadShape) -> int:
    """Block-table columns of a graph of ``bucket`` rows whose step's tables have ``cols``."""
    width = capacity(cols, MIN_TABLE_WIDTH)
    if shape.ceilings is not None:
        width = max(width, shape.ceilings.width(bucket, MIN_TABLE_WIDTH))
    return width


def _block_lengths(context: int, block: int) -> list[int]:
    """Every multiple of ``block`` up to ``context``, and ``context``: the longest rows a step can have."""
    return [min(kv, context) for kv in range(block, context + block, block)]


def paged_choices(bucket: int, context: int, block: int, shape: HeadShape) -> dict[tuple[int, int], int]:
    """Each (split count, walk form) a plain step of ``bucket`` rows can take, with the least longest
    row (a multiple of ``block`` up to ``context``) that takes it: what the start-up plan captures."""
    seen: dict[tuple[int, int], int] = {}
    for kv in _block_lengths(context, block):
        splits = _splits(kv, bucket * shape.kv_heads, shape)
        width = _table_width(-(-kv // block), bucket, shape)
        seen.setdefault((splits, walks_for(kv, splits, bucket, shape, width, block)), kv)
    return seen


def own_choices(
    bucket: int, pack: int, context: int, block: int, shape: HeadShape, width: int
) -> set[tuple[int, int]]:
    """Each (own split count, own walk form) a two-kernel shared step of ``bucket`` rows (``pack`` a
    program, own tables ``width`` columns) can take, own parts up to ``context`` tokens."""
    seen = set()
    for kv in _block_lengths(context, block):
        splits = own_splits_for(kv, bucket, pack, shape)
        seen.add((splits, walks_for(kv, splits, bucket, shape, width, block) if pack == 1 else 1))
    return seen


def paged_graph_step(
    meta: AttentionMetadata, shape: HeadShape, bucket: int, floor: tuple[Any, ...] | None = None
) -> GraphStep:
    """Every sequence's whole KV through the paged kernel (no sharing)."""
    tables = meta.block_tables_np
    if tables is None:
        tables = meta.block_tables.cpu().numpy()
    width = _table_width(tables.shape[1], bucket, shape)
    max_kv = max(meta.seq_lens_host, default=0)
    splits = _splits(max_kv, bucket * shape.kv_heads, shape)
    key = ("paged", bucket, width, splits, walks_for(max_kv, splits, bucket, shape, width, meta.block_size))
    if floor is not None and floor[:2] == key[:2] and floor[2] >= width:
        key = floor  # any split count or walk form serves: each row's KV is cut into the graph's splits
    arrays = {
        "tables": tables,
        "seq_lens": np.asarray(meta.seq_lens_host, dtype=np.int32),
        "qsl": np.arange(bucket + 1, dtype=np.int32),
    }
    logical = float(meta.logical_kv_tokens())
    stats = {"kv_tokens_read": logical, "kv_tokens_logical": logical, "shared_segments": 0.0, "cascade": 0.0}
    return GraphStep(
        key, arrays, lambda: PagedGraph(key, shape), stats, lambda f: paged_graph_step(meta, shape, bucket, f)
    )


def shared_graph_step(
    meta: AttentionMetadata,
    plan: Any,
    shape: HeadShape,
    bucket: int,
    floor: tuple[Any, ...] | None = None,
    tma: bool = True,
) -> GraphStep:
    """Shared segments once (holders' rows stacked), own parts paged, one CSR merge; ``plan`` on the host.
    ``tma=False``: pointer loads even where the segments are contiguous (the step's ``plain`` twin)."""
    kv_heads = shape.kv_heads
    blocks, bs = plan.seg_blocks.numpy(), meta.block_size
    own_tables = plan.own_block_tables.numpy()
    width = capacity(own_tables.shape[1], MIN_TABLE_WIDTH)
    heads = (shape.q_heads, kv_heads, shape.head_dim)
    # mixed: the mixed launch's tiles (mixed_rule.MixedTiles), None: two kernels
    memo = plan.derived  # kept while the plan is carried on to later steps (``DecodePlans``)
    step_rows = (1, meta.num_seqs, None, memo)
    kv = shape.kv_dtype
    args = (plan, blocks, bs, heads, shape.device, shape.dtype, *step_rows)
    work, mixed = plan_step_work(*args, kv_dtype=kv, tma=tma)
    elt = torch.empty(0, dtype=shape.dtype).element_size()
    pack = 1 if mixed else own_pack_rule(plan, bucket, (*heads, elt), bs, shape.device)
    seg_rows = plan.seg_rows.numpy().astype(np.int64)  # a host plan: already the rows, no recompute
    own_lens = np.asarray(plan.own_seq_lens_host, dtype=np.int32)
    own_splits = own_splits_for(int(own_lens.max(initial=0)), bucket, pack, shape)
    if mixed:  # the mixed kernel writes one own partial per row
        own_splits = 1
    caps = (
        capacity(work.items.shape[0], 16),
        capacity(plan.num_segments, 4),
        capacity(plan.seg_blocks.numel(), 16),
        capacity(seg_rows.size, 16),
        capacity(work.num_slots, 16),
    )
    if shape.ceilings is not None:  # the bucket's capacities, whatever the structure
        width = max(width, shape.ceilings.width(bucket, MIN_TABLE_WIDTH))
        ceilings = shape.ceilings.shared(bucket)
        if not mixed:  # a grid of one program per item: padding items are programs, so the list
            ceilings = (caps[0], *ceilings[1:])  # follows the step (the mixed kernel reads a count)
        caps = tuple(max(c, ceiling) for c, ceiling in zip(caps, ceilings, strict=True))
    own_walks = 1  # the own walk's e4m3 form: the packed and mixed kernels walk otherwise
    if pack == 1 and not mixed:
        own_walks = walks_for(int(own_lens.max(initial=0)), own_splits, bucket, shape, width, bs)
    tiles = (work.block_m, work.block_n, work.num_stages, work.tma, pack, mixed, own_walks)
    needed = ("shared", bucket, width, own_splits, tiles, *caps, 0)  # merge entries: known below
    key = _shared_floor(needed, floor)
    own_splits, slots_cap = key[3], key[9]
    batch = meta.num_seqs
    merge_key = ("merge", id(work), bucket, batch, own_splits, slots_cap)
    if merge_key not in memo:
        memo[merge_key] = _merge_index(seg_rows[work.slot_row_index.numpy()], work.num_slots, *merge_key[2:])
    row_ptr, part_idx = memo[merge_key]
    seg_blocks = plan.seg_blocks.numpy()
    # the merge entries: every slot and every row's own splits, so that the bucket's count is fixed too
    nnz = capacity(max(part_idx.size, slots_cap + own_splits * bucket if shape.ceilings else 0), 16)
    if floor is not None and key[:10] == floor[:10]:
        nnz = max(nnz, floor[10])
    key = (*key[:10], nnz)
    arrays = {
        "seg_blocks": seg_blocks,
        "seg_block_start": np.asarray(plan.seg_block_start_host, dtype=np.int32),
        "seg_rows": seg_rows.astype(np.int32),
        "items": work.items.numpy(),
        "count": np.asarray([work.items.shape[0]], dtype=np.int32),
        "own_tables": own_tables,
        "own_seq_lens": own_lens,
        "qsl": np.arange(bucket + 1, dtype=np.int32),
        "row_ptr": row_ptr,
        "part_idx": part_idx,
    }
    stats = {
        "kv_tokens_read": float(plan.kv_tokens_read),
        "kv_tokens_logical": float(meta.logical_kv_tokens()),
        "shared_segments": float(plan.num_segments),
        "cascade": 1.0,
    }
    return GraphStep(
        key,
        arrays,
        lambda: SharedGraph(key, shape),
        stats,
        lambda f: shared_graph_step(meta, plan, shape, bucket, f, tma),
        plain=(lambda: shared_graph_step(meta, plan, shape, bucket, None, False)) if work.tma else None,
    )


def _shared_floor(needed: tuple[Any, ...], floor: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """``needed`` planned into a captured shared key ``floor`` where it can be: the same bucket and
    work tiles (the work list is cut for them), capacities raised to the floor's; the floor's own
    splits and own pack taken whatever they are (each row's own KV is cut into the graph's splits by
    its length, the pack only groups rows per program, and the own walk's form only moves its speed).
    Else ``needed`` unchanged."""
    if floor is None or len(floor) != len(needed) or floor[:2] != needed[:2]:
        return needed
    tiles, floor_tiles = needed[4], floor[4]
    if tiles[:4] != floor_tiles[:4] or tiles[5] != floor_tiles[5]:
        return needed
    caps = tuple(max(k, f) for k, f in zip(needed[5:], floor[5:], strict=True))
    return (*needed[:2], max(needed[2], floor[2]), floor[3], floor_tiles, *caps)


def _merge_index(
    shared_rows: np.ndarray, num_slots: int, bucket: int, batch: int, own_splits: int, slots_cap: int
) -> tuple[np.ndarray, np.ndarray]:
    """(row_ptr [bucket+1], part_idx) int32: the merge CSR over the bucket's rows, each row's shared
    slots (``shared_rows``: the query row of each), then its own splits at a fixed offset."""
    own_rows = np.tile(np.arange(batch, dtype=np.int64), own_splits)
    own_ids = slots_cap + np.repeat(np.arange(own_splits, dtype=np.int64) * bucket, batch) + own_rows
    rows = np.concatenate([shared_rows, own_rows])
    ids = np.concatenate([np.arange(num_slots, dtype=np.int64), own_ids])
    row_ptr, order = merge.csr_by_row(rows, bucket)
    return row_ptr.astype(np.int32), ids[order].astype(np.int32)


class _Recorded(GraphAttention):
    """Launches recorded on the first layer and relaunched with each later layer's q / K / V / out."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], bool]], shape: HeadShape) -> None:
        super().__init__(fields, shape.device)
        self.shape = shape
        self.launches: list[tuple[Any, tuple[int, int, int, int], bool]] = []
        self.signature: tuple[Any, ...] = ()
        self._side: torch.cuda.Stream | None = None

    def side_stream(self) -> torch.cuda.Stream | None:
        """A second stream for the shared kernel: inside a graph, a parallel branch that costs nothing."""
        if self.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        sig = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), q.device, q.dtype, scale)
        if sig != self.signature or not self.launches:
            self.launches = self.first_launch(q, k_cache, v_cache, scale, out)
            self.signature = sig
            return out
        replay_launches(self.launches, (q, k_cache, v_cache, out), self.side_stream())
        return out

    def first_launch(self, q, k_cache, v_cache, scale: float, out: torch.Tensor) -> list:
        raise NotImplementedError


class PagedGraph(_Recorded):
    """The plain paged kernel over a bucket of rows, with a fixed split count (and a merge if > 1)."""

    def __init__(self, key: tuple[Any, ...], shape: HeadShape) -> None:
        _, bucket, width, splits, self.walks = key
        fields = {
            "tables": ((bucket, width), False),
            "seq_lens": ((bucket,), True),  # padding rows: length 0, nothing read
            "qsl": ((bucket + 1,), False),
        }
        super().__init__(fields, shape)
        self.bucket, self.splits = bucket, splits
        self.lse = torch.empty(splits * bucket, shape.q_heads, dtype=torch.float32, device=shape.device)
        self.o_part = shape.partials(splits * bucket, (shape.q_heads, shape.head_dim)) if splits > 1 else None
        # the splits merged by the kernel's last program of each (row, KV head): its counts, the graph's
        self.counts = torch.zeros(bucket * shape.kv_heads, dtype=torch.int32, device=shape.device)

    def first_launch(self, q, k_cache, v_cache, scale: float, out: torch.Tensor) -> list:
        args = (
            q,
            k_cache,
            v_cache,
            self.buffer("tables"),
            self.buffer("seq_lens"),
            self.buffer("qsl"),
            scale,
            1,
        )
        if self.o_part is None:
            launch = paged_attention.launch_paged(
                *args, 1, 0, out, self.lse, 0, 0, PAGED_BLOCK_N, walks=self.walks
            )
            return [(launch, PAGED_OUT, False)]
        heads, dim = self.shape.q_heads, self.shape.head_dim
        b = self.bucket
        parts = (self.splits, 0, self.o_part, self.lse, b * heads * dim, b * heads, PAGED_BLOCK_N)
        merged = (out, None, self.counts)
        launch = paged_attention.launch_paged(*args, *parts, merged=merged, walks=self.walks)
        return [(launch, PAGED_MERGED, False)]


class SharedGraph(_Recorded):
    """Shared-segment kernel (side stream) + own paged kernel + CSR merge, all over fixed capacities;
    or, when the key says mixed, the mixed kernel + CSR merge."""

    def __init__(self, key: tuple[Any, ...], shape: HeadShape) -> None:
        _, bucket, own_width, own_splits, tiles, items, segs, blocks, rows, slots, nnz = key
        fields = {
            "seg_blocks": ((blocks,), False),
            "seg_block_start": ((segs + 1,), False),
            "seg_rows": ((rows,), False),
            "items": ((items, ITEM_FIELDS), True),  # zero items are no-ops
            "count": ((1,), False),  # items in use: the mixed kernel walks only those
            "own_tables": ((bucket, own_width), False),
            "own_seq_lens": ((bucket,), True),
            "qsl": ((bucket + 1,), False),
            "row_ptr": ((bucket + 1,), False),  # every entry written each step
            "part_idx": ((nnz,), False),
        }
        super().__init__(fields, shape)
        self.bucket, self.own_splits, self.slots = bucket, own_splits, slots
        self.block_m, self.block_n, self.stages, self.tma, self.pack, self.mixed, self.own_walks = tiles
        parts = slots + own_splits * bucket
        self.o_part = shape.partials(parts, (shape.q_heads, shape.head_dim))
        self.lse_part = shape.partials(parts, (shape.q_heads,))

    def first_launch(self, q, k_cache, v_cache, scale: float, out: torch.Tensor) -> list:
        work = SharedWork(
            items=self.buffer("items"),
            num_slots=self.slots,
            block_m=self.block_m,
            block_n=self.block_n,
            num_stages=self.stages,
            splits=[],
            slot_base=[],
            slot_row_index=torch.zeros(0, dtype=torch.long),
            tma=self.tma,
        )
        shared_args = (q, k_cache, v_cache, self.buffer("seg_blocks"), self.buffer("seg_block_start"))
        shared_args += (self.buffer("seg_rows"), work, scale, self.o_part, self.lse_part)
        b, heads, dim, s = self.bucket, self.shape.q_heads, self.shape.head_dim, self.slots
        own_args = (
            q,
            k_cache,
            v_cache,
            self.buffer("own_tables"),
            self.buffer("own_seq_lens"),
            self.buffer("qsl"),
        )
        own_args += (
            scale,
            1,
            self.own_splits,
            0,
            self.o_part[s:],
            self.lse_part[s:],
            b * heads * dim,
            b * heads,
        )

        row_ptr, part_idx = self.buffer("row_ptr"), self.buffer("part_idx")
        merge_into = csr_merge(self.o_part, self.lse_part, b, row_ptr, part_idx, out)
        if self.mixed and mixed_rule.eligible(q, k_cache, v_cache, self.block_m, self.block_n):
            # padding rows: own length 0, a zero partial each
            step_lists = tuple(self.buffer(n) for n in ("seg_rows", "items", "own_tables", "own_seq_lens"))
            parts = (self.o_part, self.lse_part, s)
            mixed, count = self.mixed, self.buffer("count")
            return launch_mixed_path(q, k_cache, v_cache, scale, step_lists, parts, merge_into, mixed, count)
        return launch_split_path(
            lambda: shared_attention.launch_shared(*shared_args),
            lambda: paged_attention.launch_paged(
                *own_args, PAGED_BLOCK_N, pack=self.pack, walks=self.own_walks
            ),
            merge_into,
            self.side_stream(),
        )


__all__ = [
    "PagedGraph",
    "SharedGraph",
    "own_splits_for",
    "paged_graph_step",
    "shared_graph_step",
    "walks_for",
]
