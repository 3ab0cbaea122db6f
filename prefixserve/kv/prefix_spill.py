"""Prefix-cache blocks evicted from the device pool spill to host memory and come back on a hit.

Without it, a cached block whose slot is needed is gone, and the next request that starts with the
same tokens computes them again. With it, the block's KV rows (every layer) are copied to a
``HostTier`` entry keyed by the block's digest as the pool evicts it (``BlockPool.on_evict``, called
before anything writes the block), and a prefix lookup that stops on the device continues in host
memory: the following blocks found there are copied into fresh blocks and indexed again. The host
tier is the one Prompt Cache modules use, so both share its byte budget and its LRU order.

Host memory: a ``SlabPool`` of pinned slots, one block each, as many as the host tier's budget holds
(allocated when the engine starts on CUDA, never freed): an eviction allocates nothing. A new pinned
buffer per eviction (256 MiB for an 8B model's 2K-token document) made the spill slower than
recomputing on an H100 (``benchmarks/probes/spill_cost.py``). An entry leaving the tier gives its slot
back (``HostTier.on_drop``); one restored gives it back after the copy that reads it.

No host wait on either side. Evicting: room made in the host tier first (its oldest entries' slots
come back), one gather of all the evicted blocks on the current stream (block-major: each block
contiguous across its layers), one D2H copy per run of consecutive slots on the copy stream
(``kv/transfer.py``), one event for all; nothing reads a slot on the host. Restoring: the blocks found
are taken out of the tier first (so spilling the blocks their allocation evicts pushes out nothing
else: reading an entry must not make it the newest, or the next ones asked for are the ones pushed
out), copied to the device in one copy per run of slots on the copy stream, their slots go back with
that copy's event, and the scatter on the current stream waits on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.kv.slab_pool import SlabPool
from prefixserve.kv.tiers import HostTier
from prefixserve.kv.transfer import Ready, copy_stream


def _key(digest: bytes) -> str:
    return "p-" + digest.hex()


class PrefixSpill:
    """The host tier of the automatic prefix cache."""

    def __init__(self, pool: BlockPool, kv: KVCache, host: HostTier) -> None:
        self.pool, self.kv, self.host = pool, kv, host
        self.spilled_blocks = 0
        self.restored_blocks = 0
        layers, two, _, bs, _, dim = kv.tensor.shape
        shape = (layers, two, bs, kv.total_kv_heads, dim)
        cuda = kv.tensor.device.type == "cuda"
        blocks = host.capacity_bytes // (math.prod(shape) * kv.tensor.element_size())
        self.slots = SlabPool(shape, kv.tensor.dtype, blocks, pin=cuda, prealloc=cuda)
        self._slot_of: dict[str, int] = {}
        pool.on_evict = self.save
        host.on_drop = self._dropped

    @property
    def host_capacity_blocks(self) -> int:
        """Blocks the host tier holds at most (its byte budget over a block's bytes)."""
        return min(self.slots.capacity, self.host.capacity_bytes // self.slots.slot_bytes)

    def _dropped(self, key: str, ready: Ready | None) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self.slots.release([slot], ready)

    def forget(self) -> int:
        """Drop every prefix block held in host memory (a prefix-cache reset; Prompt Cache modules in
        the same tier stay); their slots come back once any copy still filling them is done."""
        keys = list(self._slot_of)  # the tier's prefix entries: a dropped one gives its slot back at once
        for key in keys:
            taken = self.host.take(key)
            ready = taken[1] if taken is not None else None
            self.slots.release([self._slot_of.pop(key)], ready)
        return len(keys)

    def save(self, evicted: list[tuple[int, bytes]]) -> None:
        """Copy evicted blocks' KV to host slots: one gather, one copy per slot run, no wait."""
        fit = self.host_capacity_blocks
        evicted = evicted[max(0, len(evicted) - fit) :] if fit else []  # the newest, if not all fit
        if not evicted:
            return
        copier = copy_stream(self.kv.tensor.device)
        self.host.make_room(len(evicted) * self.slots.slot_bytes, wait=False)  # their slots come back
        slots, waits = self.slots.acquire(len(evicted))
        device = self.kv.gather_blocks_device([b for b, _ in evicted])  # [n, L, 2, bs, H, D]
        for start, run in self.slots.runs(slots):
            copier.copy_out(run, device[start : start + run.shape[0]], waits)
        ready = copier.record()
        for slot, (_, digest) in zip(slots, evicted, strict=True):
            key = _key(digest)
            self.host.put(key, self.slots.view(slot), ready=ready)  # a stale entry of the key is dropped
            self._slot_of[key] = slot
        self.spilled_blocks += len(evicted)

    def available(self, digests: Sequence[bytes]) -> int:
        """How many of the leading ``digests`` ``restore`` would give back now."""
        count = 0
        for digest in digests[: self.pool.num_free]:
            if _key(digest) not in self.host:
                break
            count += 1
        return count

    def restore(self, digests: Sequence[bytes]) -> list[int]:
        """The leading ``digests`` found in host memory, copied into fresh indexed blocks (held once)."""
        keys = [_key(digest) for digest in digests[: self.available(digests)]]
        if not keys:
            return []
        parts = []
        for key in keys:
            packed, _ready = self.host.take(key)  # type: ignore[misc]  # the D2H is on the copy stream too
            parts.append(packed)
        copier = copy_stream(self.kv.tensor.device)
        stacked, ready = copier.to_device_blocks_async(parts)  # one H2D copy per run of slots
        self.slots.release([self._slot_of.pop(key) for key in keys], ready)
        blocks = self.pool.allocate(len(keys))  # may evict (and spill) other blocks first
        stacked = copier.hand_over(stacked, ready)
        layers, two, bs, heads, dim = stacked.shape[1:]  # [n, L, 2, bs, H, D] -> [L, 2, n * bs, H, D]
        rows = stacked.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, len(keys) * bs, heads, dim)
        self.kv.scatter_rows(blocks, rows)
        for block, digest in zip(blocks, digests[: len(keys)], strict=True):
            self.pool.register(block, digest)
        self.restored_blocks += len(keys)
        return blocks
