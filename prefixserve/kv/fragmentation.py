"""How scattered KV block ids are: runs of consecutive ids, in an allocation and in the pool's free space.

A shared segment in consecutive blocks is one row range of the cache, which the GPU's shared-segment
kernels read with whole-tile TMA copies; one break sends the whole step to per-token pointer loads
(``attention/planning/shared_plan.py``). So contiguity is measured in runs:

- an allocation's **excess runs**: how many more runs of ids it got than the fewest the free space
  allowed (``min_runs``); the pool's placement keeps it at 0 for long allocations (``kv/placement.py``);
- the pool's **free-space fragmentation**: the share of free blocks outside the longest free run
  (0: free space is one run, so any allocation that fits gets consecutive ids; near 1: free blocks
  are islands). It is what decides whether the next long prompt can be placed in one run.

Pure numpy and Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def run_lengths(blocks: Sequence[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive ascending ids, in table order ([3, 4, 9] -> [2, 1])."""
    out: list[int] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            out.append(i - start)
            start = i
    return out


def free_runs(free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of True in a boolean mask, in address order (int64 arrays)."""
    b = np.asarray(free, dtype=bool).view(np.int8)
    if b.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    edges = np.flatnonzero(b[1:] != b[:-1]) + 1  # where the mask flips
    bounds = np.concatenate(([0], edges, [b.size])).astype(np.int64)
    lead = 0 if b[0] else 1  # the first run of True starts at bounds[lead]
    starts, ends = bounds[lead:-1:2], bounds[lead + 1 :: 2]
    return starts, ends - starts


def min_runs(lengths: Sequence[int] | np.ndarray, count: int) -> int:
    """The fewest runs among free runs of these lengths that hold ``count`` blocks (largest first);
    0 for ``count`` 0. Raises if they hold fewer than ``count`` blocks in all."""
    if count <= 0:
        return 0
    desc = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    held = np.cumsum(desc)
    if not held.size or held[-1] < count:
        raise ValueError(f"free runs hold {int(held[-1]) if held.size else 0} blocks, not {count}")
    return int(np.searchsorted(held, count)) + 1


def excess_runs(blocks: Sequence[int], free_lengths: Sequence[int] | np.ndarray) -> int:
    """Runs an allocation got beyond the fewest its free space allowed (``free_lengths``: the pool's
    free runs just before it)."""
    return len(run_lengths(blocks)) - min_runs(free_lengths, len(blocks))


@dataclass(frozen=True, slots=True)
class FreeSpace:
    """The pool's free blocks as runs of consecutive ids."""

    free: int  # free blocks (cached or not)
    runs: int  # maximal runs of consecutive free ids
    longest: int  # blocks in the longest run: the longest allocation that gets one run now

    @property
    def fragmentation(self) -> float:
        """Share of free blocks outside the longest free run (0 with no free block)."""
        return 1.0 - self.longest / self.free if self.free else 0.0


def free_space(free: np.ndarray) -> FreeSpace:
    """``FreeSpace`` of a boolean mask of free blocks (one numpy pass: ~25 us at 40K blocks)."""
    _, lengths = free_runs(free)
    return FreeSpace(int(lengths.sum()), int(lengths.size), int(lengths.max(initial=0)))


__all__ = ["FreeSpace", "excess_runs", "free_runs", "free_space", "min_runs", "run_lengths"]
