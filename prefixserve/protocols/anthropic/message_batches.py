"""Anthropic's Message Batches API (``/v1/messages/batches``): its path, its times and its list pages.

The server runs message batches over its batches (``entrypoints/openai/message_batches.py``); the Ray
ingress merges every replica's list into one page of this shape (``ray_scaleout/serve_objects.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from prefixserve.protocols.anthropic.prepare import MESSAGES_ROUTE
from prefixserve.protocols.errors import APIError

MESSAGE_BATCHES_ROUTE = MESSAGES_ROUTE + "/batches"
MAX_PAGE = 1000  # the most message batches a page lists (Anthropic's limit)


def anthropic_time(ts: int | None) -> str | None:
    """Anthropic's RFC 3339 time from Unix seconds."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def anthropic_page(q: Mapping[str, str], items: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's page of ``items`` (newest first): ``limit`` of them after ``after_id`` or before
    ``before_id`` (the query ``q``'s)."""
    raw = q.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        message = f"limit must be a whole number from 1 to {MAX_PAGE}, got {raw[:40]!r}"
        raise APIError(400, message, param="limit")
    limit, ids = int(raw), [item["id"] for item in items]
    for name in ("after_id", "before_id"):
        if q.get(name) is not None and q[name] not in ids:
            raise APIError(400, f"{name} names no listed message batch: {q[name]!r}", param=name)
    if q.get("before_id") is not None:
        at = ids.index(q["before_id"])
        data, more = items[max(0, at - limit) : at], at > limit
    else:
        start = ids.index(q["after_id"]) + 1 if q.get("after_id") is not None else 0
        data, more = items[start : start + limit], len(items) > start + limit
    return {
        "data": data,
        "has_more": more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
