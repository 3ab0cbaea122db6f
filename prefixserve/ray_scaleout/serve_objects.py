"""What replicas keep, behind the ingress: stored responses, files and batches.

Each lives in the replica that made it, and its id carries that replica's name (``object_id``), so a
request naming one goes there: ``/v1/responses/{id}`` and ``previous_response_id``,
``/v1/files/{id}``, ``/v1/batches/{id}``, ``/v1/messages/batches/{id}``, and a new batch to the
replica holding its input file.
Listing files, batches or message batches asks every healthy replica for all of its own (page by
page) and pages through the merged list as one server would (Anthropic's cursors for message
batches).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

from prefixserve.protocols.anthropic.message_batches import MAX_PAGE, MESSAGE_BATCHES_ROUTE, anthropic_page
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.ids import id_tag
from prefixserve.protocols.openai.lists import BATCHES_ROUTE, FILES_ROUTE, page
from prefixserve.protocols.responses.prepare import RESPONSES_ROUTE

LISTED = (FILES_ROUTE, BATCHES_ROUTE, MESSAGE_BATCHES_ROUTE)
_PAGE = {
    FILES_ROUTE: 10_000,
    BATCHES_ROUTE: 100,
    MESSAGE_BATCHES_ROUTE: MAX_PAGE,
}  # each route's largest page

# (replica name, path, query) -> (status, JSON body)
Fetch = Callable[[str, str, str], Awaitable[tuple[int, Any]]]


def _json_field(body: bytes, name: str) -> Any:
    try:
        return json.loads(body).get(name)
    except (ValueError, AttributeError):
        return None


def named_owner(method: str, path: str, body: bytes) -> str | None:
    """The tag of the kept object a request names (the replica that holds it), or None."""
    named: Any = None
    if path == RESPONSES_ROUTE:
        named = _json_field(body, "previous_response_id")
    elif path == BATCHES_ROUTE:
        named = _json_field(body, "input_file_id") if method == "POST" else None
    else:
        for parent in (RESPONSES_ROUTE, FILES_ROUTE, BATCHES_ROUTE, MESSAGE_BATCHES_ROUTE):
            if path.startswith(parent + "/"):
                named = path[len(parent) + 1 :].split("/", 1)[0]
    return id_tag(named) if isinstance(named, str) else None


async def merged_list(fetch: Fetch, names: list[str], path: str, query: dict[str, str]) -> dict[str, Any]:
    """``GET /v1/files``, ``/v1/batches`` or ``/v1/messages/batches`` over every replica in ``names``:
    each one's whole list, merged newest first (files: as ``order`` asks), then the client's cursor
    and ``limit``."""
    anthropic = path == MESSAGE_BATCHES_ROUTE
    cursor = "after_id" if anthropic else "after"
    mine = {k: v for k, v in query.items() if k not in ("after", "after_id", "before_id", "limit")}
    mine["limit"] = str(_PAGE[path])
    items: list[dict[str, Any]] = []
    for name in names:
        after = None
        while True:
            asked = {**mine, **({cursor: after} if after else {})}
            status, body = await fetch(name, path, urlencode(asked))
            if status != 200:
                message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
                raise APIError(status, message or f"replica {name} could not list {path}")
            items += body["data"]
            if not body["has_more"] or not body["data"]:
                break
            after = body["data"][-1]["id"]
    newest_first = query.get("order", "desc") == "desc"
    items.sort(key=lambda item: (item["created_at"], item["id"]), reverse=newest_first)
    if anthropic:  # RFC 3339 times of one form: ordered as strings
        return anthropic_page(query, items)
    limit = query.get("limit")
    if limit is not None and (not limit.isdigit() or not 1 <= int(limit) <= _PAGE[path]):
        raise APIError(400, f"limit must be a whole number from 1 to {_PAGE[path]}, got {limit[:40]!r}")
    default = _PAGE[path] if path == FILES_ROUTE else 20
    return page(items, query.get("after"), int(limit) if limit else default)
