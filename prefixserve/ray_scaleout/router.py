"""Prefix-affinity routing over engine replicas, exact rather than approximate. Pure Python, no Ray.

Each replica reports its prefix-cache changes (``kv/cache_events.py``: digests added, evicted) and
the router keeps which replica holds which block digest, keyed exactly as the engines key their
blocks (token ids, positions, salt). A request goes to the replica holding its longest cached
prefix unless that replica is overloaded against the least loaded one; then to the replica that
holds the most of it among those that are not; a request nobody has cached goes to the least
loaded replica. Sessions stick to their replica while it is healthy. Round robin over N replicas
would have each one compute and hold every shared prompt, dividing sharing by N.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prefixserve.kv.cache_events import CacheEvents

MAX_SESSIONS = 100_000  # sessions remembered (least recently routed forgotten first)


class PrefixIndex:
    """Block digest -> the replicas whose prefix cache holds it, fed by their cache events."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, set[bytes]] = {}

    def apply(self, replica: str, events: CacheEvents) -> None:
        """Take one drain of ``replica``'s events (a reset replaces all it was known to hold)."""
        if events.reset:
            self.forget(replica)
        held = self._held.setdefault(replica, set())
        for digest in events.removed:
            if digest in held:
                held.discard(digest)
                holders = self._holders[digest]
                holders.discard(replica)
                if not holders:
                    del self._holders[digest]
        for digest in events.added:
            if digest not in held:
                held.add(digest)
                self._holders.setdefault(digest, set()).add(replica)

    def forget(self, replica: str) -> None:
        """Drop everything ``replica`` held (it restarted with an empty cache, or left)."""
        for digest in self._held.pop(replica, set()):
            holders = self._holders[digest]
            holders.discard(replica)
            if not holders:
                del self._holders[digest]

    def digests_of(self, replica: str) -> set[bytes]:
        return set(self._held.get(replica, ()))

    def holders(self, digest: bytes) -> set[str]:
        return set(self._holders.get(digest, ()))

    def match(self, digests: Sequence[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """How many leading ``digests`` each of ``replicas`` holds (consecutive from the first)."""
        depth = dict.fromkeys(replicas, 0)
        alive = set(depth)
        for i, digest in enumerate(digests):
            alive &= self._holders.get(digest, set())
            if not alive:
                break
            for r in alive:
                depth[r] = i + 1
        return depth


# a prompt's block digests, or each replica's where their chain roots differ (KV formats: an FP8
# cache's digests chain from its scheme, ``block_pool.chain_root``)
Digests = Sequence[bytes] | Mapping[str, Sequence[bytes]]


def replica_digests(digests: Digests, replica: str) -> Sequence[bytes]:
    """The digests ``replica`` gives the prompt: its own where they come per replica."""
    return digests.get(replica, []) if isinstance(digests, Mapping) else digests


ROUTINGS = ("prefix", "round_robin")


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """When affinity gives way to load: a replica counts as overloaded when its outstanding requests
    exceed the least loaded replica's by more than ``max(min_imbalance, imbalance_fraction * least)``.

    ``routing="round_robin"`` ignores prefixes and loads (each healthy replica in turn, sessions still
    stick): the baseline prefix affinity is measured against (``benchmarks/replicas.py``)."""

    min_imbalance: int = 4
    imbalance_fraction: float = 0.25
    routing: str = "prefix"

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.min_imbalance < 0 or self.imbalance_fraction < 0:
            raise ValueError(
                f"min_imbalance and imbalance_fraction must be >= 0, got {self.min_imbalance}, "
                f"{self.imbalance_fraction}"
            )

    def overloaded(self, load: int, least: int) -> bool:
        return load - least > max(self.min_imbalance, self.imbalance_fraction * least)


class Router:
    """Chooses a replica per request from the prefix index, the replicas' loads and sessions."""

    def __init__(self, policy: RoutingPolicy | None = None) -> None:
        self.policy = policy or RoutingPolicy()
        self.index = PrefixIndex()
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._routed = 0  # requests routed so far
        self._last: dict[str, int] = {}  # replica -> the request number it took last

    def choose(self, digests: Digests, loads: Mapping[str, int], session: str | None = None) -> str:
        """The replica for a request whose prompt has these block digests (or each replica's, where
        the replicas' chain roots differ).

        ``loads``: outstanding requests of each healthy replica (only these are candidates).
        """
        if not loads:
            raise RuntimeError("no healthy replica to route to")
        if session is not None:
            stuck = self._sessions.get(session)
            if stuck is not None and stuck in loads:
                self._sessions.move_to_end(session)
                return stuck
        if self.policy.routing == "round_robin":
            chosen = min(loads, key=lambda r: (self._last.get(r, 0), r))  # the one routed to longest ago
        else:
            chosen = self._by_prefix(digests, loads)
        self._routed += 1
        self._last[chosen] = self._routed
        if session is not None:
            self._sessions[session] = chosen
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return chosen

    def _by_prefix(self, digests: Digests, loads: Mapping[str, int]) -> str:
        least = min(loads.values())
        if isinstance(digests, Mapping):  # each replica's own chain
            depth = {r: self.index.match(replica_digests(digests, r), [r])[r] for r in loads}
        else:
            depth = self.index.match(digests, loads)
        # most cached blocks first, then least load, then the one routed to least recently (misses at
        # equal load take turns, so distinct prefixes spread over the caches), then the name
        last = self._last
        ranked = sorted(loads, key=lambda r: (-depth[r], loads[r], last.get(r, 0), r))
        best = ranked[0]
        if depth[best] > 0 and not self.policy.overloaded(loads[best], least):
            return best
        # affinity gives way: the most cached among the replicas that are not overloaded
        # (all of them hold nothing: the least loaded)
        return next(r for r in ranked if not self.policy.overloaded(loads[r], least))

    def forget_replica(self, replica: str) -> None:
        """A replica died or restarted: its cache is gone, and its sessions move on their next request."""
        self.index.forget(replica)
        for session in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[session]


__all__ = [
    "MAX_SESSIONS",
    "ROUTINGS",
    "Digests",
    "PrefixIndex",
    "Router",
    "RoutingPolicy",
    "replica_digests",
]
