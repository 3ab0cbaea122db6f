"""OpenAI's Batch API on a running server: a batch's rows run here, beside the server's other requests.

``POST /v1/batches`` names an uploaded file (``files.py``) of Batch rows. The batch is checked
(``validating``: every line a request for its endpoint, else ``failed`` with each bad line in
``errors``), then runs (``in_progress``): its rows ordered by the batch planner so that rows sharing a
prompt prefix run together (``batch_runner.run_order``, BatchLLM's grouping), at most
``concurrency`` rows in flight over all batches, each queued and answered as its route answers a
client (same checks, same 4xx bodies). Answers with status 200 go to the output file, the others
to the error file, a whole line at a time; then ``finalizing`` moves both into the file store and the batch is
``completed``. A cancel aborts the rows in flight and keeps what was answered (``cancelled``); past
its completion window the batch ``expired``, its unanswered rows in the error file as
``batch_expired``. A row refused for a full queue (429) waits and tries again: a batch never fails a
row for load. A row aborted by a failed engine step runs again; one in flight when the server stops
or the engine dies is left unanswered, for the next start to run.

Each batch's record is saved in the store's ``batches`` folder at every status change (and at most
once a second as rows finish), so a server restarted on the same ``--files-dir`` resumes its
unfinished batches where their result files stop (``batch_file.finished_keys``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from prefixserve.entrypoints.batch_file import (
    BATCH_URLS,
    BadRow,
    BatchRow,
    ResultWriter,
    finished_keys,
    read_batch,
    row_key,
    whole_lines,
)
from prefixserve.entrypoints.batch_runner import prepare_row, row_answer, row_error, run_order
from prefixserve.entrypoints.openai.answering import collect, submit
from prefixserve.entrypoints.openai.files import OUTPUT_PURPOSE, FileStore, write_atomic
from prefixserve.entrypoints.openai.requests import ServerState
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.ids import object_id
from prefixserve.protocols.openai.request_models import parse_request

log = logging.getLogger(__name__)

WINDOWS = {"24h": 24 * 3600}  # OpenAI's only completion window
MAX_ROWS = 50_000  # OpenAI's limit on a batch's requests
MAX_LISTED_ERRORS = 100  # bad lines named in a failed batch's ``errors``
SAVE_EVERY_S = 1.0  # at most this often a running batch's counts are saved
MAX_ABORTED_TRIES = 3  # a row aborted by this many failed steps is answered as an engine error
FINAL = frozenset({"failed", "completed", "expired", "cancelled"})
EXPIRED_ERROR = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}


class BatchRequest(BaseModel):
    """``POST /v1/batches``'s body."""

    model_config = ConfigDict(extra="ignore", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; results are kept until deleted


def check_batch_request(data: Any) -> BatchRequest:
    req: BatchRequest = parse_request(BatchRequest, data, "input_file_id")
    if req.endpoint not in BATCH_URLS:
        message = f"endpoint must be one of {', '.join(BATCH_URLS)}, got {req.endpoint!r}"
        raise APIError(400, message, param="endpoint")
    if req.completion_window not in WINDOWS:
        message = f"completion_window must be one of {', '.join(WINDOWS)}, got {req.completion_window!r}"
        raise APIError(400, message, param="completion_window")
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        message = "metadata takes at most 16 pairs, keys of at most 64 characters, values of at most 512"
        raise APIError(400, message, param="metadata")
    return req


@dataclass(eq=False)
class BatchJob:
    """One batch: its Batch object (``record``), where its results go, and its run's flags."""

    record: dict[str, Any]
    folder: Path  # the batch's record and result files until they are finalized
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # cancelled, expired or the engine gone
    task: asyncio.Task[None] | None = None
    saved_at: float = 0.0
    answered: set[tuple[str, str]] = field(default_factory=set)

    @property
    def id(self) -> str:
        return str(self.record["id"])

    @property
    def status(self) -> str:
        return str(self.record["status"])

    def public(self) -> dict[str, Any]:
        return {k: v for k, v in self.record.items() if not k.startswith("_")}

    def expire(self) -> None:
        """The completion window has passed: what is unanswered is answered ``batch_expired``."""
        self.record["_expired"] = True
        self.stop.set()


def _now() -> int:
    return int(time.time())


def _add_usage(total: dict[str, Any], body: dict[str, Any]) -> None:
    """A 200 body's usage into the batch's (chat/completion and response shapes alike)."""
    u = body.get("usage") or {}
    inp = u.get("prompt_tokens", u.get("input_tokens", 0))
    out = u.get("completion_tokens", u.get("output_tokens", 0))
    cached = (u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (u.get("completion_tokens_details") or u.get("output_tokens_details") or {}).get(
        "reasoning_tokens", 0
    )
    total["input_tokens"] += inp
    total["output_tokens"] += out
    total["total_tokens"] += inp + out
    total["input_tokens_details"]["cached_tokens"] += cached or 0
    total["output_tokens_details"]["reasoning_tokens"] += reasoning or 0


def _zero_usage() -> dict[str, Any]:
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }


class BatchRuns:
    """The server's batches: created, run as tasks of this process, saved, resumed at start."""

    def __init__(
        self,
        state: ServerState,
        files: FileStore,
        concurrency: int,
        grouping: str = "first_level",
        tag: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"the batch concurrency must be >= 1 row, got {concurrency}")
        self.state, self.files, self.concurrency, self.grouping, self.tag = (
            state,
            files,
            concurrency,
            grouping,
            tag,
        )
        self.root = files.root / "batches"
        self.root.mkdir(parents=True, exist_ok=True)
        # rows in flight over every batch together: the queue's room for live requests does not
        # shrink with the number of batches
        self.slots = asyncio.Semaphore(concurrency)
        self.halting = False  # the server is stopping: no row starts, none aborted counts as answered
        self.jobs: dict[str, BatchJob] = {}
        for path in sorted(self.root.glob("batch_*/batch.json")):
            try:
                record = json.loads(path.read_bytes())
            except (OSError, ValueError):
                log.warning("skipping an unreadable batch record %s", path)
                continue
            self.jobs[record["id"]] = BatchJob(record, path.parent)

    # ---- the API's operations ------------------------------------------------------------------
    def create(self, req: BatchRequest, messages_api: bool = False) -> dict[str, Any]:
        """A batch of ``req``'s file, started now. ``messages_api``: made through Anthropic's Message
        Batches API, which alone shows it and owns its requests file."""
        stored = self.files.get(req.input_file_id)
        if stored.purpose != "batch":
            message = (
                f"file {stored.id} has purpose {stored.purpose!r}: a batch reads a file of purpose 'batch'"
            )
            raise APIError(400, message, param="input_file_id")
        batch_id = object_id("batch", self.tag)
        now_ns = time.time_ns()
        now = now_ns // 10**9
        record: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": req.endpoint,
            "model": self.state.model,
            "errors": None,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOWS[req.completion_window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": _zero_usage(),
            "metadata": req.metadata,
            "_output_id": object_id("file", self.files.tag, "-"),
            "_error_id": object_id("file", self.files.tag, "-"),
            "_created_ns": now_ns,  # orders batches made in the same second
            "_messages_api": messages_api,
        }
        job = BatchJob(record, self.root / batch_id)
        job.folder.mkdir(parents=True)
        self._save(job)
        self.jobs[batch_id] = job
        self._start(job)
        return job.public()

    def get(self, batch_id: str) -> BatchJob:
        job = self.jobs.get(batch_id)
        if job is None:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id", code="not_found")
        return job

    def listed(self) -> list[dict[str, Any]]:
        """Every batch, newest first."""
        jobs = sorted(self.jobs.values(), key=lambda j: (j.record["_created_ns"], j.id), reverse=True)
        return [j.public() for j in jobs]

    def cancel(self, batch_id: str) -> dict[str, Any]:
        job = self.get(batch_id)
        if job.status in FINAL or job.status == "finalizing":
            raise APIError(409, f"batch {batch_id} is {job.status}: only a running batch can be cancelled")
        if job.status != "cancelling":
            self._set(job, "cancelling")
            job.stop.set()
            if job.task is None or job.task.done():  # not running (the engine stopped): ends now
                self._start(job)
        return job.public()

    def delete(self, batch_id: str) -> None:
        """An ended batch, its input and its results gone (Anthropic's delete)."""
        job = self.get(batch_id)
        if job.status not in FINAL:
            raise APIError(409, f"batch {batch_id} is {job.status}: cancel it and wait for it to end first")
        for key in ("input_file_id", "output_file_id", "error_file_id"):
            with contextlib.suppress(APIError):
                if job.record[key] is not None:
                    self.files.delete(job.record[key])
        del self.jobs[batch_id]
        shutil.rmtree(job.folder, ignore_errors=True)

    def in_use(self, file_id: str) -> BatchJob | None:
        """The batch that still needs ``file_id``: an unfinished one reading it, or a message batch
        whose requests it holds (its results are read in their order until the batch is deleted)."""
        return next(
            (
                j
                for j in self.jobs.values()
                if (j.status not in FINAL or j.record.get("_messages_api"))
                and j.record["input_file_id"] == file_id
            ),
            None,
        )

    # ---- running -------------------------------------------------------------------------------
    def resume(self) -> None:
        """Start a task for every unfinished batch (at the server's start)."""
        for job in self.jobs.values():
            if job.status not in FINAL:
                self._start(job)

    def halt(self) -> None:
        """The server is stopping (before it aborts what runs): no row starts and no aborted row is
        written; each unfinished batch resumes when a server starts on the same store."""
        self.halting = True
        for job in self.jobs.values():
            job.stop.set()

    async def stop_all(self) -> None:
        """Stop every running batch's task (the server is stopping): records stay as they are, and
        a server started on the same store resumes them."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in self.jobs.values():
            self._save(job)

    def _start(self, job: BatchJob) -> None:
        job.stop = asyncio.Event()
        if job.status == "cancelling":
            job.stop.set()
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"batch {job.id}")

    async def _run(self, job: BatchJob) -> None:
        try:
            rows, errors = await self._validated(job)
            if job.status == "cancelling" and rows is None:  # cancelled while it was checked
                await self._finish(job)
                return
            if rows is None:
                self._fail(job, errors)
                return
            if job.status == "validating":
                self._set(job, "in_progress")
            if job.status == "in_progress":
                await self._run_rows(job, rows)
            await self._finish(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: the batch fails with its name, the server goes on
            log.exception("batch %s failed", job.id)
            self._fail(job, [{"code": "internal_error", "message": f"internal error: {type(exc).__name__}"}])

    async def _validated(self, job: BatchJob) -> tuple[list[BatchRow] | None, list[dict[str, Any]]]:
        """The input file's rows, or None and what fails the batch (each bad line named)."""
        try:
            stored = self.files.get(job.record["input_file_id"])
        except APIError:
            return None, [{"code": "missing_file", "message": "the batch's input file was deleted"}]
        read = await asyncio.to_thread(read_batch, stored.path)
        errors = []
        for row in read:
            if isinstance(row, BadRow):
                errors.append({"code": row.code, "message": row.message, "line": row.line})
            elif row.url != job.record["endpoint"]:
                message = (
                    f"line {row.line}: url {row.url!r} is not the batch's endpoint {job.record['endpoint']!r}"
                )
                errors.append(
                    {"code": "mismatched_endpoint", "message": message, "line": row.line, "param": "url"}
                )
        if not read:
            errors.append({"code": "empty_file", "message": "the input file has no requests"})
        if len(read) > MAX_ROWS:
            errors.append(
                {
                    "code": "too_many_requests",
                    "message": f"a batch takes at most {MAX_ROWS} requests, got {len(read)}",
                }
            )
        if errors:
            return None, errors
        job.record["request_counts"]["total"] = len(read)
        return [row for row in read if isinstance(row, BatchRow)], []

    def _result_path(self, job: BatchJob, name: str, planned: str) -> Path:
        """A result file: in the batch's folder while it runs, in the store once ``_finish`` moved it
        there (a resume after a kill in between finds it where it is)."""
        here = job.folder / name
        stored = self.files.root / job.record[planned]
        return stored if not here.exists() and stored.exists() else here

    def _recount(self, job: BatchJob) -> None:
        """Counts, usage and answered rows from the result files (a line torn by a kill cut off):
        what a resumed batch has answered, whatever its record last saved."""
        out_path = self._result_path(job, "output.jsonl", "_output_id")
        err_path = self._result_path(job, "errors.jsonl", "_error_id")
        counts, usage = job.record["request_counts"], _zero_usage()
        ok_done, err_done = finished_keys(out_path), finished_keys(err_path)
        counts["completed"], counts["failed"] = len(ok_done), len(err_done)
        job.answered = ok_done | err_done
        for line in whole_lines(out_path):
            _add_usage(usage, (json.loads(line).get("response") or {}).get("body") or {})
        job.record["usage"] = usage
        job.record["_expired_rows"] = sum(
            (json.loads(line).get("error") or {}).get("code") == EXPIRED_ERROR["code"]
            for line in whole_lines(err_path)
        )

    async def _run_rows(self, job: BatchJob, rows: list[BatchRow]) -> None:
        out_path, err_path = job.folder / "output.jsonl", job.folder / "errors.jsonl"
        counts = job.record["request_counts"]
        await asyncio.to_thread(self._recount, job)
        todo = [row for row in rows if row_key(row) not in job.answered]
        order = todo
        if self.grouping != "none":
            order = await asyncio.to_thread(run_order, self.state, todo, self.grouping)
        expiry = asyncio.get_running_loop().call_later(
            max(0.0, job.record["expires_at"] - time.time()), job.expire
        )
        slots = self.slots
        running: set[asyncio.Task[None]] = set()
        try:
            with ResultWriter(out_path) as ok, ResultWriter(err_path) as bad:
                for row in order:
                    await slots.acquire()
                    if job.stop.is_set():
                        slots.release()
                        break
                    task = asyncio.create_task(self._row(job, row, ok, bad))
                    task.add_done_callback(lambda _: slots.release())
                    running.add(task)
                    task.add_done_callback(running.discard)
                await asyncio.gather(*running)
                if job.record.get("_expired") and job.status == "in_progress":
                    for row in rows:
                        if row_key(row) not in job.answered:
                            bad.write(_expired_row(row))
                            counts["failed"] += 1
        finally:
            expiry.cancel()
            for task in running:
                task.cancel()

    async def _row(self, job: BatchJob, row: BatchRow, ok: ResultWriter, bad: ResultWriter) -> None:
        line = await self._answer(job, row)
        if line is None:  # cancelled, expired or the engine stopped: not answered
            return
        status = line["response"]["status_code"]
        (ok if status == 200 else bad).write(line)
        job.answered.add(row_key(row))
        job.record["request_counts"]["completed" if status == 200 else "failed"] += 1
        if status == 200:
            _add_usage(job.record["usage"], line["response"]["body"])
        if time.monotonic() - job.saved_at >= SAVE_EVERY_S:
            self._save(job, durable=False)

    async def _answer(self, job: BatchJob, row: BatchRow) -> dict[str, Any] | None:
        """The row's output line, as its route would answer it; None if the batch stopped first."""
        state = self.state

        async def stopped() -> bool:
            return job.stop.is_set()

        aborted = 0
        while not job.stop.is_set():
            try:
                prep, call = prepare_row(state, row)  # again at each try: a fresh request id
                sink: asyncio.Queue[Any] = asyncio.Queue()
                ids = await submit(state, prep, sink, progress=False)
                finals = await collect(state, stopped, ids, sink)
            except APIError as exc:
                if exc.status == 429:  # the queue is full: wait as a client is told to, then again
                    await _wait(job, float((exc.headers or {}).get("Retry-After", 1)))
                    continue
                if exc.status == 503 or self._engine_gone(job):  # the batch waits for a restart
                    log.error("batch %s stops: %s", job.id, exc.message)
                    job.stop.set()
                    return None
                return row_error(row, exc)
            if finals is None:
                return None
            if any(c.finish_reason == "abort" for f in finals for c in f.outputs):
                # aborted, not answered: the server is stopping, or a failed step aborted everything
                if self._engine_gone(job):
                    return None
                aborted += 1
                if aborted >= MAX_ABORTED_TRIES:  # a row that fails every step it is in: not forever
                    message = f"the engine failed a step running this request {aborted} times"
                    return row_error(row, APIError(500, message, code="engine_error"))
                await _wait(job, 1.0)
                continue
            return row_answer(state, row, prep, call, finals)
        return None

    def _engine_gone(self, job: BatchJob) -> bool:
        """True (and the batch stops, to resume at the next start) once the engine no longer runs or
        the server is stopping: a row failed then was not answered."""
        if self.halting or not self.state.loop.alive:
            job.stop.set()
            return True
        return False

    async def _finish(self, job: BatchJob) -> None:
        """Results into the file store; the batch's final status."""
        if self.halting or (
            job.status == "in_progress" and job.stop.is_set() and not job.record.get("_expired")
        ):
            return  # the engine stopped, or the server is stopping: resumed at the next start
        await asyncio.to_thread(self._recount, job)
        if job.status == "cancelling":
            ended = "cancelled"
        else:
            ended = "expired" if job.record.get("_expired") else "completed"
            if job.status != "finalizing":
                self._set(job, "finalizing")
        outputs = (
            ("output.jsonl", "_output_id", "output_file_id"),
            ("errors.jsonl", "_error_id", "error_file_id"),
        )
        for name, planned, shown in outputs:
            stored = self.files.adopt(
                job.folder / name, f"{job.id}_{name}", OUTPUT_PURPOSE, job.record[planned]
            )
            if stored is not None:
                job.record[shown] = stored.id
        self._set(job, ended)

    # ---- records -------------------------------------------------------------------------------
    def _set(self, job: BatchJob, status: str) -> None:
        job.record["status"] = status
        job.record[f"{status}_at"] = _now()
        self._save(job)

    def _fail(self, job: BatchJob, errors: list[dict[str, Any]]) -> None:
        listed = errors[:MAX_LISTED_ERRORS]
        job.record["errors"] = {
            "object": "list",
            "data": [{"param": None, "line": None, **e} for e in listed],
        }
        self._set(job, "failed")

    def _save(self, job: BatchJob, durable: bool = True) -> None:
        """The record to disk; ``durable=False`` (counts as rows finish) skips the fsync: a resume
        recounts from the result files anyway."""
        job.saved_at = time.monotonic()
        job.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(job.folder / "batch.json", json.dumps(job.record).encode(), durable)


async def _wait(job: BatchJob, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(job.stop.wait(), max(0.1, seconds))


def _expired_row(row: BatchRow) -> dict[str, Any]:
    return {
        "id": object_id("batch_req"),
        "custom_id": row.custom_id,
        "response": None,
        "error": EXPIRED_ERROR,
    }
