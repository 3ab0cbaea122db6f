"""The ingress's replica set without Ray: fake handles shaped like Ray Serve's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from prefixserve.kv.cache_events import CacheEvents
from prefixserve.protocols.errors import APIError
from prefixserve.ray_scaleout.serve_ingress import ReplicaSet


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeReplica:
    """Answers ``cache_events.remote(full, consumer)`` from a script of (incarnation, events) or
    exceptions."""

    def __init__(self) -> None:
        self.answers: list[Any] = []
        self.asked_full: list[bool] = []
        self.consumers: set[str] = set()
        self.cache_events = _Method(self._events)

    async def _events(self, full: bool, consumer: str) -> tuple[str, CacheEvents]:
        self.asked_full.append(full)
        self.consumers.add(consumer)
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
    assert a.consumers == {replicas.consumer}  # one consumer id per ingress, on every poll
    assert ReplicaSet({"a": a}).consumer != replicas.consumer


def test_a_new_ingress_routes_after_its_first_poll_round() -> None:
    """The proxy may send a request to an ingress that never polled yet: it waits for the first
    round instead of answering 503 with replicas serving."""
    a = FakeReplica()
    a.answers = [("i1", CacheEvents(added=[b"x"], reset=True))] + [("i1", CacheEvents())] * 50
    replicas = ReplicaSet({"a": a})

    async def scenario() -> str:
        await replicas.ready()
        name = replicas.choose([b"x"], None)
        replicas._poller.cancel()
        return name

    assert _run(scenario()) == "a"


def test_a_delta_that_crossed_a_failure_is_dropped_and_a_snapshot_asked_for() -> None:
    a = FakeReplica()
    replicas = ReplicaSet({"a": a})
    a.answers = [("i1", CacheEvents(added=[b"x"], reset=True))]
    _run(replicas.poll("a"))
    gate = asyncio.Event

    async def scenario() -> None:
        started, release = gate(), gate()

        async def slow(full: bool, consumer: str) -> tuple[str, CacheEvents]:
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


def test_routing_digests_are_the_ones_the_engine_caches(tiny_config_path: Any) -> None:
    """A completion, a chat and a message naming an application: the ingress's digests are among the blocks
    the engine cached for the same request (the pinned system prompt first, as the engine's intake)."""
    import json

    from prefixserve import LLM, SamplingParams
    from prefixserve.protocols.anthropic.prepare import prepare_message
    from prefixserve.protocols.openai.prepare import OpenAIContext, prepare
    from prefixserve.ray_scaleout.serve_ingress import IngressCore

    system = "You answer questions about trains, briefly and politely. " * 3
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, system_prompts={"rail": system},
        progress=False,
    )  # fmt: skip
    tok = llm.engine.tokenizer
    ctx = OpenAIContext(model=llm.engine.model_name, tokenizer=tok, system_prompts={"rail": system})
    core = IngressCore(ReplicaSet({"a": FakeReplica()}), ctx, llm.engine.config.block_size)
    question = "Which line goes to the harbour, and how often does it run on Sundays? " * 2
    bodies = {
        "/v1/completions": {"model": "default", "prompt": question, "application": "rail"},
        "/v1/chat/completions": {
            "model": "default", "messages": [{"role": "user", "content": question}], "application": "rail",
        },
        "/v1/messages": {  # Anthropic's: as the chat it runs as
            "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": question}],
            "application": "rail",
        },
        "/v1/embeddings": {"model": "default", "input": [question, "another"], "application": "rail"},
    }  # fmt: skip
    for path, body in bodies.items():
        digests, session = _run(core.routing_key(path, json.dumps(body).encode(), {"x-session-id": "s9"}))
        assert session == "s9"
        pinned = len(llm.engine.system_prompt_kv["rail"].digests)
        assert len(digests) > pinned  # the question's own blocks too
        if path == "/v1/embeddings":  # by its first input
            llm.embed([question], application="rail")
            assert set(digests) <= set(llm.engine.pool.cached_digests()), path
            continue
        prep = prepare_message(ctx, body).prep if path == "/v1/messages" else prepare(ctx, path, body)
        text = prep.prompts[0]
        llm.generate([text], SamplingParams(max_tokens=1), application="rail")  # as the server submits it
        assert set(digests) <= set(llm.engine.pool.cached_digests()), path
    digests, session = _run(core.routing_key("/v1/completions", b"{not json", {}))
    assert digests == [] and session is None  # the replica answers the error
    for path, body in [  # without the header, the body's user is the session
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "user": "u1"}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                          "metadata": {"user_id": "u1"}}),
    ]:  # fmt: skip
        assert _run(core.routing_key(path, json.dumps(body).encode(), {}))[1] == "u1", path


