"""Anthropic's Message Batches API (``/v1/messages/batches``) over the server's batches (``batches.py``);
its path and list pages are ``protocols/anthropic/message_batches.py``'s.

A create's ``requests`` (``{custom_id, params}``, each a /v1/messages body) become a batch input
file of /v1/messages rows, run as any batch runs (the planner's order, 429s retried, resumed after a
restart). The batch answers as Anthropic's ``message_batch`` (``processing_status`` in_progress,
canceling, ended; counts processing / succeeded / errored / canceled / expired) under the id
``msg<batch id>``; its results, once ended, are one JSONL line a request in the order sent
(``succeeded`` with the message, ``errored`` with Anthropic's error body, ``canceled``,
``expired``). Errors answer in Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.batch_file import MESSAGES_URL, BatchRow, read_batch, whole_lines
from prefixserve.entrypoints.openai.anthropic_routes import anthropic_error
from prefixserve.entrypoints.openai.batch_routes import BatchService
from prefixserve.entrypoints.openai.batches import FINAL, MAX_ROWS, BatchJob, BatchRequest
from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_json
from prefixserve.protocols.anthropic.message_batches import (
    MESSAGE_BATCHES_ROUTE,
    anthropic_page,
    anthropic_time,
)
from prefixserve.protocols.errors import APIError

log = logging.getLogger(__name__)

_CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
Route = Callable[..., Awaitable[Response]]
_PREFIX = "msg"  # msgbatch_...: a batch's id with Anthropic's prefix


def message_batch(job: BatchJob) -> dict[str, Any]:
    """A batch as Anthropic's ``message_batch`` object."""
    r = job.record
    counts = r["request_counts"]
    total, succeeded, failed = counts["total"], counts["completed"], counts["failed"]
    expired = r.get("_expired_rows", 0)
    ended = job.status in FINAL
    left = max(0, total - succeeded - failed)
    if job.status == "failed":  # never checked through (an internal error): nothing more will run
        failed, left = failed + left, 0
    processing_status = "ended" if ended else "canceling" if job.status == "cancelling" else "in_progress"
    return {
        "id": _PREFIX + job.id,
        "type": "message_batch",
        "processing_status": processing_status,
        "request_counts": {
            "processing": 0 if ended else left,
            "succeeded": succeeded,
            "errored": failed - expired,
            "canceled": left if ended else 0,
            "expired": expired,
        },
        "created_at": anthropic_time(r["created_at"]),
        "ended_at": anthropic_time(
            next((r[k] for k in ("completed_at", "cancelled_at", "expired_at", "failed_at") if r[k]), None)
        ),
        "expires_at": anthropic_time(r["expires_at"]),
        "cancel_initiated_at": anthropic_time(r["cancelling_at"]),
        "archived_at": None,
        "results_url": f"{MESSAGE_BATCHES_ROUTE}/{_PREFIX + job.id}/results" if ended else None,
    }


def _lines(requests: Any) -> bytes:
    """A create's ``requests`` checked (Anthropic refuses the whole create for one bad entry) and
    written as batch rows."""
    if not isinstance(requests, list) or not requests:
        raise APIError(400, "'requests' must be a non-empty list of {custom_id, params}", param="requests")
    if len(requests) > MAX_ROWS:
        message = f"a message batch takes at most {MAX_ROWS} requests here, got {len(requests)}"
        raise APIError(400, message, param="requests")
    seen: set[str] = set()
    rows = []
    for k, entry in enumerate(requests):
        where = f"requests.{k}"
        if not isinstance(entry, dict) or not isinstance(entry.get("params"), dict):
            raise APIError(400, "each request must be an object with 'custom_id' and 'params'", param=where)
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
            message = "custom_id must be 1-64 letters, digits, '_' or '-'"
            raise APIError(400, message, param=f"{where}.custom_id")
        if custom_id in seen:
            raise APIError(400, f"custom_id {custom_id!r} appears twice", param=f"{where}.custom_id")
        seen.add(custom_id)
        row = {"custom_id": custom_id, "method": "POST", "url": MESSAGES_URL, "body": entry["params"]}
        rows.append(json.dumps(row, ensure_ascii=False))
    return ("\n".join(rows) + "\n").encode()


