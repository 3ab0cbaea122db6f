"""Replicas that start or say why (issue 105): their CPU shares checked or chosen against what Ray has
before the deployment, and the wait for placement bounded after it (``ray_scaleout/placement.py``).

The pure rules run anywhere; the last test starts ``prefixserve serve --replicas 2`` as a user does, on
a Ray of this machine's CPUs (two on the CI machine: the 1-CPU default per replica and the ingress's
0.1 would not fit), and expects it healthy within 60 s, answering. A share that cannot fit is refused
before anything is deployed (the first test's message; the CLI prints it and exits 2)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from prefixserve.ray_scaleout.placement import PlacementError, check_gpus, replica_cpu_share, wait_placed


def test_shares_the_user_gave_are_kept_if_they_fit_and_refused_by_name_if_not() -> None:
    assert replica_cpu_share(2, 1, 0.5, 2.0) == 0.5
    with pytest.raises(
        ValueError, match=r"2 replicas x --replica-cpus 1 \+ 1 ingresses x 0.1 = 2.10 CPUs, but Ray has 2.00"
    ):
        replica_cpu_share(2, 1, 1.0, 2.0)
    with pytest.raises(ValueError, match="--replica-cpus must be > 0"):
        replica_cpu_share(2, 1, 0.0, 8.0)


def test_without_a_share_each_replica_takes_what_fits_at_most_one_cpu() -> None:
    assert replica_cpu_share(2, 1, None, 2.0) == 0.95  # two cores: the ingress's 0.1 first
    assert replica_cpu_share(2, 1, None, 16.0) == 1.0
    assert replica_cpu_share(3, 2, None, 1.0) == 0.26
    with pytest.raises(ValueError, match=r"do not fit the 0\.10 CPUs Ray has"):
        replica_cpu_share(2, 1, None, 0.1)


def test_replicas_without_their_gpus_are_refused() -> None:
    check_gpus(2, 1.0, 2.0)
    with pytest.raises(ValueError, match=r"2 replicas x 2 GPUs .* = 4 GPUs, but Ray has 2"):
        check_gpus(2, 2.0, 2.0)


def _status(message: str, status: str = "DEPLOYING") -> SimpleNamespace:
    deployment = SimpleNamespace(message=message)
    app = SimpleNamespace(status=status, message="boom", deployments={"replica-0": deployment})
    return SimpleNamespace(applications={"app": app})


def test_the_wait_ends_on_unplaceable_replicas_but_not_on_a_slow_load() -> None:
    clock = [0.0]

    def tick(seconds: float) -> None:
        clock[0] += seconds

    unplaced = "Deployment 'replica-0' has 1 replicas that have taken more than 30s to be scheduled."
    with pytest.raises(
        PlacementError, match="could not place the replicas within 60 s: replica-0: Deployment"
    ):
        wait_placed(lambda: _status(unplaced), "app", lambda: False, clock=lambda: clock[0], sleep=tick)
    assert 60 <= clock[0] <= 62
    loading = iter(range(200))  # loading a model for 199 s: no end but its own
    clock[0] = 0.0
    wait_placed(
        lambda: _status("loading"), "app", lambda: next(loading) >= 199, clock=lambda: clock[0], sleep=tick
    )
    assert clock[0] == 199
    with pytest.raises(PlacementError, match="failed to deploy: boom"):
        wait_placed(lambda: _status("", "ApplicationStatus.DEPLOY_FAILED"), "app", lambda: False, sleep=tick)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def stopped_at_exit() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Servers already sent SIGTERM, waited for when the session ends: a CLI's stop (Serve's drain, then
    its own Ray's shutdown: ~3 s, mostly asleep) overlaps the next Ray module's start, not adds to it."""
    servers: list[subprocess.Popen[bytes]] = []
    yield servers
    for server in servers:
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


@pytest.mark.ray
def test_serve_replicas_on_this_machine_starts(
    tmp_path: Path, stopped_at_exit: list[subprocess.Popen[bytes]]
) -> None:
    pytest.importorskip("ray.serve")
    from tests.conftest import TINY_CONFIG

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    base = [sys.executable, "-m", "prefixserve", "serve", "--device", "cpu", "--model", f"dummy:{config}"]
    base += ["--host", "127.0.0.1", "--replicas", "2"]
    port = _free_port()
    log = tmp_path / "serve.log"  # a file, not a pipe: Ray's worker logs (log_to_driver) never fill it up
    with log.open("wb") as err:
        server = subprocess.Popen(
            [*base, "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log.read_text(errors="replace")[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "not healthy within 60 s"
            time.sleep(0.1)
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30))
        body = json.dumps({"model": models["data"][0]["id"], "prompt": [5, 6, 7], "max_tokens": 3}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 3
    finally:
        server.send_signal(signal.SIGTERM)
        stopped_at_exit.append(server)
