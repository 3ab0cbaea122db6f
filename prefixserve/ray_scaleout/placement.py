"""Will Ray place the replicas? Their CPU shares checked (or chosen) against what Ray has before the
deployment starts, and the wait for placement bounded after it.

Ray Serve waits forever for an actor it cannot place, saying only, every 30 s, that replicas "have
taken more than 30s to be scheduled": two 1-CPU replicas and a 0.1-CPU ingress on a 2-CPU machine
never became healthy (issue 105). Here the numbers are compared first: shares the user gave that do
not fit are refused at once, naming the flags; with none given, each replica takes at most one CPU
and the ingresses' shares come first. A deployment Ray still leaves unplaced past
``UNPLACED_LIMIT_S`` fails the start with Ray's own message.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

INGRESS_CPUS = 0.1  # each ingress replica's reservation (serve_app.Ingress)
UNPLACED_LIMIT_S = 60.0  # how long a deployment may stay unschedulable before the start fails
_UNPLACED = "to be scheduled"  # Ray Serve's words for replicas waiting for resources


class PlacementError(ValueError):
    """Ray cannot place the deployment (the CLI prints it as an error, as a bad flag)."""


def replica_cpu_share(replicas: int, ingress_replicas: int, asked: float | None, available: float) -> float:
    """CPUs each replica reserves: ``asked`` (``--replica-cpus``) if the replicas and ingresses fit in
    ``available``, else refused naming the flags and the numbers; with none asked, one CPU each, or
    an equal share of what the ingresses leave when that is less (floored to 0.01)."""
    ingress_need = ingress_replicas * INGRESS_CPUS
    if asked is not None:
        if asked <= 0:
            raise ValueError(f"--replica-cpus must be > 0, got {asked}")
        need = replicas * asked + ingress_need
        if need > available + 1e-9:
            raise ValueError(
                f"{replicas} replicas x --replica-cpus {asked:g} + {ingress_replicas} ingresses x "
                f"{INGRESS_CPUS:g} = {need:.2f} CPUs, but Ray has {available:.2f}: lower --replica-cpus, "
                "--replicas or --ingress-replicas"
            )
        return asked
    share = math.floor(min(1.0, (available - ingress_need) / replicas) * 100) / 100
    if share < 0.01:
        raise ValueError(
            f"{replicas} replicas and {ingress_replicas} ingresses ({ingress_need:.2f} CPUs) do not fit "
            f"the {available:.2f} CPUs Ray has: lower --replicas or --ingress-replicas"
        )
    return share


def check_gpus(replicas: int, per_replica: float, available: float) -> None:
    """Refuse replicas whose GPUs Ray does not have, naming the numbers."""
    need = replicas * per_replica
    if need > available + 1e-9:
        raise ValueError(
            f"{replicas} replicas x {per_replica:g} GPUs (one per tensor-parallel rank) = {need:g} GPUs, "
            f"but Ray has {available:g}: lower --replicas or --tensor-parallel-size"
        )


def wait_placed(
    status: Callable[[], Any],  # serve.status
    app_name: str,
    done: Callable[[], bool],  # has the deployment call returned (the app is running)?
    limit_s: float = UNPLACED_LIMIT_S,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait until ``done``; raise with Ray's message if the application failed to deploy, or if a
    deployment has been waiting for resources (Ray's "to be scheduled") for ``limit_s``. Loading a
    large model may take long: only unplaceable replicas end the wait."""
    unplaced_since: float | None = None
    while not done():
        app = status().applications.get(app_name)
        if app is not None:
            if str(app.status).endswith("DEPLOY_FAILED"):
                raise PlacementError(f"the replicas failed to deploy: {app.message}")
            waiting = [
                f"{name}: {d.message}"
                for name, d in app.deployments.items()
                if _UNPLACED in (d.message or "")
            ]
            now = clock()
            if not waiting:
                unplaced_since = None
            elif unplaced_since is None:
                unplaced_since = now
            elif now - unplaced_since >= limit_s:
                raise PlacementError(
                    f"Ray could not place the replicas within {limit_s:.0f} s: " + "; ".join(waiting)
                )
        sleep(poll_s)


__all__ = [
    "INGRESS_CPUS",
    "UNPLACED_LIMIT_S",
    "PlacementError",
    "check_gpus",
    "replica_cpu_share",
    "wait_placed",
]