def _results(service: BatchService, job: BatchJob) -> bytes:
    """An ended batch's results, one line a request in the order sent."""
    found: dict[str, dict[str, Any]] = {}
    for key in ("output_file_id", "error_file_id"):
        if job.record[key] is not None:
            for line in whole_lines(service.files.get(job.record[key]).path):
                row = json.loads(line)
                found[row["custom_id"]] = row
    rows = [
        r for r in read_batch(service.files.get(job.record["input_file_id"]).path) if isinstance(r, BatchRow)
    ]
    out = []
    for row in rows:
        answer = found.get(row.custom_id)
        if answer is None:
            result: dict[str, Any] = {"type": "canceled" if job.status != "failed" else "errored"}
            if job.status == "failed":
                result["error"] = {
                    "type": "error",
                    "error": {"type": "api_error", "message": "the batch failed"},
                }
        elif answer["response"] is None:  # expired
            result = {"type": "expired"}
        elif answer["response"]["status_code"] == 200:
            result = {"type": "succeeded", "message": answer["response"]["body"]}
        else:
            result = {"type": "errored", "error": answer["response"]["body"]}
        out.append(json.dumps({"custom_id": row.custom_id, "result": result}, ensure_ascii=False))
    return ("\n".join(out) + "\n").encode() if out else b""


def _job(service: BatchService, message_batch_id: str) -> BatchJob:
    if not message_batch_id.startswith(_PREFIX + "batch_"):
        raise APIError(404, f"no message batch with id {message_batch_id!r}")
    job = service.runs.jobs.get(message_batch_id[len(_PREFIX) :])
    if job is None or not job.record.get("_messages_api"):  # one made through /v1/batches is not one
        raise APIError(404, f"no message batch with id {message_batch_id!r}")
    return job


async def _one(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk


def add_message_batch_routes(app: FastAPI, state: ServerState, service: BatchService) -> None:
    files, runs = service.files, service.runs

    def anthropic_shaped(route: Route) -> Route:
        """The route behind the API key, its refusals answered in Anthropic's error shape."""

        @functools.wraps(route)
        async def shaped(request: Request, *args: Any, **kwargs: Any) -> Response:
            try:
                authorize(state, request)
                return await route(request, *args, **kwargs)
            except APIError as exc:
                return anthropic_error(exc)
            except Exception:  # still in Anthropic's shape, which its clients parse
                log.exception("message batch route %s failed", request.url.path)
                return anthropic_error(APIError(500, "the server failed to answer this request"))

        return shaped

    @app.post(MESSAGE_BATCHES_ROUTE)
    @anthropic_shaped
    async def create(request: Request) -> Response:
        data = await read_json(state, request, files.max_bytes)
        lines = await asyncio.to_thread(_lines, data.get("requests") if isinstance(data, dict) else None)
        stored = await files.save(_one(lines), "message_batch_requests.jsonl", "batch")
        made = runs.create(BatchRequest(input_file_id=stored.id, endpoint=MESSAGES_URL), messages_api=True)
        job = runs.get(made["id"])
        job.record["request_counts"]["total"] = lines.count(b"\n")
        return JSONResponse(message_batch(job))

    @app.get(MESSAGE_BATCHES_ROUTE)
    @anthropic_shaped
    async def listed(request: Request) -> Response:
        jobs = [job for b in runs.listed() if (job := runs.get(b["id"])).record.get("_messages_api")]
        return JSONResponse(anthropic_page(request.query_params, [message_batch(j) for j in jobs]))

    @app.get(MESSAGE_BATCHES_ROUTE + "/{message_batch_id}")
    @anthropic_shaped
    async def retrieve(request: Request, message_batch_id: str) -> Response:
        return JSONResponse(message_batch(_job(service, message_batch_id)))

    @app.post(MESSAGE_BATCHES_ROUTE + "/{message_batch_id}/cancel")
    @anthropic_shaped
    async def cancel(request: Request, message_batch_id: str) -> Response:
        job = _job(service, message_batch_id)
        if job.status not in FINAL and job.status != "finalizing":  # an ended one answers as it is
            runs.cancel(job.id)
        return JSONResponse(message_batch(job))

    @app.delete(MESSAGE_BATCHES_ROUTE + "/{message_batch_id}")
    @anthropic_shaped
    async def delete(request: Request, message_batch_id: str) -> Response:
        runs.delete(_job(service, message_batch_id).id)
        return JSONResponse({"id": message_batch_id, "type": "message_batch_deleted"})

    @app.get(MESSAGE_BATCHES_ROUTE + "/{message_batch_id}/results")
    @anthropic_shaped
    async def results(request: Request, message_batch_id: str) -> Response:
        job = _job(service, message_batch_id)
        if job.status not in FINAL:
            raise APIError(400, f"message batch {message_batch_id} has not ended: its results come then")
        body = await asyncio.to_thread(_results, service, job)
        return Response(body, media_type="application/binary")
