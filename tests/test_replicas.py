"""Engine replicas on Ray Serve behind the prefix-affinity ingress, on the CPU with the tiny dummy model.

One Ray Serve application serves the whole module (on the session's Ray and Serve, which the other
Ray modules share: starting its three actor processes is most of its time): the official ``openai``
client streamed and not, a browser origin's CORS preflight, affinity of a shared prefix, stored
responses answered by the replica that stored them, and a replica killed mid-stream, restarted by Ray
Serve and routed to again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import replica_checks as rc  # noqa: E402

from prefixserve.config import EngineConfig  # noqa: E402
from prefixserve.ray_scaleout.serve_app import serve_app  # noqa: E402
from prefixserve.ray_scaleout.serve_ingress import REPLICA_HEADER  # noqa: E402

SHARED = "You are a careful assistant for the travel desk. " * 12  # a long shared system prompt
UI = "https://ui.example"  # a browser page's origin the ingress lets call it (CORS)


@pytest.fixture(scope="module")
def endpoint(ray_serve: str, tiny_config_path: Path) -> Iterator[str]:
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256)
    app = serve_app(config, 2, replica_cpus=0.5, allowed_origins=[UI])
    with rc.app_on_serve(ray_serve, app, 2) as url:
        yield url


def test_openai_client_streamed_and_not(endpoint: str) -> None:
    client = rc.client(endpoint)
    assert [m.id for m in client.models.list()]
    out = client.completions.create(model="default", prompt="Hello there", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi!"}], max_tokens=5, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt="x", max_tokens=-1)
    ask = {
        "Origin": UI,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    preflight = httpx.options(endpoint + "/v1/chat/completions", headers=ask)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == UI
    other = httpx.options(
        endpoint + "/v1/chat/completions", headers={**ask, "Origin": "https://elsewhere.example"}
    )
    assert "access-control-allow-origin" not in other.headers
    metrics = httpx.get(endpoint + "/metrics").text
    assert 'replica="replica-0"' in metrics and 'replica="replica-1"' in metrics
    assert "prefixserve_router_requests_total" in metrics


def test_a_shared_prefix_lands_on_one_replica(endpoint: str) -> None:
    """Misses at equal load take turns over the replicas; requests sharing a prefix do not."""
    holder, _ = rc.complete(endpoint, SHARED + "Question 0: where to?")
    time.sleep(1.0)  # the ingress polls the replicas' cache events every 0.25 s
    landed = {rc.complete(endpoint, SHARED + f"Question {i}: how long?")[0] for i in range(1, 5)}
    assert landed == {holder}
    with ThreadPoolExecutor(3) as pool:  # together: the holder gets busier, within the threshold
        landed = set(pool.map(lambda i: rc.complete(endpoint, SHARED + f"Question {i}?", 20)[0], range(5, 8)))
    assert landed == {holder}
    misses = [rc.complete(endpoint, f"Unrelated question {i}")[0] for i in range(2)]
    assert set(misses) == {"replica-0", "replica-1"}  # without the shared prefix they take turns
    chats = [
        [{"role": "system", "content": SHARED}, {"role": "user", "content": f"Trip {i}?"}] for i in range(3)
    ]
    chat = rc.client(endpoint).chat.completions.with_raw_response.create
    first = chat(model="default", messages=chats[0], max_tokens=2).headers[REPLICA_HEADER]
    time.sleep(1.0)
    later = {chat(model="default", messages=m, max_tokens=2).headers[REPLICA_HEADER] for m in chats[1:]}
    assert later == {first}  # a chat routes on its rendered prompt, system prompt included
    time.sleep(1.0)
    turn = chats[2] + [{"role": "assistant", "content": "Soon."}, {"role": "user", "content": "Sure?"}]
    assert chat(model="default", messages=turn, max_tokens=2).headers[REPLICA_HEADER] == first


def test_a_prefix_cache_reset_reaches_every_replica(endpoint: str) -> None:
    def cached_tokens() -> int:
        out = rc.client(endpoint).completions.create(
            model="default", prompt=SHARED + "Open when?", max_tokens=2
        )
        return out.usage.prompt_tokens_details.cached_tokens

    cached_tokens()
    # the router learns the first replica's blocks from its cache events, which a loaded machine (the
    # suite on two workers) may deliver after the next request was routed elsewhere: ask until one hits
    deadline = time.monotonic() + 30
    while (hit := cached_tokens()) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert hit > 0
    r = httpx.post(endpoint + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["reset"] is True and r.json()["replicas"] == {"replica-0": True, "replica-1": True}
    assert cached_tokens() == 0


def test_responses_go_on_where_they_are_stored(endpoint: str) -> None:
    """A stored response lives in its replica: a request naming it (``previous_response_id``,
    ``/v1/responses/{id}``) goes there, whichever replica its prompt or the load would pick."""
    client = rc.client(endpoint)
    create = client.responses.with_raw_response.create
    first = create(model="default", input="Plan a trip to Lima.", max_output_tokens=3)
    owner, rid = first.headers[REPLICA_HEADER], first.parse().id
    assert rid.startswith(f"resp_{owner}_")
    for i in range(4):  # unrelated prompts would take turns over the replicas
        rc.complete(endpoint, f"Unrelated question {i}")
        then = create(model="default", input=f"And day {i}?", previous_response_id=rid, max_output_tokens=3)
        assert then.headers[REPLICA_HEADER] == owner and then.parse().previous_response_id == rid
        rid = then.parse().id
    streamed = list(
        client.responses.create(
            model="default", input="Hi", previous_response_id=rid, stream=True, max_output_tokens=3
        )
    )
    assert streamed[-1].response.id.startswith(f"resp_{owner}_")
    got = httpx.get(f"{endpoint}/v1/responses/{rid}", timeout=60)
    assert got.status_code == 200 and got.headers[REPLICA_HEADER] == owner and got.json()["id"] == rid
    assert httpx.get(f"{endpoint}/v1/responses/{rid}/input_items", timeout=60).json()["data"]
    assert httpx.delete(f"{endpoint}/v1/responses/{rid}", timeout=60).json()["deleted"] is True
    assert httpx.get(f"{endpoint}/v1/responses/{rid}", timeout=60).status_code == 404


def test_files_and_batches_live_on_their_replica_and_list_from_all(endpoint: str) -> None:
    """Each upload lands on some replica; its batch runs there, and every id routes back to it."""
    client = rc.client(endpoint)
    made = []
    for k in range(4):  # least loaded at equal load takes turns: both replicas get files
        rows = [
            json.dumps(
                {
                    "custom_id": f"{k}-{i}",
                    "url": "/v1/completions",
                    "method": "POST",
                    "body": {"model": "default", "prompt": f"batch {k} row {i}", "max_tokens": 3},
                }
            )
            for i in range(3)
        ]
        made.append(client.files.create(file=(f"in{k}.jsonl", "\n".join(rows).encode()), purpose="batch"))
    assert {f.id.split("_")[0].removeprefix("file-") for f in made} == {"replica-0", "replica-1"}
    batches = [
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        for f in made
    ]
    for batch, stored in zip(batches, made, strict=True):
        assert batch.id.split("_")[1] == stored.id.split("_")[0].removeprefix(
            "file-"
        )  # ran where the file is
        deadline = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing")
            time.sleep(0.1)
        out = client.files.content(batch.output_file_id).text.splitlines()
        assert sorted(json.loads(line)["custom_id"] for line in out) == sorted(
            f"{stored.filename[2:-6]}-{i}" for i in range(3)
        )
    listed = client.batches.list(limit=100).data
    assert {b.id for b in batches} <= {b.id for b in listed}
    two = client.files.list(purpose="batch", order="asc", limit=2)
    rest = client.files.list(purpose="batch", order="asc", after=two.data[-1].id)
    assert [f.id for f in two.data + rest.data] == [
        f.id for f in client.files.list(purpose="batch", order="asc")
    ]
    assert {f.id for f in made} <= {f.id for f in two.data + rest.data}


def test_a_killed_replica_fails_its_stream_the_rest_is_served_and_it_comes_back(endpoint: str) -> None:
    with rc.long_stream(endpoint, "Tell a long story.") as r:
        lines = rc.started(r)
        victim = r.headers[REPLICA_HEADER]
        os.kill(rc.replica_info(victim)["pid"], signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    # an error event ends the stream, then [DONE] as every completion stream ends
    assert rest[-1:] == ["data: [DONE]"] and "error" in json.loads(rest[-2][6:]), rest[-3:]
    others = {rc.complete(endpoint, f"Other request {i}")[0] for i in range(3)}
    assert victim not in others  # served by the replica that lives
    rc.wait_healthy(endpoint, 2)  # Ray Serve restarted it
    with ThreadPoolExecutor(4) as pool:  # misses in flight together spread by load: both replicas take some
        landed = set(pool.map(lambda i: rc.complete(endpoint, f"Fresh prompt {i}", 40)[0], range(4)))
    assert victim in landed
