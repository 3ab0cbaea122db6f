"""Sequences' block tables over the block pool: prefix-cache matching, slot reservation, copy-on-write.

Every change to a sequence's ``block_table`` goes through this class, which also keeps a numpy mirror
of all the tables (one row per sequence holding blocks): ``block_tables_np`` gathers a step's batch
from it with one numpy index, where turning the batch's lists into an array would cost ~20 ns per
entry every step (1-2 ms at B=256 with 4K-token sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prefixserve.kv.block_pool import CONTIGUOUS_MIN_BLOCKS, BlockPool, chain_digests
from prefixserve.kv.state_slots import StateSlots
from prefixserve.scheduler.sliding_pages import SlidingPages
from prefixserve.sequence import PLACEHOLDER_TOKEN, Request, Sequence


class RowKeeper(Protocol):
    """What keeps per-block results of prompt rows (prompt logprobs, mean pooling: the engine's
    output rules, ``engine/output_rules.py``), as a prefix-cache hit asks it."""

    def wants(self, req: Request) -> bool:
        """Does ``req`` need every prompt row's result?"""

    def known_blocks(self, seq: Sequence, digests: list[bytes]) -> int:
        """How many of the leading blocks ``digests`` have their results kept."""

    def seed(self, seq: Sequence, num_blocks: int) -> int:
        """Take a hit of ``num_blocks`` blocks; returns the hit rows to compute again."""


@dataclass(frozen=True, slots=True)
class BlockManagerHooks:
    """The engine's hooks, given at construction.

    ``restore``: the host tier of the prefix cache (``kv/prefix_spill.py``), digests -> fresh blocks
    holding their KV (held once); None: no host tier; ``host_blocks`` counts what it would restore.
    ``row_keepers``: requests that need every prompt row's result (prompt logprobs, mean pooling) hit
    only blocks whose results are kept: the first keeper that ``wants(req)`` says how many
    (``known_blocks(seq, digests)``) and takes the hit (``seed(seq, blocks)``, returning the hit rows
    to compute again); engine/block_store.py."""

    restore: Callable[[Seq[bytes]], list[int]] | None = None
    row_keepers: tuple[RowKeeper, ...] = ()
    # with ``restore``: how many of the leading digests ``restore`` would give back now (a hybrid's
    # hit is cut to a snapshot before anything is restored)
    host_blocks: Callable[[Seq[bytes]], int] | None = None


