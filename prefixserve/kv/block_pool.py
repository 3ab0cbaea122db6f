"""Paged KV block pool with ref counts and an automatic prefix index. Pure Python: no torch.

A block is a fixed number of token slots in every layer's KV cache. Sequences hold blocks through
ref counts; a block that several sequences hold is shared (a common prompt prefix, n samples of one
prompt, a pinned system prompt). A *full* block may be registered in the prefix index under a digest
of (previous block's digest, its token ids, its position ids, cache salt); a later request finds its
prompt's cached blocks by recomputing the same digests. Blocks nobody holds stay in the index until
their slot is needed: eviction is LRU over free blocks.

A long allocation (a prompt) gets consecutive block ids whenever the pool has a run of that many free
blocks, evicting the cached ones in the run (``kv/placement.py`` picks the run and says what it costs
LRU): a segment in consecutive blocks is one row range of the cache, which the GPU's shared-segment
kernels read with whole-tile TMA copies (``attention/planning/shared_plan.py``). Before, only runs of
uncached free blocks counted, and a pool full of cached blocks (any server after a few bursts) handed
a new document scattered ids. ``free_space`` measures what is left (``kv/fragmentation.py``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from prefixserve.kv.fragmentation import FreeSpace, free_space
from prefixserve.kv.placement import Scratch, best_window, fewest_runs

CONTIGUOUS_MIN_BLOCKS = 16  # allocations this long are placed in a run of consecutive free blocks


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for (the scheduler checks first; this is a bug guard)."""


def block_digest(
    parent: bytes | None, token_ids: Sequence[int], positions: Sequence[int], salt: str | None
) -> bytes:
    """Identity of a full block's KV: same digest means bit-identical KV (same model and dtype)."""
    ids, places = array("q", token_ids).tobytes(), array("q", positions).tobytes()
    return _link(parent or b"root", ids, places, _tail(salt))


def chain_root(kv_scheme: bytes) -> bytes | None:
    """The parent of a chain's first block for a KV format (``KVCache.scheme``): None (``b"root"``) for
    the model's dtype, so those digests are unchanged; for e4m3 a digest of the scheme and its scales,
    so FP8 blocks never match model-dtype ones (nor FP8 ones under other scales)."""
    if not kv_scheme:
        return None
    return hashlib.blake2b(b"root|" + kv_scheme, digest_size=16).digest()


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
    public: int = 0,
) -> list[bytes]:
    """``block_digest`` of each full ``block_size`` slice of the tokens, each chained to the one before;
    the first ``public`` blocks without the salt (public content shared across salts: a block after a
    salted one is still its tenant's alone, since its digest chains the salted one's).

    One pass turns all the ids into bytes: hashing a long prompt block by block spent most of its
    time building two small arrays per block (a quarter of a server's engine thread in an 8K-token
    system prompt burst)."""
    ids, places = array("q", token_ids).tobytes(), array("q", positions).tobytes()
    tail, public_tail, link = _tail(salt), _tail(None), parent or b"root"
    width = 8 * block_size  # bytes of one block's ids (int64)
    out: list[bytes] = []
    blake2b, join = hashlib.blake2b, b"".join  # _link inlined: this loop runs for every prompt block
    for lo in range(0, len(ids) - width + 1, width):
        hi = lo + width
        end = public_tail if len(out) < public else tail
        link = blake2b(join((link, ids[lo:hi], b"|", places[lo:hi], end)), digest_size=16).digest()
        out.append(link)
    return out


