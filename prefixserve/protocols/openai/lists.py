"""OpenAI's lists: the paths of the Files and Batch APIs, whose GETs list what a server keeps, and
the cursor page every OpenAI list answers with (files, batches, a stored response's input items).
"""

from __future__ import annotations

from typing import Any

from prefixserve.protocols.errors import APIError

FILES_ROUTE = "/v1/files"
BATCHES_ROUTE = "/v1/batches"


def page(
    items: list[dict[str, Any]], after: str | None, limit: int, what: str = "listed object"
) -> dict[str, Any]:
    """OpenAI's cursor page: the ``limit`` items after the one whose id is ``after`` (400 naming
    ``what`` where none has that id)."""
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(400, f"no {what} with id {after!r}", param="after")
        items = items[at + 1 :]
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }
