"""Results of prompt rows kept by their block's digest, so that a prefix-cache hit, which skips the
rows, still has them (prompt logprobs' scores, mean pooling's sums).

A block's digest covers the tokens, positions and cache salt of the whole prefix up to the block's
end, so equal digests mean equal rows. A request that needs every prompt row's result takes cached
KV only for the leading blocks whose results are kept (the block manager asks ``known_blocks``
through its ``row_keepers``), and takes those results from here (``seed``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class BlockStore(Generic[V]):
    """Per-block results by digest, least recently used dropped past ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[bytes, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, digest: object) -> bool:
        return digest in self._items

    def known_blocks(self, digests: list[bytes]) -> int:
        """How many of these leading blocks have their results kept."""
        n = 0
        for d in digests:
            if d not in self._items:
                break
            n += 1
        return n

    def take(self, digest: bytes) -> V:
        """A kept block's results (now the most recently used)."""
        self._items.move_to_end(digest)
        return self._items[digest]

    def put(self, digest: bytes, value: V) -> None:
        self._items[digest] = value
        self._items.move_to_end(digest)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


__all__ = ["BlockStore"]