class BlockPool:
    """Owns block ids 0..num_blocks-1: allocation, ref counts, prefix index, LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, kv_scheme: bytes = b"") -> None:
        """``kv_scheme``: the KV format's bytes (``KVCache.scheme``), which every digest chain starts from
        (``root``)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root = chain_root(kv_scheme)  # a chain's first parent (None: b"root")
        self.ref_counts = [0] * num_blocks
        # Free blocks in eviction order (first = evicted first). Uncached blocks go to the front.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_mask = np.ones(num_blocks, dtype=bool)  # free, cached or not: what a run may take
        # when each free cached block last entered the LRU end (release, touch); 0 for uncached ones:
        # a run's cost to evict (kv/placement.py). ``_clock`` only grows.
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        self._clock = 0
        self._scratch = Scratch(num_blocks)  # best_window's buffers, made once
        self._version = 0  # bumped by every change of the free set (``free_space`` caches on it)
        self._space: tuple[int, FreeSpace] | None = None
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0
        # cached blocks evicted by long allocations to keep their run (part of ``evictions``)
        self.run_evictions = 0
        # long allocations that found no free run of their length and got several runs (the fewest
        # possible): the shared kernel reads such a segment block by block instead of in TMA tiles
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

    def free_space(self) -> FreeSpace:
        """The free blocks as runs of consecutive ids (cached until the free set changes)."""
        if self._space is None or self._space[0] != self._version:
            self._space = (self._version, free_space(self._free_mask))
        return self._space[1]

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
    def allocate(self, count: int, run: bool | None = None) -> list[int]:
        """Hand out ``count`` blocks, evicting cached ones if needed.

        A long allocation (``CONTIGUOUS_MIN_BLOCKS``+), or any with ``run=True``, gets one run of
        consecutive ids whenever a free run that long exists, else the fewest runs possible
        (``kv/placement.py``); a short one, or any with ``run=False``, takes the free list's head:
        uncached blocks first, then the least recently used cached ones. (``run=True``: host-tier
        modules landing in one copy per layer, ``kv/landing.py``; ``run=False``: the sliding pages
        of a few blocks, many to a block, which no kernel reads as a run.)
        """
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        if run is not False and (count >= CONTIGUOUS_MIN_BLOCKS or (run and count > 1)):
            start = best_window(self._free_mask, self._stamp, count, self._scratch)
            if start is not None:
                out = list(range(start, start + count))
            else:
                self.scattered_allocations += count >= CONTIGUOUS_MIN_BLOCKS
                out = fewest_runs(self._free_mask, count)
            before = self.evictions
            for b in out:
                del self._free[b]
            self._take(out)
            self.run_evictions += self.evictions - before
            return out
        out = [self._free.popitem(last=False)[0] for _ in range(count)]
        self._take(out)
        return out

    def _take(self, blocks: list[int]) -> None:
        """Hold blocks just taken off the free list: evict their index entries, ref count 1."""
        evicted: list[tuple[int, bytes]] = []
        digest_of, counts = self._digest_of, self.ref_counts
        for block in blocks:
            digest = digest_of.pop(block, None)
            if digest is not None:
                del self._block_of[digest]
                self.evictions += 1
                evicted.append((block, digest))
                if self.cache_events is not None:
                    self.cache_events.removed(digest)
            counts[block] = 1
        self._mark_held(blocks)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    def _mark_held(self, blocks: Sequence[int]) -> None:
        """Blocks just taken off the free list: not free, no recency stamp."""
        if len(blocks) == 1:  # a decode step's new block: scalar stores are ~10x cheaper than a list's
            (b,) = blocks
            self._free_mask[b] = False
            self._stamp[b] = 0
        elif blocks:
            self._free_mask[blocks] = False
            self._stamp[blocks] = 0
        else:
            return
        self._version += 1

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block (a cache hit, a fork, a pin)."""
        taken = []
        try:
            for b in blocks:
                if self.ref_counts[b] == 0:
                    if b not in self._free:
                        raise RuntimeError(f"block {b} has no holder but is not free")
                    del self._free[b]
                    taken.append(b)
                self.ref_counts[b] += 1
        finally:
            self._mark_held(taken)

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
            free, digest_of, mask = self._free, self._digest_of, self._free_mask
            cached = []
            for b in emptied:  # in release order
                free[b] = None
                if b in digest_of:
                    cached.append(b)
                else:
                    free.move_to_end(b, last=False)  # nothing cached: reuse it first
            if len(emptied) == 1:
                mask[emptied[0]] = True
            elif emptied:
                mask[emptied] = True
            if emptied:
                self._restamp(cached)
                self._version += 1

    def register(self, block: int, digest: bytes) -> None:
        """Put a full, held block in the prefix index (first writer of a digest wins)."""
        if block in self._digest_of or digest in self._block_of:
            return
        self._digest_of[block] = digest
        self._block_of[digest] = block
        if self.cache_events is not None:
            self.cache_events.added(digest)

    def forget_unheld(self) -> int:
        """Take every block nobody holds out of the prefix index (a prefix-cache reset): they stay free,
        uncached, and are handed out first. Held blocks keep their entries. Returns how many left."""
        forgotten = [b for b in self._free if b in self._digest_of]
        for b in reversed(forgotten):  # in LRU order at the free list's head, like other uncached blocks
            digest = self._digest_of.pop(b)
            del self._block_of[digest]
            self._free.move_to_end(b, last=False)
            if self.cache_events is not None:
                self.cache_events.removed(digest)
        if forgotten:
            self._stamp[forgotten] = 0
            self._version += 1
        return len(forgotten)

    def cached_digests(self) -> list[bytes]:
        """Every digest in the prefix index now (a router's snapshot of this pool)."""
        return list(self._block_of)

    def touch(self, blocks: Sequence[int]) -> None:
        """Mark free cached blocks as recently used (a lookup that found them)."""
        moved = []
        for b in blocks:
            if b in self._free and b in self._digest_of:  # an uncached block has nothing to keep
                self._free.move_to_end(b)
                moved.append(b)
        self._restamp(moved)

    def _restamp(self, blocks: list[int]) -> None:
        """Free cached blocks just put at the LRU end, oldest first: the youngest stamps, in order."""
        if len(blocks) == 1:
            self._clock += 1
            self._stamp[blocks[0]] = self._clock
        elif blocks:
            self._stamp[blocks] = np.arange(self._clock + 1, self._clock + 1 + len(blocks))
            self._clock += len(blocks)

    def check_integrity(self) -> None:
        """Raise if ref counts, the free list and the index disagree (tests call this)."""
        for b in range(self.num_blocks):
            if (self.ref_counts[b] == 0) != (b in self._free):
                raise AssertionError(f"block {b}: ref {self.ref_counts[b]}, free={b in self._free}")
            if self._free_mask[b] != (b in self._free):
                raise AssertionError(f"block {b}: free mark is stale")
            if (self._stamp[b] != 0) != (b in self._free and b in self._digest_of):
                raise AssertionError(f"block {b}: recency stamp {self._stamp[b]} is stale")
        stamps = [int(self._stamp[b]) for b in self._free if b in self._digest_of]
        if stamps != sorted(stamps) or len(set(stamps)) != len(stamps):
            raise AssertionError("recency stamps do not follow the free list's LRU order")
        for d, b in self._block_of.items():
            if self._digest_of.get(b) != d:
                raise AssertionError(f"index entry for block {b} is inconsistent")
