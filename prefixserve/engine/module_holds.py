"""Prompt Cache holds of requests that wait: let go when they block the queue's head, taken again
before their own admission.

A PML request holds its pieces' blocks from intake (its layout was made against them, and pieces
in use cannot leave the GPU). Requests waiting behind a head that does not fit can so hold the very
blocks it needs, each for pieces of its own or recovery copies, with nothing running to end: the
queue would wait forever. When the scheduler is idle with such a head (``Scheduler.reclaim``), the
holds of waiting requests that have not started go, with every piece no request holds; a request
whose holds went takes them again when the scheduler reaches it (``Scheduler.ready``), the pieces
coming back from the host tier (or encoded again) and its recovery copies made afresh.
"""

from __future__ import annotations

from prefixserve.promptcache.store import PromptModules
from prefixserve.sequence import Request, SeqStatus, Sequence


class WaitingModuleHolds:
    """The scheduler's hooks for Prompt Cache holds: ``reclaim`` and ``ready``."""

    def __init__(
        self, modules: PromptModules, requests: dict[str, Request], to_recover: set[Request]
    ) -> None:
        self.modules, self.requests, self.to_recover = modules, requests, to_recover

    def reclaim(self, head: Sequence) -> int:
        """Let go of the holds of waiting requests other than ``head``'s that have not started, and
        move every piece no request holds to host memory; returns the blocks this freed."""
        pool = self.modules.pool
        free = pool.num_free
        for req in self.requests.values():
            if req is not head.request and self._may_let_go(req):
                assert req.modules is not None
                self.modules.let_go(req.modules)
        self.modules.move_out()
        return pool.num_free - free

    def ready(self, seq: Sequence) -> bool:
        """May the scheduler admit ``seq``? Its request's holds taken again if they were let go;
        False while the pool has no room for them."""
        held = seq.request.modules
        return held is None or not held.let_go or self.modules.take_again(held)

    def _may_let_go(self, req: Request) -> bool:
        """Holding pieces, with no sequence in a table, and no recovery row computed into its
        private copies (it would be lost with them): waiting, not started, or preempted before or
        without recovery."""
        held = req.modules
        if held is None or not held.blocks:
            return False
        if held.private and req not in self.to_recover:
            return False
        return all(s.status is SeqStatus.WAITING and not s.block_table for s in req.sequences)


__all__ = ["WaitingModuleHolds"]
