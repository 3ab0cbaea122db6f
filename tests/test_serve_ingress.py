"""The ingress's replica set without Ray: fake handles shaped like Ray Serve's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prefixserve.distributed.serve_ingress import ReplicaSet
from prefixserve.entrypoints.openai.protocol import APIError
from prefixserve.kv.cache_events import CacheEvents


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeReplica:
    """Answers ``cache_events.remote(full)`` from a script of (incarnation, events) or exceptions."""

    def __init__(self) -> None:
        self.answers: list[Any] = []
        self.asked_full: list[bool] = []
        self.cache_events = _Method(self._events)

    async def _events(self, full: bool) -> tuple[str, CacheEvents]:
        self.asked_full.append(full)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_replica_joins_on_a_poll_leaves_on_a_failure_and_comes_back_with_a_snapshot() -> None:
    a, b = FakeReplica(), FakeReplica()
    replicas = ReplicaSet({"a": a, "b": b})
    with pytest.raises(APIError, match="no engine replica"):
        replicas.choose([], None)
    a.answers = [("i1", CacheEvents(added=[b"x"], reset=True)), ("i1", CacheEvents(added=[b"y"]))]
    _run(replicas.poll("a"))
    _run(replicas.poll("a"))
    assert replicas.healthy == {"a"} and replicas.router.index.digests_of("a") == {b"x", b"y"}
    assert a.asked_full == [True, False]
    assert replicas.choose([b"x"], None) == "a"
    a.answers = [RuntimeError("actor died"), ("i2", CacheEvents(added=[b"z"], reset=True))]
    _run(replicas.poll("a"))
    assert replicas.healthy == set() and replicas.router.index.digests_of("a") == set()
    _run(replicas.poll("a"))  # restarted: a new incarnation, asked for a snapshot
    assert a.asked_full[-1] is True and replicas.router.index.digests_of("a") == {b"z"}
    assert replicas.healthy == {"a"}


def test_a_delta_that_crossed_a_failure_is_dropped_and_a_snapshot_asked_for() -> None:
    a = FakeReplica()
    replicas = ReplicaSet({"a": a})
    a.answers = [("i1", CacheEvents(added=[b"x"], reset=True))]
    _run(replicas.poll("a"))
    gate = asyncio.Event

    async def scenario() -> None:
        started, release = gate(), gate()

        async def slow(full: bool) -> tuple[str, CacheEvents]:
            started.set()
            await release.wait()
            return "i1", CacheEvents(added=[b"late"])

        a.cache_events = _Method(slow)
        poll = asyncio.create_task(replicas.poll("a"))
        await started.wait()
        replicas.failed("a")  # a request to it failed meanwhile
        release.set()
        await poll

    _run(scenario())
    assert replicas.router.index.digests_of("a") == set() and "a" not in replicas.healthy
    a.cache_events = _Method(a._events)
    a.answers = [("i1", CacheEvents(added=[b"x", b"late"], reset=True))]
    _run(replicas.poll("a"))
    assert a.asked_full[-1] is True and replicas.router.index.digests_of("a") == {b"x", b"late"}
