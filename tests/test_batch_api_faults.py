"""The Batch API's and Message Batches API's failure paths: result lines holding U+2028 and its kin,
a kill between moving the results into the store and the final record, a row that fails every step,
engine death racing a row's error, oversized creates, and a message batch's requests file kept while
the batch is. (The main suite: ``test_batch_api.py``.)"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.model.parallel import WorkerDiedError
from tests.test_batch_api import (
    _client,
    _create,
    _line,
    _long_rows,
    _rows,
    _run,
    _running_then_broken,
    _server,
    _wait,
)

anthropic = pytest.importorskip("anthropic")


def _aclient(srv: Any) -> Any:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)


def _ended(client: Any, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while (b := client.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, b
        time.sleep(0.05)
    return b


# U+2028 / U+0085 in a result line: str.splitlines() splits it, json.loads fails
def test_openai_batch_with_line_separator_in_custom_id_completes(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    with _server(tiny_config_path, tmp_path) as srv:
        client = _client(srv)
        model = client.models.list().data[0].id
        lines = [_line("a\u2028b", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2})]
        batch = _run(client, lines, "/v1/completions")
        assert batch.status == "completed", batch


def test_message_batch_results_survive_a_line_separator(tiny_config_path: Path, tmp_path: Path) -> None:
    with _server(tiny_config_path, tmp_path) as srv:
        client = _aclient(srv)
        ok = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        bad = {**ok, "model": "nope\u2028x"}  # its 404 message echoes the model name
        b = client.messages.batches.create(
            requests=[{"custom_id": "ok", "params": ok}, {"custom_id": "bad", "params": bad}]
        )
        b = _ended(client, b.id)
        assert (b.request_counts.succeeded, b.request_counts.errored) == (1, 1)
        kinds = [r.result.type for r in client.messages.batches.results(b.id)]
        assert kinds == ["succeeded", "errored"]


# a crash after the output file moved into the store, before the final record: counts lost
def test_resume_after_output_adopted_keeps_counts(tiny_config_path: Path, tmp_path: Path) -> None:
    with _server(tiny_config_path, tmp_path) as srv:
        client = _client(srv)
        model = client.models.list().data[0].id
        done = _wait(client, _create(client, _long_rows(model, 5, 2)).id)
        assert done.status == "completed" and done.request_counts.completed == 5
    rec_path = tmp_path / "batches" / done.id / "batch.json"
    rec = json.loads(rec_path.read_text())
    # the state of a kill right after adopt() moved output.jsonl (status 'finalizing' was saved)
    rec.update(status="finalizing", completed_at=None, output_file_id=None, error_file_id=None)
    rec_path.write_text(json.dumps(rec))
    with _server(tiny_config_path, tmp_path) as srv:
        client = _client(srv)
        again = _wait(client, done.id)
        assert again.status == "completed" and again.output_file_id is not None
        assert len(_rows(client, again.output_file_id)) == 5
        assert again.request_counts.completed == 5, again.request_counts
        assert again.usage.output_tokens == 10, again.usage


def _poisoned(engine: Any) -> None:
    """Every engine step with a request in it raises (a row no step can run; run on the engine's
    thread): the server's guard aborts them all, and its flushing step, with none left, runs."""
    step = engine.step

    def failing() -> Any:
        if engine.requests:
            raise RuntimeError("poison")
        return step()

    engine.step = failing


def test_a_row_that_always_aborts_does_not_run_forever(tiny_config_path: Path, tmp_path: Path) -> None:
    with _server(tiny_config_path, tmp_path, batches={"concurrency": 1}) as srv:
        client = _client(srv)
        model = client.models.list().data[0].id
        srv.engine_loop.call(_poisoned).result(10)
        batch = _create(client, _long_rows(model, 1, 2))
        deadline = time.monotonic() + 30
        while (b := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"still {b.status} after 30 s: {b.request_counts}"
            time.sleep(0.2)
        assert b.request_counts.failed == 1
        assert "failed a step" in json.dumps(list(_rows(client, b.error_file_id).values()))


# engine death: outputs 'error' delivered before loop.alive turns False -> row written errored
def test_engine_death_race_does_not_fail_rows(
    tiny_config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixserve.serving import engine_thread

    original = engine_thread.EngineLoop._refuse_queued

    def late(self: Any) -> None:  # widen the window between _deliver(outputs) and _stopping=True
        time.sleep(0.5)
        original(self)

    monkeypatch.setattr(engine_thread.EngineLoop, "_refuse_queued", late)
    with _server(tiny_config_path, tmp_path, batches={"concurrency": 3}) as srv:
        batch = _running_then_broken(srv, _client(srv), WorkerDiedError("gone"))
        time.sleep(1.5)
    errors = tmp_path / "batches" / batch.id / "errors.jsonl"
    assert not errors.exists() or not errors.read_text(), errors.read_text()[:300]


# past the limit a create is refused, naming it, not accepted and then all 'errored'
def test_message_batch_over_50k_not_silently_all_errored(tiny_config_path: Path, tmp_path: Path) -> None:
    with _server(tiny_config_path, tmp_path, batches={"max_file_bytes": 1 << 30}) as srv:
        p = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        reqs = [{"custom_id": f"r{i}", "params": p} for i in range(50_001)]
        r = httpx.post(f"{srv.url}/v1/messages/batches", json={"requests": reqs}, timeout=120)
        assert r.status_code == 400 and "at most 50000" in r.json()["error"]["message"], r.text[:300]


# the results depend on the requests file, which /v1/files lists and lets a client delete
def test_message_batch_results_after_its_requests_file_is_deleted(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    with _server(tiny_config_path, tmp_path) as srv:
        client = _aclient(srv)
        p = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        b = client.messages.batches.create(requests=[{"custom_id": "a", "params": p}])
        _ended(client, b.id)
        files = httpx.get(f"{srv.url}/v1/files", params={"purpose": "batch"}).json()["data"]
        mine = [f["id"] for f in files if f["filename"] == "message_batch_requests.jsonl"]
        refused = httpx.delete(f"{srv.url}/v1/files/{mine[0]}")
        assert refused.status_code == 409 and "delete that instead" in refused.json()["error"]["message"]
        r = httpx.get(f"{srv.url}/v1/messages/batches/{b.id}/results")
        assert r.status_code == 200, r.text
        client.messages.batches.delete(b.id)  # the batch, its requests and results go together
        assert httpx.get(f"{srv.url}/v1/files/{mine[0]}").status_code == 404


def test_engine_death_in_its_own_process_leaves_rows_for_the_restart(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    """The engine process says it is dying before its requests hear they failed: the batch's rows in
    flight wait for a restart, none is written as an error."""
    with _server(tiny_config_path, tmp_path, engine_process=True, batches={"concurrency": 3}) as srv:
        # six rows: the break goes to the engine process through its pipe (the first call there
        # imports the test module, seconds on a loaded machine) while three more rows keep it busy
        batch = _running_then_broken(srv, _client(srv), WorkerDiedError("gone"), rows=6)
        deadline = time.monotonic() + 30
        while srv.engine_loop.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
    errors = tmp_path / "batches" / batch.id / "errors.jsonl"
    assert not errors.exists() or not errors.read_text(), errors.read_text()[:300]
