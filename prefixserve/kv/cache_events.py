"""Prefix-cache events: which block digests entered and left a pool's prefix index, for routers.

A replica router that knows which replica holds which KV blocks (keyed by the engines' own block
digests) routes a request to the replica holding its longest cached prefix exactly, rather than by
guessing from characters. Several routers may follow one pool (one per ingress replica), each from
its own cursor into one shared log. The pool appends to a ``CacheEventLog`` only once someone
enabled it (``BlockPool.enable_cache_events``) and only while a consumer follows it, so an engine
nobody routes to pays nothing; a consumer ``limit`` events behind is dropped (the log keeps at most
``limit`` entries) and its next drain is a full snapshot instead (``reset``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prefixserve.kv.block_pool import BlockPool, chain_digests

DEFAULT_LIMIT = 65536  # events a consumer may fall behind before it is dropped (then: a snapshot)
DEFAULT_CONSUMER = ""  # the consumer of callers that follow a pool alone
MAX_CONSUMERS = 64  # consumers followed at once; a new one drops the one furthest behind


@dataclass(slots=True)
class CacheEvents:
    """What changed in a prefix index since the consumer's last drain.

    ``reset``: the consumer forgets what it knew of this pool and takes ``added`` as the whole index
    (its first drain, or it fell ``limit`` events behind). Otherwise ``added`` and ``removed`` are
    disjoint net changes: a digest's last event decides which list it is in, so applying both in any
    order gives the index as it is now.
    """

    added: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    reset: bool = False
    # the pool's chain root (``block_pool.chain_root``: None for a model-dtype cache; an FP8 cache's
    # names its scheme), so a router predicts the digests this pool gives a prompt (``prompt_digests``)
    root: bytes | None = None


class CacheEventLog:
    """One log of (added?, digest) the pool appends to, and a cursor per consumer into it.

    Positions count every event ever logged: ``_base`` is the position of ``_log[0]`` and a cursor is
    the position of the next event its consumer has not seen. Entries every consumer has seen are
    trimmed; a consumer that would be more than ``limit`` events behind is dropped instead, so a
    router that stopped polling holds nothing back, and it resyncs with a snapshot when it returns.
    """

    def __init__(
        self, snapshot: Callable[[], Iterable[bytes]], limit: int = DEFAULT_LIMIT, root: bytes | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"cache event limit must be >= 1, got {limit}")
        self._snapshot = snapshot
        self.root = root  # the pool's chain root, told with every drain
        self.limit = limit
        self._log: list[tuple[bool, bytes]] = []
        self._base = 0
        self._cursors: dict[str, int] = {}  # consumer -> position; absent: its next drain is a snapshot

    @property
    def consumers(self) -> frozenset[str]:
        return frozenset(self._cursors)

    def added(self, digest: bytes) -> None:
        self._append(True, digest)

    def removed(self, digest: bytes) -> None:
        self._append(False, digest)

    def _append(self, added: bool, digest: bytes) -> None:
        if not self._cursors:
            return  # nobody follows: each one's next drain is a snapshot anyway
        self._log.append((added, digest))
        if len(self._log) > self.limit:
            self._drop_behind(self._base + len(self._log) - self.limit)

    def _drop_behind(self, position: int) -> None:
        """Drop the consumers whose cursor is before ``position``; trim what nobody needs now."""
        for consumer in [c for c, at in self._cursors.items() if at < position]:
            del self._cursors[consumer]
        self._trim()

    def _trim(self) -> None:
        keep_from = min(self._cursors.values(), default=self._base + len(self._log))
        if keep_from > self._base:
            del self._log[: keep_from - self._base]
            self._base = keep_from

    def drain(self, full: bool = False, consumer: str = DEFAULT_CONSUMER) -> CacheEvents:
        """The changes ``consumer`` has not seen (a snapshot: ``full``, its first drain, after it was
        dropped), and move its cursor to now. A consumer that lost a drain (a call that failed) asks
        for ``full``."""
        end = self._base + len(self._log)
        at = self._cursors.get(consumer)
        if at is None and len(self._cursors) >= MAX_CONSUMERS:
            furthest_behind = min(self._cursors, key=self._cursors.__getitem__)
            del self._cursors[furthest_behind]
        self._cursors[consumer] = end
        if at is None or full:
            self._trim()
            return CacheEvents(added=list(self._snapshot()), reset=True, root=self.root)
        last: dict[bytes, bool] = {}
        for added, digest in self._log[at - self._base :]:
            last[digest] = added
        self._trim()
        return CacheEvents(
            added=[d for d, a in last.items() if a],
            removed=[d for d, a in last.items() if not a],
            root=self.root,
        )


def enable_cache_events(pool: BlockPool, limit: int = DEFAULT_LIMIT) -> CacheEventLog:
    """Start logging ``pool``'s prefix-index changes (once; later calls return the same log)."""
    if pool.cache_events is None:
        pool.cache_events = CacheEventLog(pool.cached_digests, limit, pool.root)
    log: CacheEventLog = pool.cache_events
    return log


def prompt_digests(
    token_ids: Sequence[int],
    block_size: int,
    positions: Sequence[int] | None = None,
    salt: str | None = None,
    public: int = 0,
    root: bytes | None = None,
) -> list[bytes]:
    """The digests an engine gives the full blocks of this prompt (``BlockManager.match_prefix``'s;
    ``public``: a salted prompt's public tokens, ``Request.public_tokens``; ``root``: its pool's chain
    root, ``CacheEvents.root``):
    positions count from 0 unless given, and the last token is never a cache hit (its logits are
    computed), so only ``(len - 1) // block_size`` blocks are listed."""
    n = len(token_ids)
    if positions is not None and len(positions) != n:
        raise ValueError(f"positions has {len(positions)} entries for {n} token ids")
    full = max(n - 1, 0) // block_size
    ids = token_ids[: full * block_size]
    places = positions[: full * block_size] if positions is not None else range(full * block_size)
    return chain_digests(root, ids, places, salt, block_size, public // block_size)


__all__ = [
    "DEFAULT_CONSUMER",
    "DEFAULT_LIMIT",
    "MAX_CONSUMERS",
    "CacheEventLog",
    "CacheEvents",
    "enable_cache_events",
    "prompt_digests",
]
