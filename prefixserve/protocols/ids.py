"""Ids of answers (``cmpl-...``, ``chatcmpl-...``) and of kept objects (responses, files, batches).

A kept object's id may carry its store's tag (behind the Ray ingress, its replica's name), so that a
later request naming it goes to the replica that holds it (``id_tag``).
"""

from __future__ import annotations

import re
import uuid

from prefixserve.protocols.errors import APIError

REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces: it goes into ids and logs


def answer_id(kind: str, given: str | None) -> str:
    """An answer's id: ``kind``-``given`` where the client named its request (vLLM's ``request_id``
    field, or the ``X-Request-Id`` header), else ``kind``-<random hex>."""
    if given is None:
        return f"{kind}-{uuid.uuid4().hex}"
    if not REQUEST_ID.fullmatch(given):
        message = "request_id must be 1-256 printable ASCII characters without spaces"
        raise APIError(400, message, param="request_id", code="invalid_value")
    return f"{kind}-{given}"


_TAGGED_ID = re.compile(r"(?:resp_|batch_|msgbatch_|file-)([A-Za-z0-9-]+)_[0-9a-f]{32}")


def object_id(prefix: str, tag: str | None = None, sep: str = "_") -> str:
    """An id of a kept object (response, file, batch): ``<prefix><sep><hex>``, or with the keeping
    store's ``tag`` (behind the Ray ingress, its replica's name) ``<prefix><sep><tag>_<hex>``, so that
    the ingress sends a later request naming it to that replica (``id_tag``)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}" if tag is None else f"{prefix}{sep}{tag}_{uuid.uuid4().hex}"


def id_tag(named: str) -> str | None:
    """The store tag in a response's, file's or batch's id (``object_id``), or None."""
    m = _TAGGED_ID.fullmatch(named)
    return m.group(1) if m else None
