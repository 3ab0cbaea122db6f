"""OpenAI's Files API store: uploaded files and batch results, kept on disk with their metadata.

A file is two entries in the store's folder: ``<id>`` (its bytes) and ``<id>.json`` (its File
object). Both are written under a temporary name and renamed, metadata last, so a file either
exists whole or not at all after a crash; ``list`` and ``get`` read only files whose metadata is
there. With ``--files-dir`` the store outlives the server; without it, the server keeps its files
in a temporary folder removed when it stops.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixserve.protocols.errors import APIError
from prefixserve.protocols.ids import object_id

# OpenAI's purposes: uploads may carry any of them; a batch reads "batch", and its results are written
# as "batch_output"
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"
MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit on a batch input file
MAX_LIST = 10_000  # OpenAI's largest page of files
_ID = re.compile(r"file-[A-Za-z0-9_-]{1,80}")
_COPY_CHUNK = 1 << 20


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """``data`` at ``path`` whole or not at all (written beside it, then renamed); ``durable``: on
    the disk before the rename (else a machine's crash may lose it; a process's kill does not)."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(part, path)


@dataclass(slots=True)
class StoredFile:
    """A stored file's metadata (OpenAI's File object) and where its bytes are."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    path: Path
    created_ns: int = 0  # orders files made in the same second

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


class FileStore:
    """Files in one folder. ``tag``: written into every id (``file-<tag>_<hex>``)."""

    def __init__(self, root: str | Path, max_bytes: int = MAX_FILE_BYTES, tag: str | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"the file size limit must be >= 1 byte, got {max_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.tag = max_bytes, tag

    def _meta_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    async def save(self, chunks: AsyncIterator[bytes], filename: str, purpose: str) -> StoredFile:
        """An upload's bytes into a new file; 413 past the size limit (nothing is kept)."""
        if purpose not in PURPOSES:
            message = f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}"
            raise APIError(400, message, param="purpose")
        file_id = object_id("file", self.tag, "-")
        path = self.root / file_id
        part = path.with_name(path.name + ".part")
        size = 0
        try:
            with open(part, "wb") as f:  # written and synced on worker threads: the loop serves meanwhile
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        message = f"the file is over the limit of {self.max_bytes} bytes"
                        raise APIError(413, message, param="file", code="file_too_large")
                    await asyncio.to_thread(f.write, chunk)
                f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        return self._register(file_id, path, size, filename, purpose)

    def adopt(self, source: Path, filename: str, purpose: str, file_id: str) -> StoredFile | None:
        """A file written elsewhere (a batch's results), moved into the store under the id chosen for
        it beforehand, or None where it is empty or missing. Idempotent: a restart after the move
        (with or without its metadata) finds the file in the store."""
        path = self.root / file_id
        if source.exists():
            if source.stat().st_size == 0:  # nothing written (or, resumed after the move, nothing more)
                source.unlink()
            else:
                os.replace(source, path)
        if not path.exists():
            return None
        if self._meta_path(file_id).exists():
            return self.get(file_id)
        return self._register(file_id, path, path.stat().st_size, filename, purpose)

    def _register(self, file_id: str, path: Path, size: int, filename: str, purpose: str) -> StoredFile:
        now = time.time_ns()
        stored = StoredFile(file_id, size, now // 10**9, filename, purpose, path, now)
        meta = {k: v for k, v in stored.to_dict().items() if k in ("id", "bytes", "created_at", "filename")}
        meta.update(purpose=purpose, created_ns=now)
        write_atomic(self._meta_path(file_id), json.dumps(meta).encode())
        return stored

    def get(self, file_id: str) -> StoredFile:
        """The file, or 404 naming it."""
        meta = self._meta_path(file_id) if _ID.fullmatch(file_id) else None
        try:
            data = json.loads(meta.read_bytes()) if meta is not None else None
        except (OSError, ValueError):
            data = None
        if data is None or not (self.root / file_id).exists():
            raise APIError(404, f"no file with id {file_id!r}", param="file_id", code="not_found")
        path = self.root / file_id
        fields = (data["id"], data["bytes"], data["created_at"], data["filename"], data["purpose"])
        return StoredFile(*fields, path, data.get("created_ns", 0))

    def list(self, purpose: str | None = None) -> list[StoredFile]:
        """Every file (of ``purpose``), oldest first."""
        found = []
        for meta in self.root.glob("file-*.json"):
            try:
                stored = self.get(meta.name[: -len(".json")])
            except APIError:
                continue  # deleted meanwhile
            if purpose is None or stored.purpose == purpose:
                found.append(stored)
        found.sort(key=lambda f: (f.created_ns, f.id))
        return found

    def delete(self, file_id: str) -> None:
        stored = self.get(file_id)
        self._meta_path(file_id).unlink(missing_ok=True)  # metadata first: never a listed file without bytes
        stored.path.unlink(missing_ok=True)
