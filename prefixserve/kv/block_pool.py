"""Paged KV block pool with ref counts and an automatic prefix index. Pure Python: no torch.

A block is a fixed number of token slots in every layer's KV cache. Sequences hold blocks through
ref counts; a block that several sequences hold is shared (a common prompt prefix, n samples of one
prompt, a pinned system prompt). A *full* block may be registered in the prefix index under a digest
of (previous block's digest, its token ids, its position ids, cache salt); a later request finds its
prompt's cached blocks by recomputing the same digests. Blocks nobody holds stay in the index until
their slot is needed: eviction is LRU over free blocks.

A long allocation (a prompt) gets consecutive block ids when the pool has such a run of uncached free
blocks: a segment in consecutive blocks is one row range of the cache, which the GPU's shared-segment
kernel reads with whole-tile TMA copies (``attention/kernels/shared_attention.py``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

CONTIGUOUS_MIN_BLOCKS = 16  # allocations this long look for a run of consecutive free blocks


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for (the scheduler checks first; this is a bug guard)."""


def block_digest(
    parent: bytes | None, token_ids: Sequence[int], positions: Sequence[int], salt: str | None
) -> bytes:
    """Identity of a full block's KV: same digest means bit-identical KV (same model and dtype)."""
    ids, places = array("q", token_ids).tobytes(), array("q", positions).tobytes()
    return _link(parent or b"root", ids, places, _tail(salt))


def _tail(salt: str | None) -> bytes:
    return b"|" + (salt or "").encode()


def _link(parent: bytes, ids: bytes, places: bytes, tail: bytes) -> bytes:
    """One digest over the parent's and a block's bytes (token ids and positions as int64)."""
    return hashlib.blake2b(b"".join((parent, ids, b"|", places, tail)), digest_size=16).digest()


def chain_digests(
    parent: bytes | None,
    token_ids: Sequence[int],
    positions: Sequence[int],
    salt: str | None,
    block_size: int,
) -> list[bytes]:
    """``block_digest`` of each full ``block_size`` slice of the tokens, each chained to the one before.

    One pass turns all the ids into bytes: hashing a long prompt block by block spent most of its
    time building two small arrays per block (a quarter of a server's engine thread in an 8K-token
    system prompt burst)."""
    ids, places = array("q", token_ids).tobytes(), array("q", positions).tobytes()
    tail, link = _tail(salt), parent or b"root"
    width = 8 * block_size  # bytes of one block's ids (int64)
    out: list[bytes] = []
    blake2b, join = hashlib.blake2b, b"".join  # _link inlined: this loop runs for every prompt block
    for lo in range(0, len(ids) - width + 1, width):
        hi = lo + width
        link = blake2b(join((link, ids[lo:hi], b"|", places[lo:hi], tail)), digest_size=16).digest()
        out.append(link)
    return out


