"""Prompt blocks being computed right now, by digest: which running sequence computes each.

Requests that share a prompt and arrive together compute it once: the first is admitted and marks the
digests of the blocks it will compute; the others see a block of theirs marked, wait a step, and find
it in the prefix cache. An entry only matters while its sequence runs, so a sequence's entries go
when it finishes or is preempted. (They used to stay until 65,536 had piled up, and each kept its
finished sequence alive, request, prompt text and token arrays included: a server's resident memory
grew with every burst for hundreds of bursts.)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from prefixserve.sequence import SeqStatus, Sequence


class PromptsInFlight:
    """digest -> the running sequence computing that block, and each sequence's own marks."""

    __slots__ = ("_holder", "_marks")

    def __init__(self) -> None:
        self._holder: dict[bytes, Sequence] = {}
        self._marks: dict[Sequence, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._holder)

    def holder(self, digest: bytes) -> Sequence | None:
        """The sequence computing this block, if it still runs."""
        seq = self._holder.get(digest)
        return seq if seq is not None and seq.status is SeqStatus.RUNNING else None

    def mark(self, seq: Sequence, digests: Seq[bytes]) -> None:
        """``seq`` (just admitted) computes these blocks, unless another running sequence already does."""
        holder, mine = self._holder, self._marks.setdefault(seq, [])
        for digest in digests:
            other = holder.get(digest)
            if other is None or other.status is not SeqStatus.RUNNING:
                holder[digest] = seq
                mine.append(digest)

    def forget(self, seq: Sequence) -> None:
        """``seq`` stopped running (finished, aborted, preempted): its marks go."""
        holder = self._holder
        for digest in self._marks.pop(seq, ()):
            if holder.get(digest) is seq:
                del holder[digest]


__all__ = ["PromptsInFlight"]
