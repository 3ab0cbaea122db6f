"""Replicas whose engines run in their own processes (``--engine-process on``, auto's choice on a GPU)
behind two ingresses, on the CPU with the tiny dummy model.

The process path: streams and the cache events cross the engine's pipe (what the replica runs there
must pickle), every ingress follows every replica's events as its own consumer and routes a shared
prefix to its holder, and a replica killed mid-stream fails its stream, its engine process does not
outlive it and Ray Serve restarts it (an engine process that dies alone fails its requests and its
health check: ``tests/test_engine_process.py``, which is what Ray Serve's restart polls).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import replica_checks as rc  # noqa: E402

from prefixserve.config import EngineConfig  # noqa: E402
from prefixserve.ray_scaleout.serve_app import default_ingress_replicas, serve_app  # noqa: E402
from prefixserve.ray_scaleout.serve_ingress import REPLICA_HEADER  # noqa: E402

SHARED = "Answer as the harbour master would, in one short sentence. " * 12


@pytest.fixture(scope="module")
def endpoint(ray_serve: str, tiny_config_path: Path) -> Iterator[str]:
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256)
    app = serve_app(config, 2, replica_cpus=0.5, engine_process="on", ingress_replicas=2)
    with rc.app_on_serve(ray_serve, app, 2) as url:
        yield url


def test_default_ingresses_and_bad_options() -> None:
    assert default_ingress_replicas(1, on_gpu=False) == 1
    assert default_ingress_replicas(1, on_gpu=True) == 2
    assert default_ingress_replicas(4, on_gpu=True) == 4
    with pytest.raises(ValueError, match="ingress_replicas"):
        serve_app(EngineConfig(device="cpu"), 1, ingress_replicas=0)
    with pytest.raises(ValueError, match="engine_process"):
        serve_app(EngineConfig(device="cpu"), 1, engine_process="sometimes")


def test_a_stream_through_the_engine_process(endpoint: str) -> None:
    for name in ("replica-0", "replica-1"):
        info = rc.replica_info(name)
        assert info["engine_pid"] != info["pid"]  # the engine is not on a thread of the replica
    chunks = list(
        rc.client(endpoint).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi!"}], max_tokens=6, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_every_ingress_routes_a_shared_prefix_to_its_holder(endpoint: str) -> None:
    """The events reach every ingress (each its own consumer): whichever one the proxy picks, a
    request sharing a cached prefix goes to the replica holding it."""
    holder, _, _ = rc.complete_via(endpoint, SHARED + "Question 0: when is high tide?")
    time.sleep(1.0)  # the ingresses poll the replicas' cache events every 0.25 s
    ingresses: set[str] = set()
    for i in range(1, 41):  # until both ingresses routed some (the proxy picks one at random)
        replica, ingress, _ = rc.complete_via(endpoint, SHARED + f"Question {i}: which berth?", 2)
        assert replica == holder, (i, ingress)
        ingresses.add(ingress)
        if len(ingresses) == 2 and i >= 4:
            break
    assert len(ingresses) == 2


def _fails_and_comes_back(endpoint: str, kill: str) -> None:
    """A long stream; SIGKILL its replica's ``kill`` process ("pid" or "engine_pid"): the stream ends
    with an error event, both processes end, requests are served meanwhile, and the restarted
    replica (a new incarnation, its engine again in a process of its own) serves again."""
    with rc.long_stream(endpoint, f"Tell a long story ({kill}).") as r:
        lines = rc.started(r)
        victim = r.headers[REPLICA_HEADER]
        before = rc.replica_info(victim)
        os.kill(before[kill], signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    # an error event ends the stream, then [DONE] as every completion stream ends
    assert rest[-1:] == ["data: [DONE]"] and "error" in json.loads(rest[-2][6:]), rest[-3:]
    deadline = time.monotonic() + 30
    while not (rc.process_gone(before["pid"]) and rc.process_gone(before["engine_pid"])):
        assert time.monotonic() < deadline, f"{victim}'s processes outlived it: {before}"
        time.sleep(0.2)  # a dead engine fails the health check; a dead replica's engine sees its pipe close
    for i in range(3):  # the other replica serves meanwhile
        rc.complete(endpoint, f"Other request {i} ({kill})")
    deadline = time.monotonic() + 180
    while True:  # Ray Serve restarts it (the health check every 2 s)
        try:
            after = rc.replica_info(victim)
            if after["incarnation"] != before["incarnation"]:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, f"{victim} was not restarted"
        time.sleep(0.5)
    assert after["engine_pid"] != after["pid"]
    rc.wait_healthy(endpoint, 2)
    landed = {rc.complete(endpoint, f"Fresh prompt {i} ({kill})", 2)[0] for i in range(6)}
    assert victim in landed  # misses at equal load take turns: it serves again


def test_a_killed_replica_takes_its_engine_process_with_it(endpoint: str) -> None:
    _fails_and_comes_back(endpoint, "pid")
