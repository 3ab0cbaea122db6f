"""Bridges sequences and the block pool: prefix-cache matching, slot reservation, copy-on-write."""

from __future__ import annotations

from prefixserve.kv.block_pool import BlockPool, block_digest
from prefixserve.sequence import Sequence


class BlockManager:
    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def digests(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Digests of the first ``num_full_blocks`` blocks, extending the ones already known."""
        bs, salt = self.block_size, seq.request.cache_salt
        digests = seq.block_digests
        for i in range(len(digests), num_full_blocks):
            parent = digests[i - 1] if i else None
            lo, hi = i * bs, (i + 1) * bs
            digests.append(block_digest(parent, seq.token_ids[lo:hi], seq.positions[lo:hi], salt))
        return digests[:num_full_blocks]

    def cacheable_blocks(self, seq: Sequence) -> int:
        """Full blocks a prefix-cache hit may cover: one token is always left to compute (its logits)."""
        return (seq.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0

    def match_prefix(self, seq: Sequence) -> int:
        """Take every cached full block of ``seq``'s leading tokens; returns the tokens found."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        hits = self.pool.lookup(self.digests(seq, self.cacheable_blocks(seq)))
        self.pool.acquire(hits)
        self.pool.touch(hits)
        seq.block_table = list(hits)
        seq.num_indexed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def reserve(self, seq: Sequence, upto_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Make room for KV up to ``upto_tokens``; copy-on-write the block being written if shared.

        Returns False (and changes nothing) if the pool is short of blocks.
        """
        new_blocks = max(0, self.blocks_needed(upto_tokens) - len(seq.block_table))
        write_block = seq.num_computed_tokens // self.block_size
        cow = write_block < len(seq.block_table) and self.pool.ref_counts[seq.block_table[write_block]] > 1
        if new_blocks + int(cow) > self.pool.num_free:
            return False
        if cow:
            old = seq.block_table[write_block]
            (fresh,) = self.pool.allocate(1)
            copies.append((old, fresh))
            seq.block_table[write_block] = fresh
            self.pool.release([old])
        seq.block_table.extend(self.pool.allocate(new_blocks))
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Index every block that is now full of computed KV (prompt and generated tokens alike).

        If another sequence already registered the same digest (requests with a common prompt
        computed it side by side), switch to that block and free ours: the two hold the same KV,
        and holding one block is what lets attention read it once for both.
        """
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        digests = self.digests(seq, full)
        for i in range(seq.num_indexed_blocks, full):
            own = seq.block_table[i]
            existing = self.pool.lookup([digests[i]])
            if existing and existing[0] != own:
                self.pool.acquire(existing)
                self.pool.release([own])
                seq.block_table[i] = existing[0]
            else:
                self.pool.register(own, digests[i])
        seq.num_indexed_blocks = max(seq.num_indexed_blocks, full)

    def is_cached(self, digest: bytes) -> bool:
        return bool(self.pool.lookup([digest]))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's blocks by reference (n samples share the prompt)."""
        self.pool.acquire(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_digests = list(parent.block_digests)
        child.num_indexed_blocks = parent.num_indexed_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_indexed_blocks = 0
        seq.num_computed_tokens = 0
