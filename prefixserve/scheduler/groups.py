"""Prefix-sharing groups of an offline batch (BatchLLM section 3.3.1): computed once, held, released.

A group is the requests that share one first-level prefix (``prefix_tree``). The scheduler starts a
group by admitting its leader alone, whose prefill computes the prefix; once every full block of the
prefix is in the prefix index, the group takes a reference on those blocks (so no eviction can take
them while members are still to come) and releases its other members to the waiting queue. When the
last member finishes, the group drops its reference: the prefix's lifetime is the group's, decided
explicitly, not left to LRU. One exception: an idle scheduler whose next sequence does not fit beside
the held prefixes lets the holds go (``let_go``), since otherwise nothing would ever run again.
Pure Python: no torch.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from prefixserve.kv.block_pool import BlockPool
from prefixserve.sequence import Sequence


class GroupState(enum.Enum):
    PENDING = "pending"  # not started: every member waits in the group
    PREFIX = "prefix"  # the leader is computing the prefix; the other members wait in the group
    READY = "ready"  # the prefix is held; every member has gone to the waiting queue
    DONE = "done"  # every member finished; the hold is released


@dataclass(eq=False, slots=True)
class GroupJob:
    """One prefix-sharing group as the scheduler runs it."""

    members: list[Sequence]  # members[0] leads: its prefill computes the shared prefix
    prefix_len: int  # tokens of the shared prefix (the first ``prefix_len`` of every member's prompt)
    state: GroupState = GroupState.PENDING
    pending: deque[Sequence] = field(default_factory=deque)  # members not yet sent to waiting
    unfinished: int = 0
    held: list[int] = field(default_factory=list)  # prefix blocks the group holds a reference on
    leader: Sequence | None = None  # the member whose prefill computes the prefix

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("a prefix-sharing group needs at least one member")
        self.pending = deque(self.members)
        self.unfinished = len(self.members)

    def start(self, block_size: int) -> list[Sequence]:
        """Members to admit now: the leader alone when there is a prefix block worth holding."""
        if not self.pending:  # every member ended before the group started
            self.state = GroupState.DONE
            return []
        if len(self.members) > 1 and self.prefix_len >= block_size:
            self.state = GroupState.PREFIX
            self.leader = self.pending.popleft()
            return [self.leader]
        self.state = GroupState.READY  # nothing to hold: every member goes at once
        out = list(self.pending)
        self.pending.clear()
        return out

    def try_hold(self, pool: BlockPool, digests: list[bytes]) -> list[Sequence]:
        """If every prefix block is in the index, hold them and return the members now free to run."""
        blocks = pool.lookup(digests)
        if len(blocks) < len(digests):
            return []
        pool.acquire(blocks)
        self.held = blocks
        self.state = GroupState.READY
        out = list(self.pending)
        self.pending.clear()
        return out

    def next_leader(self) -> Sequence | None:
        """The lead passes on when the leader ended before the prefix was held (aborted, evicted)."""
        self.leader = self.pending.popleft() if self.pending else None
        return self.leader

    def let_go(self, pool: BlockPool) -> None:
        """Drop the hold early: the prefix blocks become the cache's to keep or evict, and members
        still to run find them there or compute them again (a sequence needs the pool they held)."""
        pool.release(self.held)
        self.held = []

    def member_finished(self, seq: Sequence, pool: BlockPool) -> None:
        """Count a member out (finished, aborted or failed); the last one releases the hold."""
        if seq in self.pending:
            self.pending.remove(seq)
        self.unfinished -= 1
        if self.unfinished == 0:
            self.let_go(pool)
            self.state = GroupState.DONE
