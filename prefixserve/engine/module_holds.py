"""Prompt Cache holds of requests that wait: let go when they block the queue's head, taken again
before their own admission.

A PML request holds its pieces' blocks from intake (its layout was made against them, and pieces
in use cannot leave the GPU). Requests waiting behind a head that does not fit can so hold the very
blocks it needs, each for pieces of its own or recovery copies, with nothing running to end: the
queue would wait forever. When the scheduler is idle with such a head (``Scheduler.reclaim``), the
waiting requests none of whose sequences is in a table let their holds go, and every piece no
request holds moves to host memory; if the head still does not fit, it drops its own recovery
copies and runs as plain Prompt Cache. A request whose holds went takes them again when the
scheduler reaches it (``Scheduler.ready``): its pieces come back from the host tier (or are encoded
again), its recovery copies are made afresh and their rows computed again in its first step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prefixserve.promptcache.entries import NoRoom
from prefixserve.promptcache.store import PromptModules
from prefixserve.sequence import Request, SeqStatus, Sequence

log = logging.getLogger(__name__)


class WaitingModuleHolds:
    """The scheduler's hooks for Prompt Cache holds: ``reclaim`` and ``ready``. ``fail`` ends a
    request with an error (the engine's), for one whose pieces could not be made ready."""

    def __init__(
        self,
        modules: PromptModules,
        requests: dict[str, Request],
        to_recover: set[Request],
        fail: Callable[[Request], None],
    ) -> None:
        self.modules, self.requests, self.to_recover, self.fail = modules, requests, to_recover, fail

    def reclaim(self, head: Sequence, own: bool) -> int:
        """Blocks freed for ``head``: the holds of the other waiting requests none of whose sequences
        is in a table, with every piece no request holds; with ``own``, the head's recovery copies."""
        pool = self.modules.pool
        free = pool.num_free
        if own:
            held = head.request.modules
            if held is None or not held.private or not self._out_of_tables(head.request):
                return 0
            computed = head.request not in self.to_recover  # it ran them, then was preempted
            self.modules.drop_recovery(held, head.request.cache_salt, computed)
            self.to_recover.discard(head.request)
            head.request.num_cached_tokens = held.reused_tokens
            for seq in head.request.sequences:
                seq.block_digests = list(held.digests)
        else:
            for req in self.requests.values():
                if req is not head.request and self._may_let_go(req):
                    self._let_go(req)
        self.modules.move_out()
        return pool.num_free - free

    def ready(self, seq: Sequence) -> bool:
        """May the scheduler admit ``seq``? Its request's holds are taken again if they were let go;
        False while the pool has no room for them, or when that failed (the request then ended)."""
        held = seq.request.modules
        if held is None or not held.let_go:
            return True
        try:
            return self.modules.take_again(held)
        except NoRoom:
            return False
        except Exception:
            log.exception("request %s: its prompt modules could not be made ready", seq.request.request_id)
            self.fail(seq.request)
            return False

    def _let_go(self, req: Request) -> None:
        held = req.modules
        assert held is not None
        self.modules.let_go(held)
        if held.recompute_runs:  # its rows are computed again, into fresh copies
            self.to_recover.add(req)

    def _may_let_go(self, req: Request) -> bool:
        held = req.modules
        return held is not None and bool(held.blocks) and self._out_of_tables(req)

    @staticmethod
    def _out_of_tables(req: Request) -> bool:
        """None of its sequences in a table: each finished, or waiting (not started, or preempted)."""
        waiting = SeqStatus.WAITING
        return all(s.is_finished or (s.status is waiting and not s.block_table) for s in req.sequences)


__all__ = ["WaitingModuleHolds"]
