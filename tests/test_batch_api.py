"""OpenAI's Files and Batch API on a live server, through the official client: rows answered as their
routes answer clients, bad files failed with their lines named, cancel, expiry, 429s retried, a
restart resumed without answering a row twice, and prefix-sharing groups run together."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from prefixserve.config import EngineConfig
from prefixserve.serving.admission import AdmissionLimits
from tests import engine_checks

openai = pytest.importorskip("openai")

from prefixserve.entrypoints.openai import batches as batches_module  # noqa: E402
from prefixserve.entrypoints.openai.batch_settings import BatchSettings  # noqa: E402
from prefixserve.entrypoints.openai.server import ServerThread, build_app  # noqa: E402
from prefixserve.serving.overload import OverloadSettings  # noqa: E402

ENDED = ("completed", "failed", "cancelled", "expired")
RESUMED_ROWS = 6  # the batch a restarted server resumes
BROKEN_ROWS = 3  # the batch's concurrency in the tests that break a step: every row in flight


def _server(config_path: Path, files_dir: Path, grace_s: float = 2.0, **kwargs: Any) -> ServerThread:
    engine = {"num_kv_blocks": 512, "max_num_seqs": 16, **kwargs.pop("engine", {})}
    config = EngineConfig(model=f"dummy:{config_path}", device="cpu", dtype="float32", **engine)
    batches = BatchSettings(str(files_dir), **kwargs.pop("batches", {}))
    return ServerThread(build_app(config, batches=batches, **kwargs), grace_s=grace_s)


def _client(srv: ServerThread) -> Any:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(tiny_config_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with _server(tiny_config_path, tmp_path_factory.mktemp("files")) as srv:
        yield srv


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _long_rows(model: str, count: int, tokens: int, tag: str = "r") -> list[str]:
    body = {"model": model, "max_tokens": tokens, "ignore_eos": True}
    return [_line(f"{tag}{i}", "/v1/completions", {**body, "prompt": f"{tag} {i}"}) for i in range(count)]


def _create(client: Any, lines: list[str]) -> Any:
    stored = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    return client.batches.create(input_file_id=stored.id, endpoint="/v1/completions", completion_window="24h")


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
        "/v1/embeddings": [{"model": model, "input": [f"shared words then {i}", "x"]} for i in range(3)],
    }
    for url, rows in bodies.items():
        greedy = {} if url == "/v1/embeddings" else {"temperature": 0}
        lines = [_line(f"{url}-{i}", url, {**body, **greedy}) for i, body in enumerate(rows)]
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
                "completion_tokens", row["response"]["body"]["usage"].get("output_tokens", 0)
            )
            for row in ok.values()
        )
        for i, body in enumerate(rows):  # the same greedy answer as the route gives a client
            got = ok[f"{url}-{i}"]["response"]["body"]
            assert ok[f"{url}-{i}"]["response"]["status_code"] == 200
            if url == "/v1/completions":
                direct = client.completions.create(**{**body, "temperature": 0})
                assert got["choices"][0]["text"] == direct.choices[0].text
            elif url == "/v1/embeddings":
                direct = client.embeddings.create(**body)
                for mine, theirs in zip(got["data"], direct.data, strict=True):  # batch mates change rounding
                    assert np.allclose(mine["embedding"], theirs.embedding, atol=1e-5)
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
        client.batches.create(input_file_id=stored.id, endpoint="/v1/moderations", completion_window="24h")
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
    batch = _create(client, _long_rows(model, 60, 300, "c"))
    stored = client.files.retrieve(batch.input_file_id)
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
        # rows sent at once: the queue takes one, the others are refused and try again after
        # Retry-After (1 s), about one a try
        lines = [
            _line(
                f"q{i}",
                "/v1/completions",
                {"model": model, "prompt": f"w {i}", "max_tokens": 8, "ignore_eos": True},
            )
            for i in range(4)
        ]
        batch = _run(client, lines, "/v1/completions")
        assert batch.status == "completed"
        assert batch.request_counts.completed == 4 and batch.error_file_id is None
        metrics = httpx.get(f"{srv.url}/metrics").text
        refused = re.search(r'prefixserve_requests_refused_total\{reason="queue_requests"\} (\S+)', metrics)
        assert refused is not None and float(refused.group(1)) > 0  # rows were refused, and ran later
        engine_checks.wait_server_pool_empty(srv)


def test_a_restarted_server_resumes_without_answering_twice(tiny_config_path: Path, tmp_path: Path) -> None:
    """Six rows, two at a time: the server stops once two are answered, the restarted one answers
    the rest (more rows would only repeat the same resumed path). Its grace period (0.5 s) is
    shorter than a row (200 steps), so the rows running when it stops are aborted, not finished
    meanwhile."""
    with _server(tiny_config_path, tmp_path, grace_s=0.5, batches={"concurrency": 2}) as srv:
        client = _client(srv)
        model = client.models.list().data[0].id
        batch = _create(client, _long_rows(model, RESUMED_ROWS, 200, "s"))
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # a client's stream still open: the server aborts what runs after its grace period, and the
        # batch's row aborted then must not count as answered
        stream = client.completions.create(
            model=model, prompt="long", max_tokens=1900, stream=True, extra_body={"ignore_eos": True}
        )
        reader = threading.Thread(target=lambda: list(stream), daemon=True)
        reader.start()
    reader.join(30)
    record = json.loads((tmp_path / "batches" / batch.id / "batch.json").read_text())
    assert record["status"] == "in_progress" and 2 <= record["request_counts"]["completed"] < RESUMED_ROWS
    with _server(tiny_config_path, tmp_path) as srv:
        client = _client(srv)
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == RESUMED_ROWS
        rows = _rows(client, done.output_file_id)
        assert set(rows) == {f"s{i}" for i in range(RESUMED_ROWS)}
        for row in rows.values():  # every answer whole: none cut short by the shutdown's abort
            body = row["response"]["body"]
            assert (
                body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 200
            )
        assert client.files.retrieve(batch.input_file_id).filename == "in.jsonl"


def _break_steps(engine: Any, error: BaseException, times: int) -> None:
    """The engine's next ``times`` steps raise ``error`` (run on the engine's thread)."""
    step, left = engine.step, [times]

    def failing() -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise error
        return step()

    engine.step = failing


def _running_then_broken(
    srv: ServerThread, client: Any, error: BaseException, rows: int = BROKEN_ROWS
) -> Any:
    """A batch of ``rows`` long rows, running, then one engine step raising ``error`` (on an engine
    thread, more rows than run at once would only add steps: the rows not yet started run as any
    other)."""
    batch = _create(client, _long_rows(client.models.list().data[0].id, rows, 150))
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)
    srv.engine_loop.call(functools.partial(_break_steps, error=error, times=1)).result(10)
    return batch


def test_rows_a_failed_step_aborted_run_again(tiny_config_path: Path, tmp_path: Path) -> None:
    """A step that raises aborts every request (the server goes on): the batch's rows then in flight
    run again, never written cut short."""
    with _server(tiny_config_path, tmp_path, batches={"concurrency": 3}) as srv:
        client = _client(srv)
        batch = _running_then_broken(srv, client, RuntimeError("a failed step"))
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == BROKEN_ROWS
        for row in _rows(client, done.output_file_id).values():
            assert row["response"]["body"]["choices"][0]["finish_reason"] == "length"


def test_rows_in_flight_when_the_engine_dies_wait_for_a_restart(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    from prefixserve.model.parallel import WorkerDiedError

    with _server(tiny_config_path, tmp_path, batches={"concurrency": 3}) as srv:
        client = _client(srv)
        batch = _running_then_broken(srv, client, WorkerDiedError("a worker died"))
        time.sleep(1.5)
        stalled = client.batches.retrieve(batch.id)
        assert stalled.status == "in_progress" and stalled.request_counts.failed == 0
    assert not (tmp_path / "batches" / batch.id / "errors.jsonl").read_text()  # no row failed for it
    with _server(tiny_config_path, tmp_path) as srv:
        done = _wait(_client(srv), batch.id)
        assert done.status == "completed" and done.request_counts.completed == BROKEN_ROWS


def test_batches_together_leave_the_queue_to_live_requests(tiny_config_path: Path, tmp_path: Path) -> None:
    """Rows in flight are bounded over all batches: four batches at once do not fill the queue.

    The four live requests go at once and wait behind the running rows together. The batches hold 4
    rows in flight (twice max_num_seqs), so when the k-th live request arrives at most 4 + k - 1
    requests wait, below the bound of 8 for k <= 4 even in the instant when no row counts as running
    (a slot freed, its next row not yet scheduled). Without the bound over all batches, 16 rows
    would be in flight and the first live request would already be refused."""
    with _server(tiny_config_path, tmp_path, engine={"max_num_seqs": 2}) as srv:
        client = _client(srv)
        model = client.models.list().data[0].id
        made = [_create(client, _long_rows(model, 8, 50, tag)) for tag in "abcd"]  # 800 steps of rows
        deadline = time.monotonic() + 30
        while sum(client.batches.retrieve(b.id).status == "in_progress" for b in made) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.5)  # the rows planned and queued

        def live(i: int) -> Any:
            return client.completions.create(model=model, prompt=f"live {i}", max_tokens=2)

        # the default bound: 4 x max_num_seqs = 8 waiting; the batches hold 4 rows in all
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(live, range(4)))
        assert [out.choices[0].finish_reason for out in outs] == ["length"] * 4
        for batch in made:
            with contextlib.suppress(openai.ConflictError):  # one may have ended meanwhile
                client.batches.cancel(batch.id)
            assert _wait(client, batch.id).status in ("cancelled", "completed")
        engine_checks.wait_server_pool_empty(srv)


def test_a_batch_resumed_while_cancelling_counts_its_whole_lines(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    with _server(tiny_config_path, tmp_path, batches={"concurrency": 1}) as srv:
        client = _client(srv)
        batch = _create(client, _long_rows(client.models.list().data[0].id, 12, 50))
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    folder = tmp_path / "batches" / batch.id
    record = json.loads((folder / "batch.json").read_text())  # as if killed mid-cancel, counts stale
    record.update(status="cancelling", request_counts={"total": 12, "completed": 0, "failed": 0})
    (folder / "batch.json").write_text(json.dumps(record))
    whole = len((folder / "output.jsonl").read_text().splitlines())
    with open(folder / "output.jsonl", "a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "r9", "resp')  # a line torn by the kill
    with _server(tiny_config_path, tmp_path) as srv:
        client = _client(srv)
        done = _wait(client, batch.id)
        assert done.status == "cancelled" and done.request_counts.completed == whole >= 2
        assert len(_rows(client, done.output_file_id)) == whole  # every line whole JSON


def test_a_cancel_while_the_file_is_checked_ends_cancelled(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = batches_module.read_batch

    def slow_read(path: Any) -> Any:
        time.sleep(1.0)
        return read(path)

    monkeypatch.setattr(batches_module, "read_batch", slow_read)
    client = _client(server)
    batch = _create(client, ["{not json"])
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert _wait(client, batch.id).status == "cancelled"


def test_an_upload_without_a_length_stops_at_the_limit(tiny_config_path: Path, tmp_path: Path) -> None:
    """A chunked upload past --max-file-bytes is refused as it arrives, not after it all spooled."""
    import asyncio

    app = build_app(
        EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64),
        batches=BatchSettings(str(tmp_path), max_file_bytes=1000),
    )
    sent, answer = [0], {}
    head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\n'

    async def receive() -> dict[str, Any]:
        chunk = head if sent[0] == 0 else b"x" * 65536
        sent[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": sent[0] < 50 << 20}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/files",
        "raw_path": b"/v1/files",
        "query_string": b"",
        "headers": [(b"content-type", b"multipart/form-data; boundary=b")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
        "root_path": "",
    }
    asyncio.run(app(scope, receive, send))
    assert answer["status"] == 413 and sent[0] < 1 << 20


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


def test_results_moved_into_the_store_survive_a_crash_between_move_and_metadata(tmp_path: Path) -> None:
    from prefixserve.entrypoints.openai.files import FileStore

    store = FileStore(tmp_path / "store")
    source = tmp_path / "output.jsonl"
    source.write_text('{"custom_id": "a"}\n')
    stored = store.adopt(source, "out.jsonl", "batch_output", "file-planned")
    assert stored is not None and store.get("file-planned").bytes == stored.bytes
    (tmp_path / "store" / "file-planned.json").unlink()  # killed after the move, before its metadata
    again = store.adopt(source, "out.jsonl", "batch_output", "file-planned")
    assert again is not None and store.get("file-planned").path.read_text() == '{"custom_id": "a"}\n'
    empty = tmp_path / "errors.jsonl"
    empty.write_text("")
    assert store.adopt(empty, "e.jsonl", "batch_output", "file-none") is None and not empty.exists()


def test_anthropic_message_batches_through_its_client(server: ServerThread) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    params = [
        {
            "model": "default",
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"hi {i}"}],
        }
        for i in range(3)
    ]
    sent = [{"custom_id": f"m{i}", "params": p} for i, p in enumerate(params)]
    sent.append(
        {
            "custom_id": "no-max",
            "params": {"model": "default", "messages": [{"role": "user", "content": "x"}]},
        }
    )
    batch = client.messages.batches.create(requests=sent)
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 4 and batch.results_url is None
    deadline = time.monotonic() + 60
    while (batch := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.processing, counts.canceled) == (3, 1, 0, 0)
    results = list(client.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["m0", "m1", "m2", "no-max"]  # the order sent
    for r, p in zip(results[:3], params, strict=True):  # the same greedy message as the route answers
        sdk = {k: v for k, v in p.items() if k != "temperature"}  # not a create() argument in this SDK
        direct = client.messages.create(**sdk, extra_body={"temperature": 0})
        assert r.result.type == "succeeded" and r.result.message.content[0].text == direct.content[0].text
    assert results[3].result.type == "errored" and "max_tokens" in results[3].result.error.error.message

    long = {
        "model": "default",
        "max_tokens": 300,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "go"}],
    }
    cancelled = client.messages.batches.create(
        requests=[{"custom_id": f"c{i}", "params": long} for i in range(40)]
    )
    assert client.messages.batches.cancel(cancelled.id).processing_status in ("canceling", "ended")
    while (cancelled := client.messages.batches.retrieve(cancelled.id)).processing_status != "ended":
        time.sleep(0.05)
    kinds = [r.result.type for r in client.messages.batches.results(cancelled.id)]
    assert (
        len(kinds) == 40
        and "canceled" in kinds
        and cancelled.request_counts.canceled == kinds.count("canceled")
    )

    listed = client.messages.batches.list(limit=1)
    assert [b.id for b in listed.data] == [cancelled.id] and listed.has_more  # newest first
    assert [b.id for b in client.messages.batches.list(after_id=cancelled.id, limit=1).data] == [batch.id]
    assert [b.id for b in client.messages.batches.list(before_id=batch.id, limit=5).data] == [cancelled.id]
    with pytest.raises(anthropic.BadRequestError, match="twice"):
        client.messages.batches.create(requests=[sent[0], sent[0]])
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        client.messages.batches.create(requests=[{"custom_id": "a b", "params": params[0]}])
    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    engine_checks.wait_server_pool_empty(server)
