"""The waiting queue's order and the choice of whom to preempt: first come first served, priority, or
fair shares between tenants.

``fcfs`` (the default): sequences wait in arrival order, a preempted one goes back to the front, and
the most recently admitted running sequence is the one preempted. ``priority`` (vLLM's
``--scheduling-policy priority``): sequences wait in order of (priority, arrival), a smaller value
first; a preempted one goes back to its place in that order; and the running sequence preempted for
blocks is the one latest in that order. Neither moves a running sequence for a waiting one: a
request of higher priority waits for room as any other, but ahead of the rest. ``fair``: tenants'
virtual token counters (``scheduler/fair_share.py``).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

from prefixserve.config import POLICIES
from prefixserve.scheduler.fair_share import FairShare
from prefixserve.sequence import Sequence


class FirstCome:
    """Arrival order (``fcfs``)."""

    name = "fcfs"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.append(seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """A preempted sequence: at the front (it arrived before all that wait)."""
        waiting.appendleft(seq)

    def victim(self, running: Seq[Sequence]) -> Sequence:
        """Whom to preempt for blocks: the most recently admitted."""
        return running[-1]

    def order(self, waiting: deque[Sequence]) -> None:
        """Before admission: the queue is kept in order as it is filled."""

    def charge(self, scheduled: Seq[Any]) -> None:
        """After a step is planned: no tenant accounts."""


def _order(seq: Sequence) -> tuple[int, float]:
    return seq.request.priority, seq.request.arrival_time


class PriorityFirst:
    """Priority, then arrival (``priority``): a smaller priority value is served first."""

    name = "priority"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.insert(bisect.bisect_right(waiting, _order(seq), key=_order), seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        self.enqueue(waiting, seq)

    def victim(self, running: Seq[Sequence]) -> Sequence:
        """The least urgent (latest in the queue's order), even one already planned this step."""
        return max(reversed(running), key=_order)  # ties (a request's n samples): the latest admitted

    order = FirstCome.order
    charge = FirstCome.charge


def check_priority(priority: object, policy: str) -> None:
    """ValueError (naming ``priority``) for a priority the policy does not take: any integer under
    ``priority``, only 0 under ``fcfs`` (as vLLM refuses it)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority {priority} needs the priority scheduling policy (--scheduling-policy priority); "
            f"this engine's policy is {policy}"
        )


def queue_policy(
    name: str, tenant_weights: dict[str, float] | None = None
) -> FirstCome | PriorityFirst | FairShare:
    if name == "fcfs":
        return FirstCome()
    if name == "priority":
        return PriorityFirst()
    if name == "fair":
        return FairShare(tenant_weights)
    raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}")


__all__ = ["POLICIES", "FairShare", "FirstCome", "PriorityFirst", "check_priority", "queue_policy"]
