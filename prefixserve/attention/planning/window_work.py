"""The kernels' work of a sliding layer's decode step, on the host: what the eager launches
(``kernels/window_attention.py``) and the decode graphs (``attention/window_graph.py``) both load.

Partials sit in one buffer: row t's walk in slot t (``slots_at`` of them: the step's rows eagerly, the
bucket's in a graph), the shared kernel's slots after them; the merge CSR names each row's slots.
Under the freeing KV layout every sliding group reads its own pages, so each group gets its segment
blocks and its work items (a contiguous segment's first cache row, item field 6, is the group's own);
the work list's structure is the step's, shared by every group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefixserve.attention.planning.shared_plan import SharedWork, contiguous_first_rows, plan_shared_work
from prefixserve.attention.planning.window_plan import WindowPlan


@dataclass(slots=True)
class WindowWork:
    """A window plan's work on the host: the shared kernel's list (items on the host), the lists the
    kernels read, and each sliding group's blocks and items (None: one group, the plan's own)."""

    work: SharedWork
    seg_blocks: np.ndarray  # int32
    seg_block_start: np.ndarray  # int32 [segments + 1]
    seg_rows: np.ndarray  # int32
    skip_lo: np.ndarray  # int32 [rows]
    skip_hi: np.ndarray
    row_ptr: np.ndarray  # int64 [slots_at + 1]: the merge CSR
    part_idx: np.ndarray  # int64: slot ids, row by row
    groups: list[tuple[np.ndarray, np.ndarray]] | None  # per group (segment blocks, work items)

    @property
    def items(self) -> np.ndarray:
        return self.work.items.numpy()


def window_work(
    plan: WindowPlan, slots_at: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, block_size: int, family: bool = True, kv_dtype: torch.dtype | None = None,
) -> WindowWork | None:  # fmt: skip
    """``plan``'s work with walk slots ``[0, slots_at)``, with ``family`` each sliding group's too; None
    where the groups' segments break into runs differently (their work lists would differ: each
    group then plans alone, ``family=False``). ``kv_dtype``: the cache's, where not ``dtype``."""
    work = plan_shared_work(
        plan.seg_row_start,
        plan.seg_num_tokens,
        kv_heads,
        q_heads // kv_heads,
        device,
        head_dim=head_dim,
        dtype=dtype,
        items_on_host=True,
        seg_blocks=plan.seg_blocks,
        seg_block_start=plan.seg_block_start,
        block_size=block_size,
        kv_dtype=kv_dtype,
    )
    owner = plan.seg_rows[work.slot_row_index.numpy()].astype(np.int64)
    parts = np.concatenate([np.arange(slots_at), owner])  # the row of each slot
    row_ptr = np.zeros(slots_at + 1, dtype=np.int64)
    np.cumsum(np.bincount(parts, minlength=slots_at), out=row_ptr[1:])
    groups = None
    if family and plan.groups:
        groups = group_items(plan, work.items.numpy(), block_size)
        if groups is None:
            return None
    return WindowWork(
        work=work,
        seg_blocks=np.asarray(plan.seg_blocks, dtype=np.int32),
        seg_block_start=np.asarray(plan.seg_block_start, dtype=np.int32),
        seg_rows=np.asarray(plan.seg_rows, dtype=np.int32),
        skip_lo=plan.skip_lo,
        skip_hi=plan.skip_hi,
        row_ptr=row_ptr,
        part_idx=np.argsort(parts, kind="stable"),
        groups=groups,
    )


def group_items(
    plan: WindowPlan, items: np.ndarray, block_size: int
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Each sliding group's segment blocks and work items, or None where a group's segments break
    into runs where another's do not."""
    firsts = [contiguous_first_rows(p.seg_blocks, p.seg_block_start, block_size) for p in plan.groups]
    if any(((f >= 0) != (firsts[0] >= 0)).any() for f in firsts):
        return None
    out = []
    for p, first in zip(plan.groups, firsts, strict=True):
        mine = items.copy()
        row = first[mine[:, 0]]
        mine[:, 6] = np.where((row >= 0) & (mine[:, 6] >= 0), row + mine[:, 3], -1)
        out.append((np.asarray(p.seg_blocks, dtype=np.int32), mine))
    return out


__all__ = ["WindowWork", "group_items", "window_work"]
