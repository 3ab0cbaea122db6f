"""The block pool on its own: ref counts, prefix index, LRU eviction, integrity."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.kv.block_pool import BlockPool, NoFreeBlocksError, block_digest, chain_digests


def test_allocate_release_round_trip() -> None:
    pool = BlockPool(8, 4)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free == 3
    pool.acquire(blocks[:2])
    pool.release(blocks)
    assert pool.num_free == 6
    pool.release(blocks[:2])
    assert pool.num_free == 8
    pool.check_integrity()


def test_over_allocation_and_double_release_are_refused() -> None:
    pool = BlockPool(2, 4)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])


def test_release_order_and_a_failed_release() -> None:
    """Tail blocks go back first; uncached blocks are reused before cached ones; a release that
    meets an over-released block raises after freeing the blocks released before it, and the
    pool's books still balance."""
    pool = BlockPool(6, 4)
    a, b, c, d = pool.allocate(4)
    pool.register(b, b"digest-b")  # b is cached: it stays in the index, reused last
    pool.acquire([c])  # c has a second holder: not freed by one release
    pool.release([a, b, c, d])
    assert pool.ref_counts[c] == 1 and not pool.is_free(c)
    assert list(pool._free)[:2] == [a, d]  # uncached: to the front, in release order (d, then a)
    assert list(pool._free)[-1] == b  # cached: reused last
    pool.check_integrity()
    (e,) = pool.allocate(1)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a, e])  # e (released first, from the tail) is freed; a was already free
    assert pool.is_free(e) and pool.ref_counts[e] == 0
    pool.check_integrity()


def test_digest_depends_on_tokens_positions_salt_and_parent() -> None:
    base = block_digest(None, [1, 2], [0, 1], None)
    assert base == block_digest(None, [1, 2], [0, 1], None)
    assert base != block_digest(None, [1, 3], [0, 1], None)
    assert base != block_digest(None, [1, 2], [5, 6], None)
    assert base != block_digest(None, [1, 2], [0, 1], "tenant-a")
    assert base != block_digest(b"x" * 16, [1, 2], [0, 1], None)


def test_digest_bytes_are_stable() -> None:
    """Digests name KV on disk and in host memory across restarts: their bytes must not drift."""
    h = hashlib.blake2b(digest_size=16)
    for part in (b"root", array("q", [7, 8]).tobytes(), b"|", array("q", [3, 4]).tobytes(), b"|salt"):
        h.update(part)
    assert block_digest(None, [7, 8], [3, 4], "salt") == h.digest()


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3, 16]),
    tokens=st.lists(st.integers(0, 2**40), max_size=70),
    parent=st.sampled_from([None, b"p" * 16]),
    salt=st.sampled_from([None, "", "tenant-\u00e9"]),
)
def test_chain_digests_match_block_by_block(block_size: int, tokens: list[int], parent, salt) -> None:
    positions = [3 * i + 1 for i in range(len(tokens))]
    expected, link = [], parent
    for lo in range(0, len(tokens) - block_size + 1, block_size):
        link = block_digest(link, tokens[lo : lo + block_size], positions[lo : lo + block_size], salt)
        expected.append(link)
    assert chain_digests(parent, tokens, positions, salt, block_size) == expected


def test_cached_free_blocks_are_found_until_evicted_lru() -> None:
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    da, db = b"a" * 16, b"b" * 16
    pool.register(a, da)
    pool.register(b, db)
    pool.release([a, b])
    assert pool.lookup([da, db]) == [a, b]
    assert pool.num_free == 4 and pool.num_cached == 2
    # Uncached free blocks are handed out first; then the least recently used cached one.
    pool.allocate(2)
    assert pool.lookup([da, db]) == [a, b]
    pool.touch([a])  # a was just looked up: b is now the oldest
    (got,) = pool.allocate(1)
    assert got == b and pool.lookup([da]) == [a] and pool.lookup([db]) == []
    assert pool.evictions == 1
    pool.check_integrity()


def test_lookup_stops_at_first_miss() -> None:
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    pool.register(a, b"1" * 16)
    pool.register(b, b"3" * 16)
    assert pool.lookup([b"1" * 16, b"2" * 16, b"3" * 16]) == [a]


def test_long_allocations_get_consecutive_blocks_when_a_run_is_free() -> None:
    """A prompt's blocks in one run of ids: the GPU's shared kernel reads such a segment by TMA tiles."""
    from prefixserve.kv.block_pool import CONTIGUOUS_MIN_BLOCKS

    n = CONTIGUOUS_MIN_BLOCKS
    pool = BlockPool(4 * n + 8, 16)
    short = [pool.allocate(1)[0] for _ in range(6)]  # blocks 0..5
    pool.release([short[1], short[3], short[5]])  # holes at 1, 3, 5 go to the front of the free list
    assert pool.allocate(3) == [1, 3, 5]  # short allocations take the front, as before
    pool.release([1, 3, 5])
    run = pool.allocate(n)
    assert run == list(range(5, 5 + n))  # the first whole run (hole 5 joins 6..), not holes 1 and 3
    pool.check_integrity()
    # a run with a cached block costs an eviction: an uncached run is taken first
    pool.register(run[0], b"d" * 16)
    pool.release(run)
    again = pool.allocate(n)
    assert again == list(range(6, 6 + n)) and pool.num_cached == 1
    pool.check_integrity()


def test_without_a_free_run_long_allocations_take_the_fewest_runs() -> None:
    from prefixserve.kv.block_pool import CONTIGUOUS_MIN_BLOCKS

    n = CONTIGUOUS_MIN_BLOCKS
    pool = BlockPool(2 * n, 16)
    held = pool.allocate(2 * n)
    pool.release(held[::2])  # every other block free: no run of n
    assert pool.scattered_allocations == 0
    got = pool.allocate(n)
    assert sorted(got) == held[::2]
    assert pool.scattered_allocations == 1  # counted (kv_scattered_allocations_total)
    pool.check_integrity()
