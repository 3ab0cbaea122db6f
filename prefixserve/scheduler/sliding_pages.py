"""The sliding layer groups' pages of each sequence, given back once every holder's window has passed.

Under the freeing layout (``kv/layout.py``) block j of a sequence is its block-table page plus one
page in each of the R sliding groups. The sliding pages come from the same ``BlockPool``, held,
shared and indexed like blocks: sequences that share block j share its sliding pages (a fork, a
prefix-cache hit, two sequences that computed the same block), and a computed block's sliding page
of group g is indexed under ``digest + bytes([g])``, so a page no sequence holds any more stays
cached until the pool needs it, as blocks do.

A sequence whose next query is at cache index p sees keys from ``p - window + 1`` on; its pages of
blocks wholly before that are released (``release_behind``): a page goes back to the pool when its
last holder releases it. A prefix-cache hit of n blocks needs the sliding pages of the hit's last
window; a hit whose tail pages were evicted is cut back to the longest prefix whose tail is cached
(``usable_hit``), and the rest is computed again. Pages are held in ``[first, upto)`` of a sequence's
blocks: ``first`` leading blocks released, ``upto`` blocks given pages so far (a long prompt's full
blocks may be taken ahead, its sliding pages chunk by chunk).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from prefixserve.kv.block_pool import CONTIGUOUS_MIN_BLOCKS, BlockPool
from prefixserve.sequence import Sequence


def group_digest(digest: bytes, group: int) -> bytes:
    """The index key of a block's page in sliding group ``group`` (never a block digest: one byte longer)."""
    return digest + bytes((group,))


@dataclass(slots=True)
class _Held:
    pages: np.ndarray  # [R, capacity] int32: page of block j in group g (0 where none is held)
    first: int = 0  # leading blocks whose pages are released
    upto: int = 0  # blocks given pages so far

    def grow(self, blocks: int) -> None:
        if blocks > self.pages.shape[1]:
            wider = np.zeros((self.pages.shape[0], max(blocks, 2 * self.pages.shape[1])), dtype=np.int32)
            wider[:, : self.pages.shape[1]] = self.pages
            self.pages = wider


