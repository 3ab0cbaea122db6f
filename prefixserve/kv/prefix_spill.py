"""Prefix-cache blocks evicted from the device pool spill to host memory and come back on a hit.

Without it, a cached block whose slot is needed is gone, and the next request that starts with the
same tokens computes them again. With it, the block's KV rows (every layer) are copied to a
``HostTier`` entry keyed by the block's digest as the pool evicts it (``BlockPool.on_evict``, called
before anything writes the block), and a prefix lookup that stops on the device continues in host
memory: the following blocks found there are copied into fresh blocks and indexed again. The host
tier is the one Prompt Cache modules use, so both share its byte budget and its LRU order.

No host wait on either side. Evicting: one gather of all the evicted blocks on the current stream
(block-major: each block contiguous across its layers), one D2H copy into one pinned buffer on the
copy stream (``kv/transfer.py``), and each block's host entry is its slice of that buffer carrying the
copy's event; nothing reads it on the host before that event. Restoring: the blocks found go to the
device in one copy per run of blocks that were evicted together, on the copy stream (ordered after
their D2H copies), and the scatter on the current stream waits on an event.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.kv.tiers import HostTier
from prefixserve.kv.transfer import copy_stream


def _key(digest: bytes) -> str:
    return "p-" + digest.hex()


class PrefixSpill:
    """The host tier of the automatic prefix cache."""

    def __init__(self, pool: BlockPool, kv: KVCache, host: HostTier) -> None:
        self.pool, self.kv, self.host = pool, kv, host
        self.spilled_blocks = 0
        self.restored_blocks = 0
        pool.on_evict = self.save

    def save(self, evicted: list[tuple[int, bytes]]) -> None:
        """Copy evicted blocks' KV to host memory: one gather and one copy for all of them, no wait."""
        host, ready = self.kv.gather_blocks([b for b, _ in evicted])  # [n, L, 2, bs, H, D], pinned
        for i, (_, digest) in enumerate(evicted):
            self.host.put(_key(digest), host[i], ready=ready)
        self.spilled_blocks += len(evicted)

    def restore(self, digests: Sequence[bytes]) -> list[int]:
        """The leading ``digests`` found in host memory, copied into fresh indexed blocks (held once)."""
        found = []
        for digest in digests:
            entry = self.host.get(_key(digest))
            if entry is None:
                break
            found.append((digest, entry[0]))
        found = found[: self.pool.num_free]
        if not found:
            return []
        blocks = self.pool.allocate(len(found))  # may evict (and spill) other blocks first
        stacked = copy_stream(self.kv.tensor.device).to_device_blocks([p for _, p in found])
        layers, two, bs, heads, dim = stacked.shape[1:]  # [n, L, 2, bs, H, D] -> [L, 2, n * bs, H, D]
        rows = stacked.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, len(found) * bs, heads, dim)
        self.kv.scatter_rows(blocks, rows)
        for block, (digest, _) in zip(blocks, found, strict=True):
            self.pool.register(block, digest)
            self.host.pop(_key(digest))
        self.restored_blocks += len(found)
        return blocks
