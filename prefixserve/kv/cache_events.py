"""Prefix-cache events: which block digests entered and left a pool's prefix index, for a router.

A replica router that knows which replica holds which KV blocks (keyed by the engines' own block
digests) routes a request to the replica holding its longest cached prefix exactly, rather than by
guessing from characters. The pool appends to a ``CacheEventLog`` only once someone enabled it
(``BlockPool.enable_cache_events``), so an engine nobody routes to pays nothing; a log that nobody
drains stops growing at ``limit`` entries and its next drain is a full snapshot instead (``reset``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prefixserve.kv.block_pool import BlockPool, chain_digests

DEFAULT_LIMIT = 65536  # events kept between two drains before the log falls back to a snapshot


@dataclass(slots=True)
class CacheEvents:
    """What changed in a prefix index since the last drain.

    ``reset``: the consumer forgets what it knew of this pool and takes ``added`` as the whole index
    (the first drain, or the log overflowed). Otherwise ``added`` and ``removed`` are disjoint net
    changes: a digest's last event decides which list it is in, so applying both in any order gives
    the index as it is now.
    """

    added: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    reset: bool = False


class CacheEventLog:
    """Append-only log of (added?, digest) the pool writes to; ``drain`` is called by one consumer."""

    def __init__(self, snapshot: Callable[[], Iterable[bytes]], limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"cache event limit must be >= 1, got {limit}")
        self._snapshot = snapshot
        self.limit = limit
        self._log: list[tuple[bool, bytes]] = []
        self._overflowed = True  # the first drain is a snapshot: the consumer starts from nothing

    def added(self, digest: bytes) -> None:
        self._append(True, digest)

    def removed(self, digest: bytes) -> None:
        self._append(False, digest)

    def _append(self, added: bool, digest: bytes) -> None:
        if self._overflowed:
            return  # the next drain is a snapshot anyway
        if len(self._log) >= self.limit:
            self._overflowed = True
            self._log.clear()
            return
        self._log.append((added, digest))

    def drain(self, full: bool = False) -> CacheEvents:
        """The changes since the last drain (or a snapshot: ``full``, the first, after an overflow),
        and start a new log. A consumer that lost a drain (a call that failed) asks for ``full``."""
        if self._overflowed or full:
            self._overflowed = False
            self._log.clear()
            return CacheEvents(added=list(self._snapshot()), reset=True)
        last: dict[bytes, bool] = {}
        for added, digest in self._log:
            last[digest] = added
        self._log.clear()
        return CacheEvents(
            added=[d for d, a in last.items() if a], removed=[d for d, a in last.items() if not a]
        )


def enable_cache_events(pool: BlockPool, limit: int = DEFAULT_LIMIT) -> CacheEventLog:
    """Start logging ``pool``'s prefix-index changes (once; later calls return the same log)."""
    if pool.cache_events is None:
        pool.cache_events = CacheEventLog(pool.cached_digests, limit)
    log: CacheEventLog = pool.cache_events
    return log


def prompt_digests(
    token_ids: Sequence[int],
    block_size: int,
    positions: Sequence[int] | None = None,
    salt: str | None = None,
) -> list[bytes]:
    """The digests an engine gives the full blocks of this prompt (``BlockManager.match_prefix``'s):
    positions count from 0 unless given, and the last token is never a cache hit (its logits are
    computed), so only ``(len - 1) // block_size`` blocks are listed."""
    n = len(token_ids)
    if positions is not None and len(positions) != n:
        raise ValueError(f"positions has {len(positions)} entries for {n} token ids")
    full = max(n - 1, 0) // block_size
    ids = token_ids[: full * block_size]
    places = positions[: full * block_size] if positions is not None else range(full * block_size)
    return chain_digests(None, ids, places, salt, block_size)


__all__ = ["DEFAULT_LIMIT", "CacheEventLog", "CacheEvents", "enable_cache_events", "prompt_digests"]