class BlockPool:
    """Owns block ids 0..num_blocks-1: allocation, ref counts, prefix index, LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # Free blocks in eviction order (first = evicted first). Uncached blocks go to the front.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._plain = np.ones(num_blocks, dtype=bool)  # free and uncached: what a run may take
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0
        # long allocations that found no run of consecutive uncached free blocks (scattered ids: the
        # shared kernel then reads such a segment block by block instead of in whole TMA tiles)
        self.scattered_allocations = 0
        # called with the (block, digest) pairs an allocation evicts, before anyone writes the blocks
        # (the engine's host spill copies their KV out: kv/prefix_spill.py)
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None
        # digests entering and leaving the index, for a replica router (kv/cache_events.py); None: off
        self.cache_events: Any = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def digest_of(self, block: int) -> bytes | None:
        return self._digest_of.get(block)

    def cached_block(self, digest: bytes) -> int | None:
        """The block registered under ``digest`` (not yet held), or None."""
        return self._block_of.get(digest)

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """Longest run of leading digests that are cached; returns their blocks (not yet held)."""
        found = []
        for d in digests:
            block = self._block_of.get(d)
            if block is None:
                break
            found.append(block)
        return found

    # ---- holding and releasing -----------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` blocks, evicting the least recently used cached ones if needed.

        Uncached free blocks go first (consecutive ids when ``count`` is long and a run exists).
        """
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        if count >= CONTIGUOUS_MIN_BLOCKS:
            run = self._plain_run(count)
            if run is not None:
                for b in run:
                    del self._free[b]
                    self.ref_counts[b] = 1
                self._plain[run[0] : run[-1] + 1] = False
                return run
            self.scattered_allocations += 1
        out = []
        evicted: list[tuple[int, bytes]] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            digest = self._digest_of.pop(block, None)
            if digest is not None:
                del self._block_of[digest]
                self.evictions += 1
                evicted.append((block, digest))
                if self.cache_events is not None:
                    self.cache_events.removed(digest)
            self.ref_counts[block] = 1
            self._plain[block] = False
            out.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def _plain_run(self, count: int) -> list[int] | None:
        """The lowest run of ``count`` consecutive free, uncached blocks, or None."""
        idx = np.flatnonzero(self._plain)
        if idx.size < count:
            return None
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1  # where a new run starts
        starts = np.r_[0, breaks]
        lengths = np.r_[breaks, idx.size] - starts
        fits = np.flatnonzero(lengths >= count)
        if fits.size == 0:
            return None
        first = int(idx[starts[fits[0]]])
        return list(range(first, first + count))

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block (a cache hit, a fork, a pin)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                if b not in self._free:
                    raise RuntimeError(f"block {b} has no holder but is not free")
                del self._free[b]
                self._plain[b] = False
            self.ref_counts[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; a block nobody holds becomes free (kept in the index)."""
        # One pass of plain list work, then the free-list updates for the blocks that lost their last
        # holder: a sequence under a 16K-token shared prefix releases ~1,000 blocks that others still
        # hold, and 1,024 such sequences finishing in one step spent half that step's host time here.
        counts = self.ref_counts
        emptied = []
        try:
            for b in reversed(blocks):  # tail blocks first, so a prefix outlives its continuations
                held = counts[b]
                if held <= 0:
                    raise RuntimeError(f"block {b} released more often than held")
                counts[b] = held - 1
                if held == 1:
                    emptied.append(b)
        finally:  # blocks released before an error are free, as they were before it
            free, digest_of, plain = self._free, self._digest_of, self._plain
            for b in emptied:  # in release order
                free[b] = None
                if b not in digest_of:
                    free.move_to_end(b, last=False)  # nothing cached: reuse it first
                    plain[b] = True

    def register(self, block: int, digest: bytes) -> None:
        """Put a full, held block in the prefix index (first writer of a digest wins)."""
        if block in self._digest_of or digest in self._block_of:
            return
        self._digest_of[block] = digest
        self._block_of[digest] = block
        if self.cache_events is not None:
            self.cache_events.added(digest)

    def cached_digests(self) -> list[bytes]:
        """Every digest in the prefix index now (a router's snapshot of this pool)."""
        return list(self._block_of)

    def touch(self, blocks: Sequence[int]) -> None:
        """Mark free cached blocks as recently used (a lookup that found them)."""
        for b in blocks:
            if b in self._free:
                self._free.move_to_end(b)

    def check_integrity(self) -> None:
        """Raise if ref counts, the free list and the index disagree (tests call this)."""
        for b in range(self.num_blocks):
            if (self.ref_counts[b] == 0) != (b in self._free):
                raise AssertionError(f"block {b}: ref {self.ref_counts[b]}, free={b in self._free}")
            if self._plain[b] != (b in self._free and b not in self._digest_of):
                raise AssertionError(f"block {b}: free-and-uncached mark is stale")
        for d, b in self._block_of.items():
            if self._digest_of.get(b) != d:
                raise AssertionError(f"index entry for block {b} is inconsistent")
