"""The fragmentation measure and the pool's placement of long allocations (pure Python + numpy).

The bound the pool keeps, under any mix of allocations, releases, cache hits and evictions: a long
allocation (``CONTIGUOUS_MIN_BLOCKS``+) gets exactly the fewest runs of block ids its free space
allows (excess runs 0: one run whenever a free run is that long, cached blocks in it or not); an idle
pool's free space is one run (fragmentation 0); no block leaks; every evicted digest is reported.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.kv.block_pool import CONTIGUOUS_MIN_BLOCKS, BlockPool
from prefixserve.kv.cache_events import enable_cache_events
from prefixserve.kv.fragmentation import (
    FreeSpace,
    excess_runs,
    free_runs,
    free_space,
    min_runs,
    run_lengths,
)
from prefixserve.kv.placement import best_window, fewest_runs

N = CONTIGUOUS_MIN_BLOCKS


def mask(n: int, free: list[int]) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    m[free] = True
    return m


def test_run_lengths_and_free_runs() -> None:
    assert run_lengths([]) == []
    assert run_lengths([3, 4, 9, 10, 11, 2]) == [2, 3, 1]
    assert run_lengths([5, 4]) == [1, 1]  # descending ids are not a run: the kernels read ascending rows
    starts, lengths = free_runs(mask(10, [0, 1, 4, 7, 8, 9]))
    assert starts.tolist() == [0, 4, 7] and lengths.tolist() == [2, 1, 3]
    starts, lengths = free_runs(mask(5, [2, 3]))
    assert starts.tolist() == [2] and lengths.tolist() == [2]
    assert free_runs(mask(4, []))[0].size == 0 and free_runs(np.zeros(0, dtype=bool))[0].size == 0


def test_min_runs_excess_and_free_space() -> None:
    assert min_runs([5, 2, 7], 7) == 1 and min_runs([5, 2, 7], 8) == 2 and min_runs([5, 2, 7], 14) == 3
    assert min_runs([], 0) == 0
    with pytest.raises(ValueError):
        min_runs([1, 2], 4)
    assert excess_runs([1, 2, 3], [3, 1]) == 0 and excess_runs([1, 3, 4], [3, 1]) == 1
    space = free_space(mask(10, [0, 1, 4, 7, 8, 9]))
    assert space == FreeSpace(free=6, runs=3, longest=3) and space.fragmentation == 0.5
    assert free_space(mask(4, [])).fragmentation == 0.0
    assert free_space(np.ones(8, dtype=bool)).fragmentation == 0.0


def test_best_window_prefers_uncached_then_least_recently_used() -> None:
    free = mask(12, [0, 1, 2, 4, 5, 6, 7, 8, 9, 10])
    cost = np.zeros(12, dtype=np.int64)
    assert best_window(free, cost, 3) == 0  # all uncached: the lowest window
    cost[[0, 1, 2, 4]] = [9, 9, 9, 1]
    assert best_window(free, cost, 3) == 5  # uncached 5..7 beats any window with a cached block
    cost[5:11] = [8, 8, 8, 2, 2, 2]
    assert best_window(free, cost, 3) == 8  # 8..10 sums 6: the least recently used window
    assert best_window(free, cost, 7) == 4 and best_window(free, cost, 8) is None


@settings(max_examples=200, deadline=None)
@given(
    free=st.lists(st.booleans(), min_size=1, max_size=60),
    costs=st.lists(st.integers(0, 50), min_size=60, max_size=60),
    count=st.integers(1, 20),
)
def test_best_window_is_the_cheapest_all_free_window(free: list[bool], costs: list[int], count: int) -> None:
    """Against brute force: every window of ``count`` free blocks, least summed cost, lowest start."""
    m, cost = np.array(free), np.array(costs[: len(free)], dtype=np.int64)
    windows = [
        (int(cost[i : i + count].sum()), i) for i in range(len(free) - count + 1) if m[i : i + count].all()
    ]
    assert best_window(m, cost, count) == (min(windows)[1] if windows else None)


def test_fewest_runs_takes_longest_runs_then_best_fit() -> None:
    free = mask(20, [0, 1, 3, 4, 5, 6, 8, 9, 10, 12, 13, 14, 15, 16])  # runs 2, 4, 3, 5
    got = fewest_runs(free, 7)  # 5 whole, then 2 from the shortest run holding 2 (0..1)
    assert got == [0, 1, 12, 13, 14, 15, 16]
    got = fewest_runs(free, 11)  # 5 + 4 whole, then 2 from the 2-run (it fits exactly)
    assert sorted(got) == got and run_lengths(got) == [2, 4, 5]


def test_a_pool_of_cached_free_blocks_still_gives_one_run() -> None:
    """The steady state that halved the GPU's third document burst: every free block is cached (earlier
    bursts), released tail first. A long allocation used to fall back to the LRU list (descending,
    scattered ids); now it evicts one run."""
    pool = BlockPool(4 * N, 16)
    seqs = [pool.allocate(N) for _ in range(4)]
    for s in seqs:
        for i, b in enumerate(s):
            pool.register(b, bytes([s[0], i]) * 8)
    for s in seqs:
        pool.release(s)
    assert pool.num_cached == 4 * N and pool.free_space().runs == 1
    events = enable_cache_events(pool)
    events.drain()
    got = pool.allocate(2 * N)
    assert got == list(range(2 * N)) and pool.scattered_allocations == 0
    assert pool.run_evictions == pool.evictions == 2 * N
    assert len(events.drain().removed) == 2 * N
    pool.check_integrity()


def test_a_run_just_hit_is_evicted_last() -> None:
    """LRU by runs: the oldest run goes first, unless a lookup just found it."""
    pool = BlockPool(3 * N, 16)
    seqs = [pool.allocate(N) for _ in range(3)]
    for s in seqs:
        for b in s:
            pool.register(b, bytes([b]) * 16)
        pool.release(s)
    pool.touch(seqs[0])  # the oldest run was just hit: keep it
    assert pool.allocate(N) == seqs[1]
    pool.check_integrity()
    pool.release(seqs[1])  # uncached now: a touch leaves it as it is
    pool.touch(seqs[1])
    pool.check_integrity()


# ---- random workloads -------------------------------------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc_long", "alloc_short", "release", "hit", "register", "touch"]),
        st.integers(0, 10**6),
    ),
    min_size=10,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2 * N, 6 * N), ops=OPS)
def test_random_workload_keeps_runs_minimal_and_leaks_nothing(num_blocks: int, ops) -> None:
    pool = BlockPool(num_blocks, 4)
    events = enable_cache_events(pool)
    index: set[bytes] = set(events.drain(full=True).added)  # what a router following the events knows
    evicted_seen: list[bytes] = []
    pool.on_evict = lambda pairs: evicted_seen.extend(d for _, d in pairs)
    live: list[list[int]] = []  # each a sequence's blocks (held once by it)
    names = iter(range(10**9))
    for op, r in ops:
        if op.startswith("alloc"):
            count = N + r % (2 * N) if op == "alloc_long" else 1 + r % (N - 1)
            if count > pool.num_free:
                continue
            _, lengths = free_runs(pool._free_mask)
            fits = bool((lengths >= count).any())
            before = pool.scattered_allocations
            blocks = pool.allocate(count)
            assert len(set(blocks)) == count
            if count >= N:  # the bound: exactly the fewest runs the free space allowed
                assert excess_runs(blocks, lengths) == 0
                assert (len(run_lengths(blocks)) == 1) == fits
                assert pool.scattered_allocations == before + (not fits)
            live.append(blocks)
        elif op == "release" and live:
            pool.release(live.pop(r % len(live)))
        elif op == "register" and live:  # a computed prompt: its blocks enter the index
            for block in live[r % len(live)]:
                pool.register(block, next(names).to_bytes(16, "little"))
        elif op == "hit" and pool.num_cached:
            digests = pool.cached_digests()
            blocks = pool.lookup(digests[r % len(digests) :][:4])
            pool.acquire(blocks)
            pool.touch(blocks)
            live.append(blocks)
        elif op == "touch" and pool.num_cached:
            digests = pool.cached_digests()
            pool.touch(pool.lookup([digests[r % len(digests)]]))
        pool.check_integrity()
        drained = events.drain()
        index |= set(drained.added)
        index -= set(drained.removed)
        assert index == set(pool.cached_digests())  # every eviction reported to a router
        assert pool.num_free + pool.num_used == num_blocks
    assert len(evicted_seen) == pool.evictions  # and to the host spill, block by block
    for blocks in live:
        pool.release(blocks)
    assert pool.num_free == num_blocks and pool.num_used == 0
    assert pool.free_space() == FreeSpace(num_blocks, 1, num_blocks)  # idle: one run, fragmentation 0
    pool.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_bursts_over_a_wrapped_pool_keep_every_document_in_one_run(seed: int) -> None:
    """Steady state, as a server sees it: bursts of a new document and its questions (cache hits on
    the document, short own parts), some bursts overlapping the next one's start, over a pool that
    wraps many times. Every document gets one run; between bursts the free space is one run."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(24 * N, 4)
    names = iter(range(10**9))
    overlap: list[list[int]] = []  # the previous burst's questions still running
    for _burst in range(150):
        doc = pool.allocate(int(rng.integers(N, 6 * N)))
        assert len(run_lengths(doc)) == 1 and pool.scattered_allocations == 0
        for b in doc:
            pool.register(b, next(names).to_bytes(16, "little"))
        questions = []
        for _ in range(int(rng.integers(4, 40))):
            pool.acquire(doc)  # a question's prefix hit
            questions.append(doc + pool.allocate(int(rng.integers(1, 4))))
        pool.release(doc)  # the leader's own hold ends with it
        for q in overlap:
            pool.release(q)
        keep = int(rng.integers(0, 3))  # a few questions outlive their burst
        overlap = questions[:keep]
        for q in questions[keep:]:
            for b in q[len(doc) :]:
                pool.register(b, next(names).to_bytes(16, "little"))
            pool.release(q)
        if not overlap:
            assert pool.free_space().fragmentation == 0.0
    for q in overlap:
        pool.release(q)
    assert pool.run_evictions > 0 and pool.num_used == 0  # the pool wrapped; nothing leaked
    pool.check_integrity()
