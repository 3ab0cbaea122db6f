"""OpenAI's Files and Batch routes: ``/v1/files`` (upload, list, read, delete) and ``/v1/batches``
(create, list, get, cancel), over ``files.FileStore`` and ``batches.BatchRuns``."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.types import Message

from prefixserve.entrypoints.openai.batch_settings import BatchSettings
from prefixserve.entrypoints.openai.batches import BatchRuns, check_batch_request
from prefixserve.entrypoints.openai.files import MAX_LIST, FileStore
from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_json
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.lists import BATCHES_ROUTE, FILES_ROUTE, page

_FORM_OVERHEAD = 64 * 1024  # a multipart upload's bytes beyond its file's: boundaries, headers, purpose
_UPLOAD_CHUNK = 1 << 20


class BatchService:
    """The store and the runs, and the temporary folder to remove when the server stops."""

    def __init__(self, settings: BatchSettings, state: ServerState, max_num_seqs: int) -> None:
        self.temporary = settings.files_dir is None
        root = tempfile.mkdtemp(prefix="prefixserve-files-") if self.temporary else settings.files_dir
        self.files = FileStore(root, settings.max_file_bytes, tag=settings.tag)
        concurrency = settings.concurrency or 2 * max_num_seqs
        self.runs = BatchRuns(state, self.files, concurrency, settings.grouping, tag=settings.tag)

    def start(self) -> None:
        self.runs.resume()

    async def stop(self) -> None:
        await self.runs.stop_all()
        if self.temporary:
            shutil.rmtree(self.files.root, ignore_errors=True)


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise APIError(400, f"limit must be a whole number from 1 to {most}, got {raw[:40]!r}", param="limit")
    return int(raw)


def _bounded(request: Request, limit: int) -> Request:
    """The request, its body cut off with a 413 once past ``limit`` bytes as it is read (the form
    parser spools all of a body to disk before a route sees it; a body without a Content-Length
    would otherwise fill the disk)."""
    seen = 0

    async def receive() -> Message:
        nonlocal seen
        message = await request.receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                text = f"the upload is over the limit of {limit} bytes"
                raise APIError(413, text, param="file", code="file_too_large")
        return message

    return Request(request.scope, receive)


async def _upload_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(_UPLOAD_CHUNK):
        yield chunk


def add_batch_routes(app: FastAPI, state: ServerState, service: BatchService) -> None:
    files, runs = service.files, service.runs

    @app.post(FILES_ROUTE)
    async def upload(request: Request) -> Response:
        authorize(state, request)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > files.max_bytes + _FORM_OVERHEAD:
            message = f"the file is over the limit of {files.max_bytes} bytes"
            raise APIError(413, message, param="file", code="file_too_large")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "upload a file as multipart/form-data with fields 'file' and 'purpose'")
        try:
            form = await _bounded(request, files.max_bytes + _FORM_OVERHEAD).form(max_files=1, max_fields=8)
        except APIError:
            raise
        except Exception as exc:  # the multipart parser's refusals (malformed, too many parts)
            raise APIError(400, f"the upload is not valid multipart/form-data: {exc}") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise APIError(400, "'file' is a required field (a file part)", param="file")
            if not isinstance(purpose, str) or not purpose:
                raise APIError(400, "'purpose' is a required field", param="purpose")
            stored = await files.save(_upload_chunks(upload), upload.filename or "upload", purpose)
        finally:
            await form.close()  # the parts' spooled temporary files
        return JSONResponse(stored.to_dict())

    @app.get(FILES_ROUTE)
    async def list_files(request: Request) -> Response:
        authorize(state, request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order[:40]!r}", param="order")
        listed = [f.to_dict() for f in files.list(request.query_params.get("purpose"))]
        if order == "desc":
            listed.reverse()
        limit = _limit(request, MAX_LIST, MAX_LIST)
        return JSONResponse(page(listed, request.query_params.get("after"), limit))

    @app.get(FILES_ROUTE + "/{file_id}")
    async def get_file(request: Request, file_id: str) -> Response:
        authorize(state, request)
        return JSONResponse(files.get(file_id).to_dict())

    @app.get(FILES_ROUTE + "/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        authorize(state, request)
        stored = files.get(file_id)
        return FileResponse(stored.path, media_type="application/octet-stream", filename=stored.filename)

    @app.delete(FILES_ROUTE + "/{file_id}")
    async def delete_file(request: Request, file_id: str) -> Response:
        authorize(state, request)
        user = runs.in_use(file_id)
        if user is not None and user.record.get("_messages_api"):
            message = f"file {file_id} holds the requests of message batch msg{user.id}: delete that instead"
            raise APIError(409, message, param="file_id")
        if user is not None:
            message = f"file {file_id} is the input of batch {user.id}, which has not ended: cancel it first"
            raise APIError(409, message, param="file_id")
        files.delete(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.post(BATCHES_ROUTE)
    async def create_batch(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse(runs.create(check_batch_request(await read_json(state, request))))

    @app.get(BATCHES_ROUTE)
    async def list_batches(request: Request) -> Response:
        authorize(state, request)
        limit = _limit(request, 20, 100)
        return JSONResponse(page(runs.listed(), request.query_params.get("after"), limit))

    @app.get(BATCHES_ROUTE + "/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> Response:
        authorize(state, request)
        return JSONResponse(runs.get(batch_id).public())

    @app.post(BATCHES_ROUTE + "/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        authorize(state, request)
        return JSONResponse(runs.cancel(batch_id))
