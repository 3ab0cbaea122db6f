"""Where a Prompt Cache piece's KV lives, and how it moves: the GPU tier (blocks of the KV pool), host
memory and the disk store.

The GPU tier holds blocks (at most ``gpu_fraction`` of the pool); the least recently used piece
that no request holds moves to host memory (``kv/tiers.py``, an LRU under a byte budget), and from
there off the end; with a module store directory every piece
is also written to disk when encoded (checksummed; a corrupt entry is recomputed, never served).
A piece found in a lower tier is copied back into fresh blocks instead of being recomputed; from
host memory, a prompt's pieces are copied layer by layer, all of them per layer, and the prefill
that reads them waits per layer (``kv/landing.py``), so the copy overlaps it. Pieces moved to the
host together share one allocation (``_demote``) and a prompt's pieces come back together into one
run of blocks (``_bring_up``), so pieces used together land in one copy per layer and K or V.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.kv.tiers import DiskTier, HostGroup, HostTier, packed_nbytes
from prefixserve.promptcache.entries import ModuleEntry, NoRoom

Encode = Callable[[list[int], list[int], list[int]], None]  # (token ids, positions, blocks): fill blocks


class PieceTiers:
    """Encoded pieces (``entries``, by key) and their tiers; ``PromptModules`` adds schemas and
    requests."""

    def __init__(
        self,
        pool: BlockPool,
        kv: KVCache,
        encode: Encode,
        gpu_fraction: float,
        host_bytes: int,
        store_dir: str | Path | None,
    ) -> None:
        self.pool, self.kv, self.encode = pool, kv, encode
        self.block_size = pool.block_size
        self.gpu_blocks_limit = max(1, int(gpu_fraction * pool.num_blocks))
        self.host = HostTier(host_bytes)
        self.disk = DiskTier(store_dir) if store_dir is not None else None
        self.entries: OrderedDict[str, ModuleEntry] = OrderedDict()  # GPU-tier LRU order: oldest first
        self.module_rows = np.zeros(pool.num_blocks + 1, dtype=np.int32)  # [blocks] rows of module blocks
        self.num_marked = 0  # blocks with module rows (``active`` reads this every step)
        self.gpu_blocks = 0  # blocks the GPU tier holds
        self.counters: dict[str, int] = {
            "module_encodes_total": 0,
            "module_loads_host_total": 0,
            "module_loads_disk_total": 0,
            "module_evictions_gpu_total": 0,
        }

    def _bring_up(self, entries: list[ModuleEntry], issue: bool = True) -> None:
        """Put the KV of ``entries`` (none on the GPU) in blocks, in order, from one allocation: one run
        of consecutive blocks where the pool has one (``BlockPool.allocate``), so that pieces demoted
        together (``_demote``) and restored in the same order land in one copy per layer and K or V
        (``kv/landing.py``) instead of one per piece. ``issue``: their host-tier copies start as soon
        as all are queued, before the bookkeeping, which the copies do not need."""
        if not entries:
            return
        counts = [-(-entry.rows // self.block_size) for entry in entries]
        blocks = self._allocate(sum(counts))
        filled: list[tuple[ModuleEntry, list[int]]] = []
        start = 0
        try:
            for entry, count in zip(entries, counts, strict=True):
                mine = blocks[start : start + count]
                self._fill(entry, mine)
                filled.append((entry, mine))
                start += count
            if issue:
                self.kv.issue_layered()
        except BaseException:
            self.pool.release(blocks[start:])  # not filled: nobody's
            raise
        finally:
            for entry, mine in filled:  # the GPU tier holds what was filled, even if a later one failed
                self._mark_resident(entry, mine)

    def _mark_resident(self, entry: ModuleEntry, blocks: list[int]) -> None:
        """The GPU tier holds ``blocks`` for the piece from now on; their rows are marked."""
        entry.blocks = blocks
        self.gpu_blocks += len(blocks)
        self.num_marked += int(np.count_nonzero(self.module_rows[blocks] == 0))
        self.module_rows[blocks] = self.block_size
        self.module_rows[blocks[-1]] = entry.rows - (len(blocks) - 1) * self.block_size

    def _fill(self, entry: ModuleEntry, blocks: list[int]) -> None:
        """Put the piece's KV in ``blocks``: from host memory, from disk, or by encoding it."""
        found = self.host.get(entry.key)
        if found is not None:  # queued: lands layer by layer behind the prefill that reads it
            self.kv.scatter_rows_layered(blocks, found[0])
            self.counters["module_loads_host_total"] += 1
            return
        if self.disk is not None:  # read, checked and copied straight to the device (kv/tiers.py)
            found = self.disk.get(entry.key, self.kv.tensor.device)
            if found is not None and found[0].shape[2] == entry.rows:
                self.kv.scatter_rows(blocks, found[0])
                self.counters["module_loads_disk_total"] += 1
                return
        self.encode(entry.token_ids, entry.positions, blocks)
        self.counters["module_encodes_total"] += 1
        if self.disk is not None:
            self.disk.put(entry.key, self.kv.gather_rows(blocks, entry.rows), {"rows": str(entry.rows)})

    def _allocate(self, count: int) -> list[int]:
        """Blocks for pieces, first moving least recently used pieces no request holds to the host."""
        victims: list[ModuleEntry] = []
        gpu, free = self.gpu_blocks, self.pool.num_free
        for entry in self.entries.values():
            if gpu + count <= self.gpu_blocks_limit and free >= count:
                break
            if self._movable(entry):
                assert entry.blocks is not None
                victims.append(entry)
                gpu -= len(entry.blocks)
                free += len(entry.blocks)  # held by the store alone: freed when it lets go
        self._demote(victims)
        if self.pool.num_free < count:
            raise NoRoom(
                f"the KV pool has no room for prompt modules of {count} blocks ({self.pool.num_free} free); "
                "add KV blocks or use fewer or shorter modules at once"
            )
        return self.pool.allocate(count, run=True)

    def _movable(self, entry: ModuleEntry) -> bool:
        """On the GPU, not kept there (pin=True), and held by nobody but the store."""
        blocks = entry.blocks
        held_elsewhere = blocks is None or any(self.pool.ref_counts[b] != 1 for b in blocks)
        return not entry.keep_on_gpu and not held_elsewhere

    def move_out(self, drop_host: bool = False) -> int:
        """Move every piece no request holds off the GPU (to host memory; ``drop_host``: out of it too,
        leaving the disk tier); returns the blocks given back. For benchmarks, operators that free the
        device, and a scheduler whose next sequence needs the blocks."""
        movable = [entry for entry in self.entries.values() if self._movable(entry)]
        freed = sum(len(entry.blocks or ()) for entry in movable)
        self._demote(movable)
        if drop_host:
            for entry in self.entries.values():
                self.host.pop(entry.key)
        return freed

    def _demote(self, entries: list[ModuleEntry]) -> None:
        """Move pieces' KV from their blocks to host memory (and so give the blocks back).

        In order (least recently used first: a prompt's pieces, used together, are neighbours in
        table order), up to a quarter of the host budget at a time (``_demote_together``). A group
        leaves the host tier's budget only when its last piece goes, so a larger one could push out
        more at a time than the room asked for."""
        kv = self.kv
        block_bytes = self.block_size * kv.tensor.shape[0] * 2 * kv.total_kv_heads * kv.tensor.shape[-1]
        block_bytes *= kv.tensor.element_size()
        limit = self.host.capacity_bytes // 4
        chunk: list[ModuleEntry] = []
        size = 0
        for entry in entries:
            assert entry.blocks is not None
            nbytes = len(entry.blocks) * block_bytes
            if chunk and size + nbytes > limit:
                self._demote_together(chunk)
                chunk, size = [], 0
            chunk.append(entry)
            size += nbytes
        if chunk:
            self._demote_together(chunk)

    def _demote_together(self, entries: list[ModuleEntry]) -> None:
        """One gather of the pieces' whole blocks and one copy, with no host wait, into one host
        allocation (a ``HostGroup``) where each piece's rows start on a block boundary. Restored
        together in this order into one run of blocks (``_bring_up``), they land in one copy per layer
        and K or V, the hole rows between them going into the holes (``kv/landing.py``)."""
        bs = self.block_size
        blocks = [b for entry in entries for b in entry.blocks or ()]
        packed, ready = self.kv.gather_rows_async(blocks, len(blocks) * bs)
        group = HostGroup(packed_nbytes(packed))
        start = 0
        for entry in entries:
            assert entry.blocks is not None
            rows = packed[:, :, start : start + entry.rows]
            start += len(entry.blocks) * bs
            self.host.put(entry.key, rows, {"rows": str(entry.rows)}, ready=ready, group=group)
            self.counters["module_evictions_gpu_total"] += 1
            self._drop_gpu(entry)

    def _drop_gpu(self, entry: ModuleEntry) -> None:
        """Give the piece's blocks back (the rows stay marked while a request still holds them)."""
        if entry.blocks is None:
            return
        blocks, entry.blocks = entry.blocks, None
        self.gpu_blocks -= len(blocks)
        self.release(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on module blocks (a request ending, or the GPU tier letting go); a block
        nobody holds any more is unmarked: a plain free block again."""
        self.pool.release(blocks)
        counts, rows = self.pool.ref_counts, self.module_rows
        for b in blocks:  # most are still held (by the store)
            if counts[b] == 0 and rows[b]:
                rows[b] = 0
                self.num_marked -= 1

    @property
    def active(self) -> bool:
        """Does any block carry module rows (otherwise the attention plan need not look)?"""
        return self.num_marked > 0


__all__ = ["Encode", "PieceTiers"]