class SlidingPages:
    def __init__(self, pool: BlockPool, groups: int, window: int) -> None:
        self.pool, self.groups, self.window = pool, groups, window
        self.block_size = pool.block_size
        self._held: dict[Sequence, _Held] = {}

    def first_needed(self, next_index: int) -> int:
        """The first block a query at cache index ``next_index`` or later can see."""
        return max(0, (next_index - self.window + 1) // self.block_size)

    def _state(self, seq: Sequence) -> _Held:
        held = self._held.get(seq)
        if held is None:
            held = self._held[seq] = _Held(np.zeros((self.groups, 8), dtype=np.int32))
        return held

    # ---- counting --------------------------------------------------------------------------------
    def pages_to_reserve(self, seq: Sequence, upto_blocks: int) -> int:
        """Sliding pages ``allocate(seq, upto_blocks)`` would take."""
        held = self._held.get(seq)
        start = max(held.upto if held else 0, self.first_needed(seq.num_computed_tokens))
        return self.groups * max(0, upto_blocks - start)

    def shared_pages(self, seq: Sequence, block: int) -> list[int]:
        """The sliding pages of ``block`` that another sequence also holds (copy-on-write)."""
        held = self._held.get(seq)
        if held is None or not held.first <= block < held.upto:
            return []
        return [int(p) for p in held.pages[:, block] if self.pool.ref_counts[p] > 1]

    # ---- taking pages ------------------------------------------------------------------------------
    def usable_hit(self, digests: Seq[bytes], hit: int) -> tuple[int, np.ndarray]:
        """The longest prefix of a ``hit``-block prefix-cache hit whose window tail has every sliding
        page cached (0..hit), and those pages ([R, tail blocks] int32, for ``take_hit``). Looked up
        from the hit's end down: the first block missing a page cuts the hit there."""
        cached, groups = self.pool.cached_block, self._range()
        found: dict[int, list[int]] = {}
        while hit > 0:
            lo = self.first_needed(hit * self.block_size)
            for j in range(hit - 1, lo - 1, -1):
                if j in found:
                    continue
                pages = [cached(group_digest(digests[j], g)) for g in groups]
                if None in pages:
                    hit = j
                    break
                found[j] = pages  # type: ignore[assignment]
            else:
                tail = [found[j] for j in range(lo, hit)]
                return hit, np.asarray(tail, dtype=np.int32).reshape(-1, self.groups).T
        return 0, np.zeros((self.groups, 0), dtype=np.int32)

    def take_hit(self, seq: Sequence, tail: np.ndarray, hit: int) -> None:
        """Hold the sliding pages of a hit's tail (``usable_hit``'s), one reference each."""
        held = self._state(seq)
        held.grow(hit)
        lo = hit - tail.shape[1]
        pages = tail.reshape(-1).tolist()
        self.pool.acquire(pages)
        self.pool.touch(pages)
        held.pages[:, lo:hit] = tail
        held.first, held.upto = lo, hit

    def allocate(self, seq: Sequence, upto_blocks: int) -> None:
        """Pages for blocks up to ``upto_blocks`` (the pool has them: ``pages_to_reserve`` was counted)."""
        held = self._state(seq)
        computed = seq.num_computed_tokens
        self.release_behind(seq, computed)
        start = max(held.upto, self.first_needed(computed))
        if start > held.upto:  # nothing held before ``start`` now: skip the blocks no query sees
            held.first = held.upto = start
        if upto_blocks <= start:
            return
        held.grow(upto_blocks)
        n = upto_blocks - start
        # a run per group where the blocks are many (a prompt's: its shared segments' TMA reads)
        pages = self.pool.allocate(n * self.groups, run=None if n >= CONTIGUOUS_MIN_BLOCKS else False)
        held.pages[:, start:upto_blocks] = np.asarray(pages, dtype=np.int32).reshape(self.groups, n)
        held.upto = upto_blocks

    def copy_on_write(self, seq: Sequence, block: int, copies: list[tuple[int, int]]) -> None:
        """Private copies of ``block``'s shared sliding pages (the block's page was copied too)."""
        held = self._held.get(seq)
        if held is None or not held.first <= block < held.upto:
            return
        for g in range(self.groups):
            old = int(held.pages[g, block])
            if self.pool.ref_counts[old] > 1:
                (fresh,) = self.pool.allocate(1)
                copies.append((old, fresh))
                held.pages[g, block] = fresh
                self.pool.release([old])

    def register(self, seq: Sequence, block: int, digest: bytes) -> None:
        """Index ``block``'s sliding pages under its digest, or switch to pages already indexed there."""
        held = self._held.get(seq)
        if held is None or not held.first <= block < held.upto:
            return  # released already (a window shorter than the lag of indexing)
        for g in range(self.groups):
            key = group_digest(digest, g + 1)
            own = int(held.pages[g, block])
            existing = self.pool.cached_block(key)
            if existing is not None and existing != own:
                self.pool.acquire([existing])
                self.pool.release([own])
                held.pages[g, block] = existing
            else:
                self.pool.register(own, key)

    def hold_tail(self, digests: Seq[bytes]) -> list[int]:
        """Take one more reference on the cached tail pages of a whole-prefix hit of ``digests`` (a
        pinned prompt's: every hit of it finds them); returns them, to release on unpinning."""
        lo = self.first_needed(len(digests) * self.block_size)
        pages = [
            self.pool.cached_block(group_digest(digests[j], g))
            for j in range(lo, len(digests))
            for g in self._range()
        ]
        if None in pages:
            raise RuntimeError("the pinned prompt's sliding pages were evicted before they were held")
        self.pool.acquire(pages)  # type: ignore[arg-type]
        return pages  # type: ignore[return-value]

    # ---- giving pages back -----------------------------------------------------------------------
    def release_behind(self, seq: Sequence, next_index: int) -> None:
        """Release the pages of blocks wholly behind the window of a query at ``next_index``."""
        held = self._held.get(seq)
        if held is None:
            return
        stop = min(self.first_needed(next_index), held.upto)
        if stop <= held.first:
            return
        self.pool.release(held.pages[:, held.first : stop].reshape(-1).tolist())
        held.pages[:, held.first : stop] = 0
        held.first = stop

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's held pages."""
        self.free(child)
        held = self._held.get(parent)
        if held is None:
            return
        live = held.pages[:, held.first : held.upto]
        self.pool.acquire(live.reshape(-1).tolist())
        self._held[child] = _Held(held.pages.copy(), held.first, held.upto)

    def free(self, seq: Sequence) -> None:
        held = self._held.pop(seq, None)
        if held is not None:
            self.pool.release(held.pages[:, held.first : held.upto].reshape(-1).tolist())

    # ---- the step's tables -------------------------------------------------------------------------
    def tables(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """([R, S, K] int32, [S] int64): each group's pages of each sequence's blocks from block
        ``base[s]`` on, its first held one (every block its queries' windows reach is held); K is the
        most blocks any of them holds. A window's columns only: at 16K tokens and a 1K window, 1/16
        of the block table."""
        held = [self._held.get(seq) for seq in seqs]
        width = max((h.upto - h.first for h in held if h is not None), default=1)
        out = np.zeros((self.groups, len(seqs), max(width, 1)), dtype=np.int32)
        base = np.zeros(len(seqs), dtype=np.int64)
        for s, h in enumerate(held):
            if h is not None:
                out[:, s, : h.upto - h.first] = h.pages[:, h.first : h.upto]
                base[s] = h.first
        return out, base

    def covered_tokens(self, seq: Sequence) -> int:
        """Tokens from the start that this sequence's sliding pages were taken for."""
        held = self._held.get(seq)
        return 0 if held is None else held.upto * self.block_size

    def held_pages(self, seq: Sequence) -> int:
        held = self._held.get(seq)
        return 0 if held is None else self.groups * (held.upto - held.first)

    def _range(self) -> range:
        return range(1, self.groups + 1)

    def check(self) -> None:
        """Raise if a held page has no reference (tests call this)."""
        for seq, held in self._held.items():
            for p in held.pages[:, held.first : held.upto].reshape(-1).tolist():
                if self.pool.ref_counts[p] < 1:
                    raise AssertionError(f"sequence {seq.seq_id} holds page {p}, which has no reference")


__all__ = ["SlidingPages", "group_digest"]