@pytest.mark.parametrize(
    ("answers", "status", "reset"),
    [
        ({"replica-0": (200, True), "replica-1": (200, True)}, 200, True),
        ({"replica-0": (200, True), "replica-1": (200, False)}, 200, False),
        ({"replica-0": (200, True), "replica-1": (503, None)}, 503, None),  # its error, not another's success
    ],
)
def test_a_reset_answers_for_every_replica(answers: dict, status: int, reset: bool | None) -> None:
    from types import SimpleNamespace

    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from prefixserve.ray_scaleout.serve_ingress import IngressCore

    core = IngressCore.__new__(IngressCore)  # only the broadcast: no Ray, no tokenizer
    core.replicas = SimpleNamespace(healthy=set(answers))

    async def call(name: str, request: Any, body: bytes) -> Any:
        code, done = answers[name]
        body_of = (
            {"object": "prefix_cache_reset", "reset": done} if code == 200 else {"error": {"message": "x"}}
        )
        return JSONResponse(body_of, status_code=code)

    core._call = call  # type: ignore[method-assign]
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/reset_prefix_cache",
        "headers": [],
        "query_string": b"",
    }
    answer = _run(core._broadcast(Request(scope), b""))
    assert answer.status_code == status
    if reset is not None:
        assert json.loads(bytes(answer.body))["reset"] is reset


def test_a_request_naming_a_stored_response_goes_to_the_replica_that_stored_it() -> None:
    from prefixserve.protocols.ids import object_id
    from prefixserve.protocols.responses.store import ResponseStore
    from prefixserve.ray_scaleout.serve_objects import named_owner

    rid = ResponseStore(tag="replica-1").new_id()

    def owner(path: str, body: bytes, method: str = "POST") -> str | None:
        return named_owner(method, path, body)

    assert owner(f"/v1/responses/{rid}", b"", "GET") == "replica-1"
    assert owner(f"/v1/responses/{rid}/input_items", b"", "GET") == "replica-1"
    assert owner(f"/v1/responses/{rid}/cancel", b"") == "replica-1"  # a background response's
    body = json.dumps({"input": "hi", "previous_response_id": rid}).encode()
    assert owner("/v1/responses", body) == "replica-1"
    assert owner("/v1/responses", b'{"input": "hi"}') is None  # a new conversation routes on its prompt
    assert owner("/v1/responses", b"{not json") is None
    assert owner("/v1/responses/resp_abc", b"") is None  # no tag: any replica answers (404)
    assert owner("/v1/chat/completions", body) is None
    file_id, batch_id = object_id("file", "replica-0", "-"), object_id("batch", "replica-1")
    assert owner(f"/v1/files/{file_id}/content", b"", "GET") == "replica-0"
    assert owner(f"/v1/files/{file_id}", b"", "DELETE") == "replica-0"
    assert owner(f"/v1/batches/{batch_id}/cancel", b"") == "replica-1"
    assert owner("/v1/batches", json.dumps({"input_file_id": file_id}).encode()) == "replica-0"
    assert owner("/v1/batches", b"", "GET") is None and owner("/v1/files", b"") is None
    assert owner("/v1/files/file-abc", b"", "GET") is None
    assert owner(f"/v1/messages/batches/msg{batch_id}/results", b"", "GET") == "replica-1"  # Anthropic's


def test_lists_merge_every_replicas_pages() -> None:
    """Each replica's whole list is read page by page, merged by creation, then paged for the client."""
    from urllib.parse import parse_qs

    from prefixserve.protocols.errors import APIError
    from prefixserve.protocols.openai.lists import page
    from prefixserve.ray_scaleout.serve_objects import merged_list

    held = {
        "r0": [{"id": f"batch_r0_{k:032x}", "created_at": 10 + 2 * k} for k in range(150)],
        "r1": [{"id": f"batch_r1_{k:032x}", "created_at": 11 + 2 * k} for k in range(3)],
    }
    asked: list[dict[str, list[str]]] = []

    async def fetch(name: str, path: str, query: str) -> tuple[int, Any]:
        q = parse_qs(query)
        asked.append(q)
        if name == "down":
            return 503, {"error": {"message": "replica down"}}
        newest = sorted(held[name], key=lambda b: b["created_at"], reverse=True)
        return 200, page(newest, q.get("after", [None])[0], int(q["limit"][0]))

    first = _run(merged_list(fetch, ["r0", "r1"], "/v1/batches", {"limit": "4"}))
    assert [b["created_at"] for b in first["data"]] == [308, 306, 304, 302] and first["has_more"]
    assert len(asked) == 3 and asked[1]["after"] == [held["r0"][50]["id"]]  # r0's second page of 100
    later = _run(merged_list(fetch, ["r0", "r1"], "/v1/batches", {"after": held["r0"][2]["id"]}))
    assert [b["created_at"] for b in later["data"]] == [13, 12, 11, 10]
    whole = _run(merged_list(fetch, ["r0", "r1"], "/v1/batches", {"limit": "100"}))
    assert len(whole["data"]) == 100 and whole["first_id"] == held["r0"][-1]["id"]
    with pytest.raises(APIError, match="replica down"):
        _run(merged_list(fetch, ["r0", "down"], "/v1/batches", {}))
    with pytest.raises(APIError, match="limit"):
        _run(merged_list(fetch, ["r0"], "/v1/batches", {"limit": "0"}))


