"""Stored responses: what ``store`` (on by default, as in OpenAI's API) keeps of a response in this
process, a bounded number, so that ``previous_response_id`` goes on with its conversation and
``GET /v1/responses/{id}`` answers it.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prefixserve.protocols.ids import object_id

MAX_STORED = 1024  # responses kept for previous_response_id (oldest dropped first)
MAX_STORED_CHARS = 64 << 20  # and at most this many characters of their conversations
FINISHED = ("completed", "incomplete")  # statuses of a stored response that a conversation goes on from
ACTIVE = ("queued", "in_progress")  # a background response's statuses while it may still change


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as answered
    history: list[dict[str, Any]]  # its conversation as chat messages (earlier turns, input, output)
    input_items: list[dict[str, Any]]  # its own input, as items with ids (``input_items`` lists them)
    chars: int


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: the least
    recently used leave first once either bound is passed (``max_responses`` 0: nothing is kept)."""

    def __init__(
        self, max_responses: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS, tag: str | None = None
    ) -> None:
        """``tag``: written into every id this store gives (``resp_<tag>_<hex>``): behind the Ray
        Serve ingress, the replica's name, so that a later request naming the id goes to it."""
        if tag is not None and not re.fullmatch(r"[A-Za-z0-9-]+", tag):
            raise ValueError(f"a response store's tag takes letters, digits and '-', got {tag!r}")
        self.max_responses, self.max_chars, self.tag = max_responses, max_chars, tag
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # ``truncation: auto`` reads it from a worker thread

    def new_id(self) -> str:
        return object_id("resp", self.tag)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            found = self._items.get(rid)
            if found is not None:
                self._items.move_to_end(rid)
            return found

    def put(
        self, rid: str, body: dict[str, Any], history: list[dict[str, Any]], input_items: list[dict[str, Any]]
    ) -> None:
        chars = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in history)
        with self._lock:
            self._drop(rid)
            self._items[rid] = StoredResponse(body, history, input_items, chars)
            self._chars += chars
            while len(self._items) > self.max_responses or self._chars > self.max_chars:
                # the least recently used that has ended: a background one still running stays
                # pollable and cancellable, past the bounds if need be (the engine bounds those)
                ended = next(
                    (r for r, item in self._items.items() if item.body.get("status") not in ACTIVE), None
                )
                if ended is None:
                    break
                self._drop(ended)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        found = self._items.pop(rid, None)
        if found is not None:
            self._chars -= found.chars
        return found is not None