class BlockManager:
    """``sliding``: the sliding layer groups' pages under the freeing KV layout (``kv/layout.py``),
    taken, shared, indexed and given back beside each sequence's blocks; None: every layer reads the
    block table's pages. ``hooks``: the engine's (``BlockManagerHooks``), fixed for its life.
    ``states``: a linear-attention hybrid's state slots, held beside each sequence's blocks (taken at
    its first step, copied on a fork, given back when it is freed); None for other models."""

    def __init__(
        self,
        pool: BlockPool,
        enable_prefix_caching: bool = True,
        sliding: SlidingPages | None = None,
        *,
        hooks: BlockManagerHooks | None = None,
        states: StateSlots | None = None,
    ) -> None:
        self.pool = pool
        self.states = states
        self.sliding = sliding
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hooks = hooks if hooks is not None else BlockManagerHooks()
        self.restored_tokens = 0  # prompt tokens the host tier (``hooks.restore``) gave back
        # numpy mirror of the block tables: row ``_rows[seq]`` holds ``seq.block_table``, 0 after it
        self._rows: dict[Sequence, int] = {}
        self._free_rows: list[int] = list(range(15, -1, -1))  # popped lowest first
        self._table = np.zeros((16, 64), dtype=np.int32)  # [rows, width], grown by doubling
        self._lens = np.zeros(16, dtype=np.int64)  # [rows] len(block_table) of each row's sequence

    # the hooks, read-only: given at construction, never assigned afterwards
    @property
    def hooks(self) -> BlockManagerHooks:
        return self._hooks

    @property
    def restore(self) -> Callable[[Seq[bytes]], list[int]] | None:
        return self._hooks.restore

    @property
    def row_keepers(self) -> tuple[RowKeeper, ...]:
        return self._hooks.row_keepers

    @property
    def host_blocks(self) -> Callable[[Seq[bytes]], int] | None:
        return self._hooks.host_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def digests(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Digests of the first ``num_full_blocks`` blocks, extending the ones already known."""
        return self._digests(seq, num_full_blocks)[:num_full_blocks]

    def _digests(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """The sequence's own digest list, extended to at least ``num_full_blocks`` (not a copy)."""
        digests = seq.block_digests
        done = len(digests)
        if done < num_full_blocks:
            lo, hi = done * self.block_size, num_full_blocks * self.block_size
            parent = digests[-1] if digests else self.pool.root  # the KV format's root
            ids, places = seq.token_ids[lo:hi], seq.positions[lo:hi]
            req = seq.request
            public = req.public_tokens // self.block_size - done  # blocks wholly public, from here on
            digests += chain_digests(parent, ids, places, req.cache_salt, self.block_size, public)
        return digests

    def cacheable_blocks(self, seq: Sequence) -> int:
        """Full blocks a prefix-cache hit may cover: one token is always left to compute (its logits)."""
        return (seq.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0

    def match_prefix(self, seq: Sequence) -> int:
        """Take the request's module blocks, then every cached full block of the tokens after them;
        returns the prompt tokens found (a module block's holes not counted)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        req = seq.request
        modules = req.modules.blocks if req.modules is not None else []
        uncounted = req.modules.uncounted_tokens if req.modules is not None else 0
        if modules:  # Prompt Cache: the module blocks lead the table, computed, never indexed
            self.pool.acquire(modules)
            seq.block_table = list(modules)
            self._mirror(seq, 0, modules)
            seq.num_indexed_blocks = len(modules)
            seq.num_computed_tokens = len(modules) * self.block_size
        if not self.enable_prefix_caching:
            return seq.num_computed_tokens - uncounted if modules else 0
        n = self.cacheable_blocks(seq)
        start = len(modules)
        digests = self._digests(seq, n)
        keeper = self._keeper(seq)
        if keeper is not None:
            # its hit rows may be computed again, earlier than the hit's window tail: no hit under
            # the freeing layout, whose tail pages are all a hit brings
            n = start if self.sliding is not None else keeper.known_blocks(seq, digests[:n])
        if keeper is not None and self.states is not None:  # its hit rows recomputed: not from a state
            n = start
        hits = self.pool.lookup(digests[start:n])
        restore = self._hooks.restore
        if self.states is not None:  # a hybrid resumes from its linear layers' last snapshot in the hit
            reach = start + len(hits)
            if restore is not None:  # and the hit may go on in host memory
                assert self.host_blocks is not None
                reach += self.host_blocks(digests[reach:n])
            cut = max(start, self.states.snapshot_prefix(digests, reach, self.block_size))
            hits, n = hits[: cut - start], min(n, cut)
        if self.sliding is not None:  # no module blocks here (they need the plain layout)
            usable, tail = self.sliding.usable_hit(digests, len(hits))
            hits = hits[:usable]
        self.pool.acquire(hits)
        self.pool.touch(hits)
        if self.sliding is not None and hits:
            self.sliding.take_hit(seq, tail, len(hits))
        if restore is not None and start + len(hits) < n:  # go on in host memory
            more = restore(digests[start + len(hits) : n])
            if self.states is not None and start + len(hits) + len(more) < n:
                # fewer came back than counted (acquiring the device hits took free blocks): cut
                # again to the last snapshot within what is held, the rest given back
                held = hits + more
                keep = max(start, self.states.snapshot_prefix(digests, start + len(held), self.block_size))
                self.pool.release(held[keep - start :])
                more = held[len(hits) : keep - start]
                hits = held[: min(len(hits), keep - start)]
            self.restored_tokens += len(more) * self.block_size
            hits = hits + more
        seq.block_table += hits
        self._mirror(seq, start, hits)
        seq.num_indexed_blocks = start + len(hits)
        seq.num_computed_tokens = (start + len(hits)) * self.block_size
        if self.states is not None and hits:
            self.states.restore(seq, digests[start + len(hits) - 1])
        if keeper is not None and hits:
            seq.num_computed_tokens -= keeper.seed(seq, len(hits))
        return seq.num_computed_tokens - (uncounted if modules else 0)

    def reserve(self, seq: Sequence, upto_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Make room for KV up to ``upto_tokens``; copy-on-write the block being written if shared.

        A long prompt's first chunk takes the blocks of every token known (the whole prompt) when
        the pool has them free: one allocation is one run of consecutive ids (``kv/placement.py``),
        where chunk-by-chunk allocations would each land in a run of their own, and one break in a
        shared segment costs the GPU kernels their whole-tile reads. Returns False (and changes
        nothing) if the pool is short of blocks.
        """
        table = seq.block_table
        upto_blocks = -(-upto_tokens // self.block_size)
        new_blocks = upto_blocks - len(table)
        write_block = seq.num_computed_tokens // self.block_size
        cow = write_block < len(table) and self.pool.ref_counts[table[write_block]] > 1
        sliding = self.sliding
        pages = sliding.pages_to_reserve(seq, upto_blocks) if sliding is not None else 0
        if new_blocks <= 0 and not cow and not pages:
            return True  # a decode step inside its last block: nothing to do
        if cow and sliding is not None:
            pages += len(sliding.shared_pages(seq, write_block))
        new_blocks = max(0, new_blocks)
        if new_blocks + int(cow) + pages > self.pool.num_free:
            return False
        if new_blocks:
            whole = -(-len(seq.token_ids) // self.block_size) - len(table)
            room = self.pool.num_free - int(cow) - pages
            if whole >= CONTIGUOUS_MIN_BLOCKS and new_blocks < whole <= room:
                new_blocks = whole
        if cow:
            old = table[write_block]
            (fresh,) = self.pool.allocate(1)
            copies.append((old, fresh))
            table[write_block] = fresh
            self._mirror(seq, write_block, (fresh,))
            self.pool.release([old])
            if sliding is not None:
                sliding.copy_on_write(seq, write_block, copies)
        if new_blocks:
            start = len(table)
            table.extend(self.pool.allocate(new_blocks))
            self._mirror(seq, start, table[start:])
        if sliding is not None:
            sliding.allocate(seq, upto_blocks)
        return True

    def register_computed(self, seq: Sequence, settled: int | None = None) -> None:
        """Index every block that is now full of computed KV (prompt and generated tokens alike).

        ``settled``: how many leading tokens are known on the host (the rest are placeholders for
        tokens still on the device); a block is indexed once its tokens are computed and known.
        If another sequence already registered the same digest (requests with a common prompt
        computed it side by side), switch to that block and free ours: the two hold the same KV,
        and holding one block is what lets attention read it once for both.
        """
        computed = seq.num_computed_tokens if settled is None else min(seq.num_computed_tokens, settled)
        if self.enable_prefix_caching:
            self._index(seq, computed)
        if self.sliding is not None:  # after indexing: pages given back stay cached for later hits
            self.sliding.release_behind(seq, computed)

    def _index(self, seq: Sequence, computed: int) -> None:
        full = computed // self.block_size
        if self.states is not None:  # a hybrid's snapshots in its output, now that their tokens are known
            bs = self.block_size
            self.states.resolve(seq, full * bs, lambda end: self._digests(seq, end // bs)[end // bs - 1])
        start = seq.num_indexed_blocks
        if full <= start:
            return  # no block filled up since the last call (most decode steps)
        digests = self._digests(seq, full)
        table = seq.block_table
        pool, sliding = self.pool, self.sliding
        for i in range(start, full):
            own = table[i]
            existing = pool.cached_block(digests[i])
            if existing is not None and existing != own:
                pool.acquire([existing])
                pool.release([own])
                table[i] = existing
                self._mirror(seq, i, (existing,))
            else:
                pool.register(own, digests[i])
            if sliding is not None:
                sliding.register(seq, i, digests[i])
        seq.num_indexed_blocks = full

    def is_cached(self, digest: bytes) -> bool:
        return self.pool.cached_block(digest) is not None

    def can_hit(self, seq: Sequence, digest: bytes) -> bool:
        """Could a prefix-cache hit of ``seq`` take this block now: cached, and where the request
        needs every prompt row's result, that result kept (``row_keepers``)?"""
        if not self.is_cached(digest):
            return False
        keeper = self._keeper(seq)
        return keeper is None or keeper.known_blocks(seq, [digest]) == 1

    def keeps_for(self, seq: Sequence, holder: Sequence) -> bool:
        """Does ``holder``, computing a prefix ``seq`` shares, keep the row results ``seq`` needs?"""
        keeper = self._keeper(seq)
        return keeper is not None and keeper.wants(holder.request)

    def _keeper(self, seq: Sequence) -> RowKeeper | None:
        """The row keeper a prefix-cache hit of ``seq`` asks (none for a Prompt Cache prompt)."""
        if seq.request.modules is not None and seq.request.modules.blocks:
            return None
        return next((k for k in self._hooks.row_keepers if k.wants(seq.request)), None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's blocks by reference (n samples share the prompt)."""
        self.pool.acquire(parent.block_table)
        child.block_table = list(parent.block_table)
        self._mirror(child, 0, child.block_table)
        child.block_digests = list(parent.block_digests)
        child.num_indexed_blocks = parent.num_indexed_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        if self.sliding is not None:
            self.sliding.fork(parent, child)
        if self.states is not None:
            self.states.fork(parent, child)

    def snapshot_rows(self, seq: Sequence, computed: int, tokens: int) -> list[tuple[int, int]]:
        """A hybrid's prefix snapshots that ``seq``'s chunk of ``tokens`` after ``computed`` takes:
        (rows into the chunk, snapshot slot) at the chunk's last multiple of ``every_tokens``, at
        the multiples of ``spacing`` before it, and at the last multiple before each point where
        other prompts are known to leave this one (``StateSlots.mark``: a batch group's prefix; the
        end of a salted prompt's public part), those not snapshotted yet. One whose last token is
        still on the device (launched ahead, a step feeds it before it arrives) is reserved and named
        once it is known: ``StateSlots.resolve``, from ``_index``."""
        states = self.states
        if states is None or not self.enable_prefix_caching or not states.snapshots:
            return []
        every, bs = states.every_tokens, self.block_size
        last = (computed + tokens) // every * every
        marked = {m // every * every for m in states.marks(seq)}
        if seq.request.public_tokens:
            marked.add(seq.request.public_tokens // every * every)
        out = []
        for end in range((computed // every + 1) * every, last + 1, every):
            spaced = end % states.spacing == 0 or end in marked
            if end != last and not spaced:
                continue
            if seq.token_ids[end - 1] == PLACEHOLDER_TOKEN:  # still on the device (launch-ahead)
                slot = states.reserve(seq, end, spaced)
            else:
                digest = self._digests(seq, end // bs)[end // bs - 1]
                slot = states.new_snapshot(digest, seq, spaced, end > seq.num_prompt_tokens)
            if slot is not None:
                out.append((end - computed, slot))
        return out

    def step_failed(self) -> None:
        """A launch failed: a hybrid's snapshots that step was to write are given up."""
        if self.states is not None:
            self.states.forget_fresh()

    def free(self, seq: Sequence) -> None:
        if self.sliding is not None:
            self.sliding.free(seq)
        if self.states is not None:  # preempted: it recomputes from token 0, from zero states
            self.states.free(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        row = self._rows.pop(seq, None)
        if row is not None:
            self._table[row, : self._lens[row]] = 0
            self._lens[row] = 0
            self._free_rows.append(row)
        seq.num_indexed_blocks = 0
        seq.num_computed_tokens = 0

    # ---- the numpy mirror of the block tables ------------------------------------------------------
    def block_tables_np(self, seqs: list[Sequence], seq_lens: list[int]) -> np.ndarray:
        """Block tables of a batch as one [S, W] int32 array (what ``build_metadata`` takes).

        Row s holds the first ``ceil(seq_lens[s] / block_size)`` blocks of ``seqs[s]`` and 0 after
        them; W is the most blocks any row needs (at least 1). Equal to the zero-padded array of
        ``[seq.block_table[:blocks_needed(seq_len)] ...]``, without a Python loop over blocks.
        """
        rows_of = self._rows
        rows = np.fromiter((rows_of.get(s, -1) for s in seqs), dtype=np.intp, count=len(seqs))
        need = -(-np.asarray(seq_lens, dtype=np.int64) // self.block_size)  # [S]
        width = max(int(need.max(initial=0)), 1)
        have = np.where(rows >= 0, self._lens[rows], 0)
        short = np.flatnonzero(have < need)
        if short.size:
            i = int(short[0])
            raise ValueError(f"sequence {seqs[i].seq_id} holds {have[i]} blocks, needs {need[i]}")
        if width > self._table.shape[1]:  # only when every row needs no block past its length: zeros
            self._grow(self._table.shape[0], width)
        out = self._table[rows, :width]  # [S, W] copy
        if (have > need).any():  # a table longer than its tokens need: cut it
            out[np.arange(width) >= need[:, None]] = 0
        if (rows < 0).any():  # sequences holding no block (and needing none)
            out[rows < 0] = 0
        return out

    def group_tables_np(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
        """The sliding groups' pages of the batch's blocks ([R, S, K] from block base[s] on,
        ``SlidingPages.tables``), or None (the plain layout)."""
        return self.sliding.tables(seqs) if self.sliding is not None else None

    def pages_for(self, num_tokens: int) -> int:
        """Pool pages a sequence of ``num_tokens`` holds at most (its blocks, and the sliding pages of
        the blocks its window reaches)."""
        blocks = self.blocks_needed(num_tokens)
        if self.sliding is None:
            return blocks
        window_blocks = -(-self.sliding.window // self.block_size) + 1
        return blocks + self.sliding.groups * min(blocks, window_blocks)

    def max_tokens(self, pages: int) -> int:
        """The longest sequence ``pages`` pool pages can hold (``pages_for`` inverted)."""
        if self.sliding is None:
            return pages * self.block_size
        window_blocks = -(-self.sliding.window // self.block_size) + 1
        blocks = max(pages - self.sliding.groups * window_blocks, pages // (1 + self.sliding.groups))
        return blocks * self.block_size

    def hold_sliding_tail(self, digests: list[bytes]) -> list[int]:
        """A pin's extra references: the sliding pages a hit of all of ``digests`` needs ([] if none)."""
        return self.sliding.hold_tail(digests) if self.sliding is not None else []

    def check_tables(self) -> None:
        """Raise if the mirror disagrees with any sequence's block table (tests call this)."""
        for seq, row in self._rows.items():
            n = len(seq.block_table)
            if self._lens[row] != n or self._table[row, :n].tolist() != seq.block_table:
                raise AssertionError(f"mirror row {row} != block table of sequence {seq.seq_id}")
            if self._table[row, n:].any():
                raise AssertionError(f"mirror row {row} has blocks past sequence {seq.seq_id}'s table")
        free = set(range(self._table.shape[0])) - set(self._rows.values())
        if self._table[sorted(free)].any() or self._lens[sorted(free)].any():
            raise AssertionError("a free mirror row holds blocks")

    def _mirror(self, seq: Sequence, start: int, blocks: list[int] | tuple[int, ...]) -> None:
        """Write ``blocks`` at ``start`` of ``seq``'s row (after the same change to its block_table)."""
        row = self._rows.get(seq)
        if row is None:
            if not blocks:
                return  # still no block: no row needed
            if not self._free_rows:
                self._grow(2 * self._table.shape[0], self._table.shape[1])
            row = self._rows[seq] = self._free_rows.pop()
        end = start + len(blocks)
        if end > self._table.shape[1]:
            self._grow(self._table.shape[0], max(end, 2 * self._table.shape[1]))
        if len(blocks) == 1:
            self._table[row, start] = blocks[0]
        elif blocks:
            self._table[row, start:end] = blocks
        old = self._lens[row]
        self._lens[row] = len(seq.block_table)
        if old > self._lens[row]:  # a shorter table replaced a longer one (a fork onto a used child)
            self._table[row, self._lens[row] : old] = 0

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self._table.shape
        table = np.zeros((rows, width), dtype=np.int32)
        table[:old_rows, :old_width] = self._table
        self._table = table
        if rows > old_rows:
            self._lens = np.concatenate((self._lens, np.zeros(rows - old_rows, dtype=np.int64)))
            self._free_rows.extend(range(rows - 1, old_rows - 1, -1))
