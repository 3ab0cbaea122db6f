"""Sliding-window layers inside a captured decode graph.

A model mixing sliding and full layers decodes in one graph like any other: the full layers run the
backend's graph attention (``graph_attention.py``), and every sliding layer the window path of the
eager steps (``kernels/window_attention.py``: each row's walk over its window less the keys its kept
shared segments cover, those segments once for their stacked rows, the merge), launched over
fixed-capacity buffers that each step refills from its window plan (``planning/window_plan.py``):
  * each sliding group's window columns of the block table, from block ``base[s]`` on (the freeing KV
    layout's pages, or in the plain layout the block table's columns the window reaches), so a
    table's width is the window's, not the sequence's;
  * each row's skip run, the kept segments' blocks, rows and work items (a group's own blocks and
    items under the freeing layout), and the merge CSR over the bucket's rows;
  * grids by capacity: the walk over the bucket's rows (padding rows have length 0), the shared
    kernel over the work list's capacity (zero items return at once), the merge over the bucket.
A step without kept segments has a graph of its own that walks straight into the output. The first
sliding layer a capture meets records the launches; every other one replays them with its q, K, V
and output and its group's arrays, so one graph holds every group's launches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prefixserve.attention.graph import (
    GraphAttention,
    GraphStep,
    HeadShape,
    WindowedGraphAttention,
    capacity,
    floor_key,
)
from prefixserve.attention.metadata import AttentionMetadata, write_slots
from prefixserve.attention.planning.shared_plan import ITEM_FIELDS, SharedWork
from prefixserve.attention.planning.window_plan import make_window_plan, on_every_group, step_segments
from prefixserve.attention.planning.window_work import window_work

MIN_WIDTH = 16  # window columns a graph holds at least


def window_columns(
    meta: AttentionMetadata, window: int, groups: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray, np.ndarray]:
    """([G, S, K] int32, [S] int64): each sliding group's pages of each sequence's blocks from block
    ``base[s]`` on: the freeing layout's ``groups`` as given, or one group of the block table's
    columns from the first block a decode row's window reaches."""
    if groups is not None:
        return groups
    bs = meta.block_size
    assert meta.seq_lens_np is not None and meta.block_tables_np is not None
    seq_lens, tables = meta.seq_lens_np, meta.block_tables_np
    base = np.maximum(seq_lens - window, 0) // bs
    blocks = -(-seq_lens // bs)
    width = max(int((blocks - base).max(initial=1)), 1)
    columns = base[:, None] + np.arange(width)
    inside = columns < blocks[:, None]
    picked = np.take_along_axis(tables, np.minimum(columns, tables.shape[1] - 1), axis=1)
    return np.where(inside, picked, 0).astype(np.int32)[None], base


def window_graph_step(
    meta: AttentionMetadata,
    full: GraphStep,
    shape: HeadShape,
    bucket: int,
    window: int,
    groups: tuple[np.ndarray, np.ndarray] | None = None,
) -> GraphStep | None:
    """``full`` (the full layers' graph step) with the sliding layers' window work of the same decode
    step; None where this step runs eagerly (Prompt Cache module blocks, whose holes only the torch
    walk skips; sliding groups whose work lists differ). ``groups``: the freeing layout's pages."""
    if meta.has_module_blocks():
        return None
    if full.key[1] != bucket:
        raise ValueError(f"the full layers' graph step is for bucket {full.key[1]}, not {bucket}")
    tables, base = window_columns(meta, window, groups)
    found = step_segments(meta)
    plan = make_window_plan(meta, *found, window) if found is not None else None
    made = None
    if plan is not None:
        if groups is not None:
            plan = on_every_group(plan, list(tables), base)[0]
        heads = (shape.q_heads, shape.kv_heads, shape.head_dim, shape.dtype, shape.device)
        made = window_work(plan, bucket, *heads, meta.block_size, kv_dtype=shape.kv_dtype)
        if made is None:
            return None
    num_groups = tables.shape[0]
    assert meta.seq_lens_np is not None and meta.query_lens_np is not None
    needed: tuple[Any, ...] = ("window", bucket, num_groups, capacity(tables.shape[2], MIN_WIDTH), None)
    needed += (0, 0, 0, 0, 0)
    arrays = {
        "seq_lens": meta.seq_lens_np.astype(np.int32),
        "qsl": np.arange(bucket + 1, dtype=np.int32),
        "base": base.astype(np.int32),
    }
    arrays |= {f"tables{g}": tables[g] for g in range(num_groups)}
    if made is not None:
        work = made.work
        needed = (
            *needed[:4],
            (work.block_m, work.block_n, work.num_stages, work.tma),
            capacity(work.items.shape[0], 16),
            capacity(len(made.seg_block_start) - 1, 4),
            capacity(made.seg_blocks.size, 16),
            capacity(made.seg_rows.size, 16),
            capacity(work.num_slots, 16),
        )
        arrays |= {
            "skip_lo": made.skip_lo,
            "skip_hi": made.skip_hi,
            "block_start": made.seg_block_start,
            "seg_rows": made.seg_rows,
            "row_ptr": made.row_ptr.astype(np.int32),
            "part_idx": made.part_idx.astype(np.int32),
        }
        for g, (blocks, items) in enumerate(made.groups or [(made.seg_blocks, made.items)]):
            arrays |= {f"blocks{g}": blocks, f"items{g}": items}
    arrays = {f"window.{k}": v for k, v in arrays.items()}
    slots = None  # the freeing layout: each sliding group's write slots
    if groups is not None:
        q, s, bs = meta.query_lens_np, meta.seq_lens_np, meta.block_size
        slots = np.stack([write_slots(t, q, s, bs, base) for t in tables])

    def step(full_step: GraphStep, floor: tuple[Any, ...] | None) -> GraphStep:
        key = floor_key(needed, floor, (0, 1, 2, 4))  # bucket, groups, tiles fixed
        return GraphStep(
            ("sliding", bucket, full_step.key, key),
            {**arrays, **{f"full.{k}": v for k, v in full_step.arrays.items()}},
            lambda: SlidingModelGraph(full_step.build(), WindowGraph(key, shape)),
            full_step.stats,
            lambda f: step(full_step.refit(f[2]) if full_step.refit else full_step, f[3]),
            group_slots=slots,
            windowed=True,
        )

    return step(full, None)


class WindowGraph(GraphAttention):
    """The sliding layers' buffers of one key and the launches recorded over them."""

    def __init__(self, key: tuple[Any, ...], shape: HeadShape) -> None:
        _, bucket, num_groups, width, tiles, items, segs, blocks, rows, slots = key
        fields: dict[str, tuple[tuple[int, ...], bool]] = {
            "seq_lens": ((bucket,), True),  # padding rows: length 0, nothing read
            "qsl": ((bucket + 1,), False),
            "base": ((bucket,), True),
        }
        fields |= {f"tables{g}": ((bucket, width), False) for g in range(num_groups)}
        if tiles is not None:
            fields |= {
                "skip_lo": ((bucket,), True),  # 0, 0: no run skipped
                "skip_hi": ((bucket,), True),
                "block_start": ((segs + 1,), False),
                "seg_rows": ((rows,), False),
                "row_ptr": ((bucket + 1,), False),  # every entry written each step
                "part_idx": ((bucket + slots,), False),
            }
            for g in range(num_groups):
                fields |= {f"blocks{g}": ((blocks,), False), f"items{g}": ((items, ITEM_FIELDS), True)}
        super().__init__(fields, shape.device)
        self.bucket, self.tiles, self.slots, self.shape = bucket, tiles, slots, shape
        self.groups = [self._group(g) for g in range(num_groups)]
        self.launches: Any = None  # kernels/window_attention.WindowLaunches, once recorded

    def _group(self, g: int) -> dict[str, Any]:
        """Group ``g``'s arrays, each one tensor object for good (replays find them by identity)."""
        group: dict[str, Any] = {"tables": self.buffer(f"tables{g}")}
        if self.tiles is not None:
            block_m, block_n, stages, tma = self.tiles
            items = self.buffer(f"items{g}")
            work = SharedWork(
                items=items,
                num_slots=self.slots,
                block_m=block_m,
                block_n=block_n,
                num_stages=stages,
                splits=[],
                slot_base=[],
                slot_row_index=torch.zeros(0, dtype=torch.long),
                tma=tma,
            )
            group |= {"blocks": self.buffer(f"blocks{g}"), "items": items, "work": work}
        return group

    def attend(self, q, k_cache, v_cache, group: int, scale: float, window: int) -> torch.Tensor:
        from prefixserve.attention.kernels import window_attention as kernels

        out = torch.empty_like(q)
        arrays = self.groups[group]
        sig = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), scale, window)
        lay = self.launches
        if lay is not None and lay.signature == sig:
            kernels.replay_window_path(lay, (q, k_cache, v_cache, out), arrays)
            return out
        walk = kernels.WalkInputs(
            arrays["tables"], self.buffer("seq_lens"), self.buffer("qsl"), self.buffer("base"), self.bucket, 1
        )
        if self.tiles is None:  # no kept segment: the walk writes the output
            launch = kernels.launch_walk(q, k_cache, v_cache, walk, scale, window, out)
            lay = kernels.WindowLaunches(self.bucket, launches=[(launch, kernels.WALK_OUT, False)])
            lay.group_args = kernels.group_args(lay.launches, arrays)  # the walk's table: its group's
        else:
            f32 = {"dtype": torch.float32, "device": q.device}
            parts = self.bucket + self.slots
            lay = kernels.WindowLaunches(
                self.bucket,
                segments=(None, self.buffer("block_start"), self.buffer("seg_rows"), None),
                skip=(self.buffer("skip_lo"), self.buffer("skip_hi")),
                row_ptr=self.buffer("row_ptr"),
                part_idx=self.buffer("part_idx"),
                o_part=torch.empty(parts, q.shape[1], q.shape[2], **f32),
                lse_part=torch.empty(parts, q.shape[1], **f32),
            )
            kernels.launch_window_path(q, k_cache, v_cache, walk, lay, arrays, scale, window, out)
        lay.signature = sig
        self.launches = lay
        return out

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise TypeError("a sliding layer's graph attention takes its window: window_forward")


class SlidingModelGraph(WindowedGraphAttention):
    """One decode graph's attention for a model with sliding layers: the full layers' graph attention
    and the sliding layers' (``WindowGraph``), loaded together."""

    def __init__(self, full: GraphAttention, window: WindowGraph) -> None:
        super().__init__({}, window.device)
        self.full, self.window = full, window

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        self.full.load({k[5:]: v for k, v in arrays.items() if k.startswith("full.")})
        self.window.load({k[7:]: v for k, v in arrays.items() if k.startswith("window.")})

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.full.forward(q, k_cache, v_cache, meta, scale)

    def window_forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int):
        group = meta.plan if isinstance(meta.plan, int) else 0  # the graph's group views carry their index
        return self.window.attend(q, k_cache, v_cache, group, scale, window)


__all__ = ["SlidingModelGraph", "WindowGraph", "window_columns", "window_graph_step"]
