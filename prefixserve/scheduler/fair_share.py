"""Fair shares between tenants (``--scheduling-policy fair``): virtual token counters.

The Virtual Token Counter scheduler of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024): each tenant has a counter of the service it received, prompt tokens computed at
``PROMPT_WEIGHT`` and generated tokens at ``OUTPUT_WEIGHT`` (the paper's 1 and 2), divided by the
tenant's weight. The waiting queue is served tenant by tenant, the smallest counter first (within a
tenant, in arrival order), and a tenant whose queue was empty rejoins at the smallest counter among
the tenants waiting (its counter is lifted to it), so time spent idle is not banked as credit. Under
memory pressure the sequence preempted is the latest admitted of the tenant with the largest counter.
Two tenants that both keep requests waiting then receive service within a bound of each other that
does not grow with time (the paper's Theorem 4.4: twice the largest request's counted cost, plus what
one step admits), while a tenant sending ten times the others' rate cannot hold the engine.

A request's tenant is ``Request.tenant``: the server's API key or the request's ``user``; requests
without one share the tenant ``None``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

from prefixserve.config import check_weights
from prefixserve.sequence import Sequence

PROMPT_WEIGHT = 1.0  # counter units per prompt token computed (a cache hit costs nothing)
OUTPUT_WEIGHT = 2.0  # per generated token: a decode step's token costs more than a prefill token


def _tenant(seq: Sequence) -> str | None:
    return seq.request.tenant


class FairShare:
    """Virtual token counters per tenant (``fair``)."""

    name = "fair"

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = check_weights(weights or {})
        self.counters: dict[str | None, float] = {}
        self._tenants_waiting: set[str | None] = set()
        self._stale = True

    def counter(self, tenant: str | None) -> float:
        return self.counters.get(tenant, 0.0)

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """A new sequence: its tenant lifted to the least counter waiting if it had none waiting. The
        queue is put in order before each admission (``order``), not at every arrival (a burst of N
        arrivals would sort N times)."""
        tenant = _tenant(seq)
        present = self._present(waiting)
        if tenant not in present and present:
            least = min(self.counter(t) for t in present)
            self.counters[tenant] = max(self.counter(tenant), least)
        present.add(tenant)
        waiting.append(seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """A preempted sequence: back in the queue, its tenant's counter as it stands."""
        self._present(waiting).add(_tenant(seq))
        waiting.append(seq)

    def _present(self, waiting: deque[Sequence]) -> set[str | None]:
        """The tenants with sequences waiting: made again after each admission pass (``order``
        marks it stale), then kept up by arrivals, so a burst costs one pass over the queue."""
        if self._stale:
            self._tenants_waiting, self._stale = {_tenant(s) for s in waiting}, False
        return self._tenants_waiting

    def victim(self, running: Seq[Sequence]) -> Sequence:
        """The latest admitted sequence of the tenant with the largest counter."""
        return max(reversed(running), key=lambda s: self.counter(_tenant(s)))

    def order(self, waiting: deque[Sequence]) -> None:
        """Least counter first, then arrival (a stable sort keeps a tenant's own order)."""
        if len(waiting) > 1:
            ranked = sorted(waiting, key=lambda s: (self.counter(_tenant(s)), s.request.arrival_time))
            waiting.clear()
            waiting.extend(ranked)
        self._stale = True  # admissions follow: the waiting tenants are found again at the next arrival

    def charge(self, scheduled: Seq[Any]) -> None:
        """Count a planned step's tokens (``ScheduledSeq``: seq, num_tokens) against their tenants:
        prompt tokens still to compute at ``PROMPT_WEIGHT``, the rest (decode, drafts) at
        ``OUTPUT_WEIGHT``, each divided by the tenant's weight."""
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            prompt = max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
            cost = PROMPT_WEIGHT * prompt + OUTPUT_WEIGHT * (n - prompt)
            tenant = _tenant(seq)
            self.counters[tenant] = self.counter(tenant) + cost / self.weights.get(tenant or "", 1.0)


__all__ = ["OUTPUT_WEIGHT", "PROMPT_WEIGHT", "FairShare"]
