"""Prefix-cache blocks evicted from the device pool spill to host memory and come back on a hit.

Without it, a cached block whose slot is needed is gone, and the next request that starts with the
same tokens computes them again. With it, the block's KV rows (every layer) are copied to a
``HostTier`` entry keyed by the block's digest as the pool evicts it (``BlockPool.on_evict``, called
before anything writes the block), and a prefix lookup that stops on the device continues in host
memory: the following blocks found there are copied into fresh blocks (one copy on the device's
stream, ahead of the step that reads them) and indexed again. The host tier is the one Prompt Cache
modules use, so both share its byte budget and its LRU order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.kv.tiers import HostTier


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
        """Copy evicted blocks' KV to host memory (one gather for all of them)."""
        bs = self.kv.block_size
        blocks = [b for b, _ in evicted]
        packed = self.kv.gather_rows(blocks, len(blocks) * bs)  # [L, 2, n * bs, H, D]
        for i, (_, digest) in enumerate(evicted):
            self.host.put(_key(digest), packed[:, :, i * bs : (i + 1) * bs].clone())
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
        self.kv.scatter_rows(blocks, torch.cat([p for _, p in found], dim=2))
        for block, (digest, _) in zip(blocks, found, strict=True):
            self.pool.register(block, digest)
            self.host.pop(_key(digest))
        self.restored_blocks += len(found)
        return blocks
