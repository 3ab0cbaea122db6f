"""OpenAI Batch API files: read request lines, write result lines, resume after a kill.

Input lines are ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions"
| "/v1/responses" | "/v1/messages" | "/v1/embeddings" | "/v1/score" | "/v1/rerank", "body": {...}}``;
output lines are ``{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null,
"error": {"code", "message"} | null}``. A line that cannot be read becomes an error row naming its
line number; the job goes on. Rows are appended one whole line per ``write`` and flushed, and a torn
last line (a kill mid-write) is cut off on resume,
so a run killed at any point and started again ends with every input row in the output exactly once.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESPONSES_URL = "/v1/responses"
MESSAGES_URL = "/v1/messages"  # Anthropic's, for its Message Batches API
EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL, RERANK_URL = "/v1/score", "/v1/rerank"  # vLLM's, over the embeddings
COMPLETION_URLS = ("/v1/completions", "/v1/chat/completions")
BATCH_URLS = (*COMPLETION_URLS, RESPONSES_URL, MESSAGES_URL, EMBEDDINGS_URL, SCORE_URL, RERANK_URL)
_LINE = re.compile(r"line (\d+): ")


@dataclass(slots=True)
class BatchRow:
    """One readable input line: what to run and where it came from."""

    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(slots=True)
class BadRow:
    """An input line that cannot run; it becomes an error row in the output."""

    line: int
    custom_id: str | None
    code: str
    message: str


def _check_line(number: int, text: str, seen: set[str]) -> BatchRow | BadRow:
    def bad(code: str, message: str, custom_id: str | None = None) -> BadRow:
        return BadRow(number, custom_id, code, f"line {number}: {message}")

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return bad("invalid_json", f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(data, dict):
        return bad("invalid_request", f"expected a JSON object, got {type(data).__name__}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("invalid_request", "'custom_id' must be a non-empty string")
    if custom_id in seen:
        return bad("duplicate_custom_id", f"custom_id {custom_id!r} appears on an earlier line", custom_id)
    seen.add(custom_id)
    if data.get("method", "POST") != "POST":
        return bad("invalid_request", f"method must be 'POST', got {data.get('method')!r}", custom_id)
    url = data.get("url")
    if url not in BATCH_URLS:
        return bad("invalid_url", f"url {url!r} is not one of {', '.join(BATCH_URLS)}", custom_id)
    body = data.get("body")
    if not isinstance(body, dict):
        return bad("invalid_request", "'body' must be a JSON object", custom_id)
    return BatchRow(number, custom_id, url, body)


def read_batch(path: str | Path) -> list[BatchRow | BadRow]:
    """Every non-blank line of ``path``, checked for the batch envelope (not yet the body)."""
    seen: set[str] = set()
    rows: list[BatchRow | BadRow] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                rows.append(_check_line(number, text, seen))
    return rows


def row_key(row: BatchRow | BadRow) -> tuple[str, str]:
    """How an answered row is known on resume: a row that ran (or whose body was refused) by its
    custom_id, a line that could not be read as a request by its number (its custom_id may be missing
    or a duplicate's); two kinds, so no custom_id can pass for a line number."""
    return ("line", str(row.line)) if isinstance(row, BadRow) else ("id", row.custom_id)


def whole_lines(path: str | Path, cut_torn: bool = False) -> list[bytes]:
    """A result file's complete lines (none where the file is missing), split at ``\n`` alone: the
    rows are written with ``ensure_ascii=False``, so U+2028 and its kin stay raw inside them, where
    ``str.splitlines`` would split. A torn last line (a kill mid-write) is left out, and with
    ``cut_torn`` cut off the file."""
    p = Path(path)
    if not p.exists():
        return []
    data = p.read_bytes()
    keep = data.rfind(b"\n") + 1  # bytes up to the last complete line
    if cut_torn and keep < len(data):
        with open(p, "r+b") as f:
            f.truncate(keep)
    return [line for line in data[:keep].split(b"\n") if line.strip()]


def finished_keys(path: str | Path) -> set[tuple[str, str]]:
    """The ``row_key`` of each input row already answered in an output file; a torn last line is cut
    off first."""
    done: set[tuple[str, str]] = set()
    for raw in whole_lines(path, cut_torn=True):
        try:
            row = json.loads(raw)
        except json.JSONDecodeError:
            continue  # not ours to judge: kept, but answers nothing
        if not isinstance(row, dict):
            continue
        error = row.get("error")
        where = _LINE.match(str(error.get("message", ""))) if isinstance(error, dict) else None
        if where is not None:
            done.add(("line", where.group(1)))
        elif isinstance(row.get("custom_id"), str):
            done.add(("id", row["custom_id"]))
    return done


def result_row(custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """An output line for a request that got an HTTP answer (200, or the server's 4xx error body)."""
    request_id = f"req_{secrets.token_hex(12)}"
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


def error_row(bad: BadRow) -> dict[str, Any]:
    """An output line for an input line that could not be read as a request."""
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": bad.custom_id,
        "response": None,
        "error": {"code": bad.code, "message": bad.message},
    }


class ResultWriter:
    """Appends output rows, one whole line per ``write`` call (no user-space buffer to lose)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, row: dict[str, Any]) -> None:
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        written = os.write(self._fd, line)
        while written < len(line):  # a short write (rare: a full disk, a signal) is finished, not torn
            written += os.write(self._fd, line[written:])
        # In the kernel's page cache now: a killed process loses nothing it wrote.

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
