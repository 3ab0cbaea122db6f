"""Where a long allocation goes in the pool: one run of consecutive free blocks, cached ones included.

Once a server has run a while, every free block holds cached KV, so a pool that only looked for runs
of *uncached* free blocks found none and handed a new document the least recently used blocks one by
one: earlier requests' tails, released tail first, so the ids came out scattered and descending, and
the shared-segment kernels lost their whole-tile reads for every step that segment was in.

Here a long allocation takes the window of ``count`` consecutive free blocks (cached or not) whose
cached blocks were, summed, least recently used; a window of uncached blocks costs nothing and wins.
The trade: the blocks evicted are the window's, not the ``count`` least recently used of the pool, so a
cached block slightly younger than the pool's oldest may go first. Only when no free run is long
enough does the allocation split, into the fewest runs the free space allows.

A few numpy passes over the pool per long allocation (a prompt, not a block): ~0.15 ms at 40K blocks.
"""

from __future__ import annotations

import numpy as np

from prefixserve.kv.fragmentation import free_runs, min_runs


class Scratch:
    """Running-sum buffers for ``best_window``, sized once for a pool. Fresh arrays of a 40K-block
    pool are 160-320 KB each: glibc maps such blocks anew (or trims them back) call after call, and
    their page faults cost several times the arithmetic (~1 ms against ~0.15 ms a call)."""

    __slots__ = ("bad", "cost_sum", "free_in", "free_sum", "window")

    def __init__(self, num_blocks: int) -> None:
        self.free_sum = np.zeros(num_blocks + 1, dtype=np.int32)
        self.cost_sum = np.zeros(num_blocks + 1, dtype=np.int64)
        self.window = np.empty(num_blocks, dtype=np.int64)
        self.free_in = np.empty(num_blocks, dtype=np.int32)
        self.bad = np.empty(num_blocks, dtype=bool)


def best_window(free: np.ndarray, cost: np.ndarray, count: int, scratch: Scratch | None = None) -> int | None:
    """Start of the window of ``count`` consecutive free blocks of least summed ``cost`` (the lowest
    start among equals), or None when no free run is that long.

    ``free``: bool [blocks]; ``cost``: int64 [blocks], read only where free (0 for uncached blocks,
    the recency stamp for cached ones). Two running sums over the stretch of the pool that holds
    the free runs long enough: one counts free blocks (a window is valid when all ``count`` are), one
    sums the cost."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    starts, lengths = free_runs(free)
    fit = lengths >= count
    if not fit.any():
        return None
    lo, hi = int(starts[fit][0]), int(starts[fit][-1] + lengths[fit][-1])
    n = hi - lo - count + 1  # window starts in [lo, hi - count]
    sc = scratch or Scratch(len(free))
    free_sum, cost_sum = sc.free_sum[: hi - lo + 1], sc.cost_sum[: hi - lo + 1]  # [0] stays 0
    np.cumsum(free[lo:hi].view(np.int8), dtype=np.int32, out=free_sum[1:])
    np.cumsum(cost[lo:hi], dtype=np.int64, out=cost_sum[1:])
    window, free_in, bad = sc.window[:n], sc.free_in[:n], sc.bad[:n]
    np.subtract(cost_sum[count:], cost_sum[:n], out=window)  # a window's cost, by start
    np.subtract(free_sum[count:], free_sum[:n], out=free_in)  # its free blocks
    np.not_equal(free_in, count, out=bad)
    window[bad] = np.iinfo(np.int64).max
    return lo + int(np.argmin(window))


def fewest_runs(free: np.ndarray, count: int) -> list[int]:
    """``count`` free block ids in the fewest runs the free space allows, for when no run holds them all:
    the longest runs whole, then the rest from the shortest run that holds it (best fit, so longer
    runs stay whole for later); runs in address order, ids ascending in each."""
    starts, lengths = free_runs(free)
    k = min_runs(lengths, count)
    order = np.lexsort((starts, -lengths))  # longest first, lower address first among equals
    whole = order[: k - 1]
    rest = count - int(lengths[whole].sum())
    others = order[k - 1 :]
    fits = others[lengths[others] >= rest]
    last = fits[np.lexsort((starts[fits], lengths[fits]))[0]]  # shortest run that holds the rest
    pieces = [(int(starts[i]), int(lengths[i])) for i in whole] + [(int(starts[last]), rest)]
    return [b for start, n in sorted(pieces) for b in range(start, start + n)]


__all__ = ["Scratch", "best_window", "fewest_runs"]
