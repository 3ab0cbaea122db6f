"""OpenAI's Files and Batch API on a live server, through the official client: rows answered as their
routes answer clients, bad files failed with their lines named, cancel, expiry, 429s retried, a
restart resumed without answering a row twice, and prefix-sharing groups run together."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.config import EngineConfig
from prefixserve.engine.admission import AdmissionLimits
from tests import engine_checks

openai = pytest.importorskip("openai")

from prefixserve.entrypoints.openai import batches as batches_module  # noqa: E402
from prefixserve.entrypoints.openai.batch_routes import BatchSettings  # noqa: E402
from prefixserve.entrypoints.openai.overload import OverloadSettings  # noqa: E402
from prefixserve.entrypoints.openai.server import ServerThread, build_app  # noqa: E402

ENDED = ("completed", "failed", "cancelled", "expired")


def _server(config_path: Path, files_dir: Path, **kwargs: Any) -> ServerThread:
    engine = {"num_kv_blocks": 512, "max_num_seqs": 16, **kwargs.pop("engine", {})}
    config = EngineConfig(model=f"dummy:{config_path}", device="cpu", dtype="float32", **engine)
    batches = BatchSettings(str(files_dir), **kwargs.pop("batches", {}))
    return ServerThread(build_app(config, batches=batches, **kwargs))


def _client(srv: ServerThread) -> Any:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(tiny_config_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with _server(tiny_config_path, tmp_path_factory.mktemp("files")) as srv:
        yield srv


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(client: Any, lines: list[str], endpoint: str, timeout: float = 120.0) -> Any:
    stored = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=stored.id, endpoint=endpoint, completion_window="24h")
    return _wait(client, batch.id, timeout)


def _wait(client: Any, batch_id: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    batch = client.batches.retrieve(batch_id)
    while batch.status not in ENDED:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.05)
        batch = client.batches.retrieve(batch_id)
    return batch


def _rows(client: Any, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    rows = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a row answered twice"
    return by_id


def test_rows_are_answered_as_their_routes_answer(server: ServerThread) -> None:
    client = _client(server)
    model = client.models.list().data[0].id
    bodies = {
        "/v1/completions": [
            {"model": model, "prompt": f"shared words then {i}", "max_tokens": 6, "temperature": 0}
            for i in range(5)
        ],
        "/v1/chat/completions": [
            {"model": model, "messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": 5}
            for i in range(3)
        ],
        "/v1/responses": [{"model": model, "input": f"r {i}", "max_output_tokens": 5} for i in range(2)],
    }
    for url, rows in bodies.items():
        lines = [_line(f"{url}-{i}", url, {**body, "temperature": 0}) for i, body in enumerate(rows)]
        lines.append(_line("wrong-model", url, {**rows[0], "model": "nope"}))
        batch = _run(client, lines, url)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": len(lines), "completed": len(rows), "failed": 1}
        assert batch.model == model and batch.completed_at >= batch.in_progress_at >= batch.created_at
        ok, bad = _rows(client, batch.output_file_id), _rows(client, batch.error_file_id)
        assert set(bad) == {"wrong-model"}
        assert bad["wrong-model"]["response"]["status_code"] == 404
        assert "nope" in json.dumps(bad["wrong-model"]["response"]["body"])
        assert batch.usage.output_tokens == sum(
            row["response"]["body"]["usage"].get(
                "completion_tokens", row["response"]["body"]["usage"].get("output_tokens")
            )
            for row in ok.values()
        )
        for i, body in enumerate(rows):  # the same greedy answer as the route gives a client
            got = ok[f"{url}-{i}"]["response"]["body"]
            assert ok[f"{url}-{i}"]["response"]["status_code"] == 200
            if url == "/v1/completions":
                direct = client.completions.create(**{**body, "temperature": 0})
                assert got["choices"][0]["text"] == direct.choices[0].text
            elif url == "/v1/chat/completions":
                direct = client.chat.completions.create(**{**body, "temperature": 0})
                assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
            else:
                direct = client.responses.create(**{**body, "temperature": 0}, store=False)
                assert got["output"][-1]["content"][0]["text"] == direct.output_text
    engine_checks.wait_server_pool_empty(server)


def test_a_bad_file_fails_the_batch_naming_its_lines(server: ServerThread) -> None:
    client = _client(server)
    model = client.models.list().data[0].id
    good = _line("a", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1})
    lines = [
        good,
        "{not json",
        _line("b", "/v1/chat/completions", {"model": model}),
        good.replace('"a"', '"a"'),
    ]
    batch = _run(client, lines, "/v1/completions")
    assert batch.status == "failed" and batch.failed_at is not None
    errors = {(e.line, e.code) for e in batch.errors.data}
    assert errors == {(2, "invalid_json"), (3, "mismatched_endpoint"), (4, "duplicate_custom_id")}
    assert batch.output_file_id is None and batch.error_file_id is None
    empty = client.files.create(file=("e.jsonl", b"\n\n"), purpose="batch")
    batch = client.batches.create(input_file_id=empty.id, endpoint="/v1/completions", completion_window="24h")
    assert _wait(client, batch.id).errors.data[0].code == "empty_file"


def test_refusals_name_the_problem(server: ServerThread) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}"), purpose="nonsense")
    notes = client.files.create(file=("notes.txt", b"hello"), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=notes.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="no file"):
        client.batches.create(
            input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h"
        )
    stored = client.files.create(file=("a.jsonl", b"{}"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=stored.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=stored.id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-nope")
    raw = httpx.post(f"{server.url}/v1/files", json={"purpose": "batch"})
    assert raw.status_code == 400 and "multipart" in raw.json()["error"]["message"]
    assert client.files.retrieve(notes.id).bytes == 5
    assert client.files.content(notes.id).content == b"hello"
    assert client.files.delete(notes.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(notes.id)


def test_files_and_batches_list_in_pages(server: ServerThread) -> None:
    client = _client(server)
    made = [client.files.create(file=(f"p{i}.txt", b"x"), purpose="evals").id for i in range(3)]
    listed = client.files.list(purpose="evals", order="asc", limit=2)
    assert [f.id for f in listed.data] == made[:2] and listed.has_more
    after = client.files.list(purpose="evals", order="asc", after=made[1])
    assert [f.id for f in after.data] == made[2:]
    newest = client.files.list(purpose="evals").data
    assert [f.id for f in newest] == made[::-1]
    batches = client.batches.list(limit=100).data
    assert [b.created_at for b in batches] == sorted((b.created_at for b in batches), reverse=True)


def test_cancel_keeps_what_was_answered_and_frees_the_rest(server: ServerThread) -> None:
    client = _client(server)
    model = client.models.list().data[0].id
    lines = [
        _line(
            f"c{i}",
            "/v1/completions",
            {"model": model, "prompt": f"p {i}", "max_tokens": 300, "ignore_eos": True},
        )
        for i in range(60)
    ]
    stored = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=stored.id, endpoint="/v1/completions", completion_window="24h"
    )
    with pytest.raises(openai.ConflictError, match="cancel it first"):
        client.files.delete(stored.id)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    ok = _rows(client, batch.output_file_id)
    assert len(ok) == batch.request_counts.completed < 60
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    assert client.files.delete(stored.id).deleted  # its batch has ended
    engine_checks.wait_server_pool_empty(server)


def test_past_its_window_a_batch_expires(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(batches_module.WINDOWS, "24h", 0)
    client = _client(server)
    model = client.models.list().data[0].id
    lines = [
        _line(f"e{i}", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2}) for i in range(4)
    ]
    batch = _run(client, lines, "/v1/completions")
    assert batch.status == "expired" and batch.expired_at is not None
    bad = _rows(client, batch.error_file_id)
    ok = _rows(client, batch.output_file_id)
    assert set(bad) | set(ok) == {f"e{i}" for i in range(4)} and not set(bad) & set(ok)
    assert all(row["error"]["code"] == "batch_expired" for row in bad.values())
    assert batch.request_counts.failed == len(bad)


def test_rows_refused_for_a_full_queue_wait_and_run(tiny_config_path: Path, tmp_path: Path) -> None:
    overload = OverloadSettings(AdmissionLimits(max_waiting_requests=1))
    srv = _server(
        tiny_config_path, tmp_path, engine={"max_num_seqs": 2}, batches={"concurrency": 12}, overload=overload
    )
    with srv:
        client = _client(srv)
        model = client.models.list().data[0].id
        lines = [
            _line(
                f"q{i}",
                "/v1/completions",
                {"model": model, "prompt": f"w {i}", "max_tokens": 8, "ignore_eos": True},
            )
            for i in range(24)
        ]
        batch = _run(client, lines, "/v1/completions")
        assert batch.status == "completed"
        assert batch.request_counts.completed == 24 and batch.error_file_id is None
        metrics = httpx.get(f"{srv.url}/metrics").text
        refused = re.search(r'prefixserve_requests_refused_total\{reason="queue_requests"\} (\S+)', metrics)
        assert refused is not None and float(refused.group(1)) > 0  # rows were refused, and ran later
        engine_checks.wait_server_pool_empty(srv)


def test_a_restarted_server_resumes_without_answering_twice(tiny_config_path: Path, tmp_path: Path) -> None:
    lines = []
    with _server(tiny_config_path, tmp_path, batches={"concurrency": 1}) as srv:
        client = _client(srv)
        model = client.models.list().data[0].id
        lines = [
            _line(
                f"s{i}",
                "/v1/completions",
                {"model": model, "prompt": f"z {i}", "max_tokens": 200, "ignore_eos": True},
            )
            for i in range(12)
        ]
        stored = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=stored.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    record = json.loads((tmp_path / "batches" / batch.id / "batch.json").read_text())
    assert record["status"] == "in_progress" and 2 <= record["request_counts"]["completed"] < 12
    with _server(tiny_config_path, tmp_path) as srv:
        client = _client(srv)
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 12
        assert set(_rows(client, done.output_file_id)) == {f"s{i}" for i in range(12)}
        assert client.files.retrieve(stored.id).filename == "in.jsonl"


def test_rows_sharing_a_prefix_run_together(tiny_config_path: Path, tmp_path: Path) -> None:
    """Shuffled rows of 8 documents through a pool that holds two: in the planner's order each
    document's prefix is computed once; in the file's order it is evicted between its rows."""
    rng = random.Random(0)
    docs = [[rng.randrange(3, 500) for _ in range(96)] for _ in range(8)]
    bodies = [
        {"prompt": [*doc, rng.randrange(3, 500)], "max_tokens": 2, "temperature": 0}
        for doc in docs
        for _ in range(4)
    ]
    rng.shuffle(bodies)
    cached = {}
    for grouping in ("first_level", "none"):
        engine = {"num_kv_blocks": 16, "max_num_seqs": 2, "max_num_batched_tokens": 128}
        folder = tmp_path / grouping
        with _server(
            tiny_config_path, folder, engine=engine, batches={"grouping": grouping, "concurrency": 2}
        ) as srv:
            client = _client(srv)
            model = client.models.list().data[0].id
            lines = [_line(f"g{i}", "/v1/completions", {**b, "model": model}) for i, b in enumerate(bodies)]
            batch = _run(client, lines, "/v1/completions")
            assert batch.request_counts.completed == len(bodies)
            cached[grouping] = batch.usage.input_tokens_details.cached_tokens
            texts = {
                k: r["response"]["body"]["choices"][0]["text"]
                for k, r in _rows(client, batch.output_file_id).items()
            }
            cached[grouping + " texts"] = texts
    assert cached["first_level texts"] == cached["none texts"]  # greedy answers do not depend on the order
    assert cached["first_level"] == 8 * 3 * 96  # every row after a document's first reads it cached
    assert cached["first_level"] > 1.5 * cached["none"], cached