def test_message_batch_lists_merge_with_anthropic_cursors() -> None:
    """Message batches of every replica in one list, paged by ``after_id`` / ``before_id`` as one
    server pages its own; each replica read through its own cursor."""
    from urllib.parse import parse_qs

    from prefixserve.protocols.anthropic.message_batches import anthropic_page
    from prefixserve.ray_scaleout.serve_objects import merged_list

    def when(k: int) -> str:
        return f"2026-11-28T10:{k // 60:02d}:{k % 60:02d}Z"

    held = {
        "r0": [{"id": f"msgbatch_r0_{k:04d}", "created_at": when(2 * k)} for k in range(1200)],
        "r1": [{"id": f"msgbatch_r1_{k:04d}", "created_at": when(2 * k + 1)} for k in range(3)],
    }
    asked: list[dict[str, list[str]]] = []

    async def fetch(name: str, path: str, query: str) -> tuple[int, Any]:
        q = {k: v[0] for k, v in parse_qs(query).items()}
        asked.append(q)
        newest = sorted(held[name], key=lambda b: b["created_at"], reverse=True)
        return 200, anthropic_page(q, newest)

    route = "/v1/messages/batches"
    first = _run(merged_list(fetch, ["r0", "r1"], route, {"limit": "3"}))
    assert [b["id"][-4:] for b in first["data"]] == ["1199", "1198", "1197"] and first["has_more"]
    assert first["first_id"] == held["r0"][-1]["id"] and first["last_id"] == held["r0"][-3]["id"]
    assert asked[1]["after_id"] == held["r0"][200]["id"]  # r0's second page of 1,000
    tail = _run(merged_list(fetch, ["r0", "r1"], route, {"after_id": held["r0"][3]["id"]}))
    assert [b["created_at"] for b in tail["data"]] == [when(k) for k in (5, 4, 3, 2, 1, 0)]
    assert not tail["has_more"]
    back = _run(merged_list(fetch, ["r0", "r1"], route, {"before_id": held["r1"][0]["id"], "limit": "2"}))
    assert [b["created_at"] for b in back["data"]] == [when(3), when(2)]


def test_store_tags_are_names() -> None:
    from prefixserve.protocols.responses.store import ResponseStore

    with pytest.raises(ValueError, match="tag"):
        ResponseStore(tag="a_b")


def test_the_ingress_predicts_digests_from_the_replicas_chain_root() -> None:
    """Replicas with an FP8 cache tell their chain root with their events; the ingress predicts a
    prompt's digests from each replica's (none before a replica answered, or with a model-dtype
    cache), and where roots differ (a rollout changing the KV format) each replica is matched
    against its own chain."""
    a, b = FakeReplica(), FakeReplica()
    replicas = ReplicaSet({"a": a, "b": b})
    assert replicas.chain_roots() == {}
    a.answers = [("i1", CacheEvents(added=[b"a1", b"a2"], reset=True, root=b"fp8"))]
    b.answers = [("i1", CacheEvents(added=[b"b1"], reset=True, root=None))]
    _run(replicas.poll("a"))
    _run(replicas.poll("b"))
    assert replicas.chain_roots() == {"a": b"fp8", "b": None}
    # each replica's own digests of the prompt: a holds two blocks of its chain, b one of its own
    assert replicas.choose({"a": [b"a1", b"a2"], "b": [b"b1", b"b9"]}, None) == "a"
    assert replicas.choose({"a": [b"a9"], "b": [b"b1"]}, None) == "b"
    assert replicas.choose([b"b1"], None) == "b"  # one list: every replica against it
