"""Shared segments of a sliding-window layer's decode step: the parts of the step's segments that lie
wholly inside their holders' windows, read once for all of them.

A decode row of sequence s (length L) sees keys ``[lo, L)`` with ``lo = max(0, L - window)``. Of the
step's shared segments (``plan.SharedPlan``, made for the full-attention layers), a segment at keys
``[a, b)`` of holder s is skipped for s where it lies wholly behind s's window (``b <= lo``); else its
whole blocks from the latest window start among its holders on (all of it, where it lies inside every
window) are attended once with the holders' rows stacked, as in a full layer, and the keys before
them that a row still sees are left to that row's walk, which masks what lies behind its window. A
long shared prefix thus costs a sliding layer its last window's keys once, not once per sequence.
Each sequence then walks ``[lo, L)`` less the one run of keys its kept segments cover (``skip_lo``,
``skip_hi``; kept segments must form one run, the usual case of a prefix tree; a segment that would
break the run is left to the walk), and the parts are merged by their log-sum-exps.

Host work, once per step and window (numpy, no Python loop over sequences); prefill and mixed steps
take the per-row window walk alone (``window.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.plan import SharedPlan


@dataclass(slots=True)
class WindowPlan:
    """One decode step's shared work for one window. Segment g of this plan covers
    ``seg_blocks[seg_block_start[g]:seg_block_start[g+1]]`` and is attended by query rows
    ``seg_rows[seg_row_start[g]:seg_row_start[g+1]]``; row s also walks its window less
    ``[skip_lo[s], skip_hi[s])``."""

    seg_blocks: np.ndarray  # int32
    seg_block_start: list[int]
    seg_num_tokens: list[int]
    seg_rows: np.ndarray  # int32 query rows
    seg_row_start: list[int]
    skip_lo: np.ndarray  # [S] int32: keys [skip_lo, skip_hi) of each sequence come from segments
    skip_hi: np.ndarray
    kv_tokens_read: int  # per layer: each kept segment once, every row's walk
    # where segment g's kept blocks sit: in the table row of query row seg_holder[g], from column
    # seg_column[g] (a sliding group's plan takes its pages from there)
    seg_holder: np.ndarray
    seg_column: np.ndarray
    # a sliding group's plan under the freeing KV layout: its index among the step's groups, and all
    # the groups' plans (one structure, their own pages), which share ``derived``: the step's first
    # sliding layer records the kernels' launches once, the others replay them with their group's
    # arrays swapped in (``kernels/window_attention.py``)
    group: int = 0
    groups: tuple[WindowPlan, ...] = ()
    # per (heads, head size, dtype, device): the kernels' work list, buffers and the arrays on the device
    derived: dict[Any, Any] = field(default_factory=dict)

    @property
    def num_segments(self) -> int:
        return len(self.seg_num_tokens)


def step_segments(meta: AttentionMetadata) -> tuple[SharedPlan, np.ndarray] | None:
    """The step's shared plan and its segments' block ids on the host, if the backend made one."""
    plan = meta.plan
    if isinstance(plan, SharedPlan):
        return (plan, plan.seg_blocks.cpu().numpy()) if plan.num_segments else None
    shared = getattr(plan, "shared", None)
    if isinstance(shared, SharedPlan) and shared.num_segments:
        return shared, np.asarray(plan.seg_blocks_host)
    return None


def window_plan(meta: AttentionMetadata, window: int) -> WindowPlan | None:
    """The step's plan for ``window`` (made once, kept on the metadata); None where the step has no
    segment to share, or is not decode-only (its rows take the plain window walk)."""
    if window in meta.window_plans:
        return meta.window_plans[window]
    if meta.full is not None:  # a sliding group's view: the step's plan, on each group's pages
        base = window_plan(meta.full, window)
        views = meta.full.group_metas
        if base is None:
            plans: list[WindowPlan | None] = [None] * len(views)
        else:
            plans = on_every_group(base, [v.block_tables_np for v in views], views[0].table_base_np)
        for view, plan in zip(views, plans, strict=True):
            view.window_plans[window] = plan
        return meta.window_plans[window]
    else:
        found = step_segments(meta) if meta.is_decode_only else None
        made = make_window_plan(meta, *found, window) if found is not None else None
    meta.window_plans[window] = made
    return made


def on_every_group(plan: WindowPlan, tables: list[np.ndarray], base: np.ndarray | None) -> list[WindowPlan]:
    """``plan`` on each sliding group's pages (``on_pages``: group g's ``tables[g]``, every group's
    rows from block ``base[s]`` on), linked as one family."""
    derived: dict[Any, Any] = {}
    plans = [on_pages(plan, t, base) for t in tables]
    family = tuple(dataclasses.replace(p, group=g, derived=derived) for g, p in enumerate(plans))
    for p in family:
        p.groups = family
    return list(family)


def on_pages(plan: WindowPlan, tables: np.ndarray, base: np.ndarray | None) -> WindowPlan:
    """``plan`` reading a sliding group's pages: the blocks its segments keep, looked up in the
    group's ``tables`` [S, K] (row s from block ``base[s]`` on) where the step's plan found them in
    the block table."""
    sizes = np.diff(plan.seg_block_start)
    columns = plan.seg_column - (base[plan.seg_holder] if base is not None else 0)
    blocks = [tables[h, c : c + n] for h, c, n in zip(plan.seg_holder, columns, sizes, strict=True)]
    return dataclasses.replace(plan, seg_blocks=np.concatenate(blocks).astype(np.int32), derived={})


def make_window_plan(
    meta: AttentionMetadata, plan: SharedPlan, seg_blocks: np.ndarray, window: int
) -> WindowPlan | None:
    bs = meta.block_size
    seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)
    lo = np.maximum(seq_lens - window, 0)  # [S] first visible key of each (decode) row
    tables = meta.block_tables_np if meta.block_tables_np is not None else meta.block_tables.cpu().numpy()
    starts = np.asarray(plan.seg_block_start_host, dtype=np.int64)
    # every (segment, holder) pair: where the segment starts in the holder's table
    holders = [np.asarray(h, dtype=np.int64) for h in plan.seg_holders_host]
    counts = np.array([len(h) for h in holders], dtype=np.int64)
    seg = np.repeat(np.arange(len(holders)), counts)
    seq = np.concatenate(holders)
    first_block = seg_blocks[starts[:-1]][seg]
    a = np.argmax(tables[seq] == first_block[:, None], axis=1).astype(np.int64) * bs
    b = a + np.asarray(plan.seg_num_tokens_host, dtype=np.int64)[seg]
    # a segment across its holders' window starts is cut to the whole blocks inside every one of them
    seen = b > lo[seq]  # not wholly behind the holder's window
    seg, seq, a, b = seg[seen], seq[seen], a[seen], b[seen]
    cut = np.zeros(len(holders), dtype=np.int64)
    np.maximum.at(cut, seg, np.maximum(lo[seq] - a, 0))
    cut = -(-cut // bs) * bs  # [G] keys of each segment left to the walks
    a = a + cut[seg]
    kept = a < b
    kept &= np.bincount(seg[kept], minlength=len(holders))[seg] >= 2  # read once for two rows or more
    seg, seq, a, b = seg[kept], seq[kept], a[kept], b[kept]
    # per sequence, its kept segments in key order must chain into one run: keep the run from the first
    order = np.lexsort((a, seq))
    seg, seq, a, b = seg[order], seq[order], a[order], b[order]
    same = np.r_[False, seq[1:] == seq[:-1]]
    gaps = np.cumsum(same & np.r_[False, a[1:] != b[:-1]])
    group_start = np.maximum.accumulate(np.where(~same, np.arange(len(seq)), 0))
    keep = gaps == gaps[group_start]  # no gap since the sequence's first kept segment
    seg, seq, a, b = seg[keep], seq[keep], a[keep], b[keep]
    if not len(seg):
        return None
    num_seqs = len(seq_lens)
    skip_lo = np.full(num_seqs, np.iinfo(np.int64).max)
    skip_hi = np.zeros(num_seqs, dtype=np.int64)
    np.minimum.at(skip_lo, seq, a)
    np.maximum.at(skip_hi, seq, b)
    skip_lo[skip_hi == 0] = 0
    # the kept segments with their rows (a decode step's query row s is sequence s)
    by_seg = np.lexsort((seq, seg))
    seg, seq, a = seg[by_seg], seq[by_seg], a[by_seg]
    kept, rows_per = np.unique(seg, return_counts=True)
    blocks = [seg_blocks[starts[g] + cut[g] // bs : starts[g + 1]] for g in kept]
    first_row = np.r_[0, np.cumsum(rows_per)[:-1]]  # one holder of each kept segment

    tokens = [int(plan.seg_num_tokens_host[g] - cut[g]) for g in kept]
    walk = (seq_lens - lo) - (skip_hi - skip_lo)
    return WindowPlan(
        seg_blocks=np.concatenate(blocks).astype(np.int32),
        seg_block_start=[0, *np.cumsum([len(x) for x in blocks]).tolist()],
        seg_num_tokens=tokens,
        seg_rows=seq.astype(np.int32),
        seg_row_start=[0, *np.cumsum(rows_per).tolist()],
        skip_lo=skip_lo.astype(np.int32),
        skip_hi=skip_hi.astype(np.int32),
        kv_tokens_read=int(sum(tokens) + walk.sum()),
        seg_holder=seq[first_row],
        seg_column=a[first_row] // bs,
    )
