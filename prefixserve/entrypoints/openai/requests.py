"""Reading one OpenAI request off the wire: auth, body limits, strict UTF-8 JSON (or PML for schemas).

Each check raises APIError with the status and a message that names the problem; the body's own
checks (model, parameters, prompts) are ``protocols/openai/prepare.py``'s, shared with the batch
runner.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from prefixserve.protocols.errors import APIError
from prefixserve.protocols.ids import REQUEST_ID
from prefixserve.protocols.openai.prepare import OpenAIContext
from prefixserve.protocols.openai.request_models import SchemaRequest, find_lone_surrogate, parse_request
from prefixserve.serving.engine_thread import EngineLoop

MAX_BODY_BYTES = 4 * 1024 * 1024
REQUEST_ID_HEADER = "x-request-id"  # a client's name for its request: echoed, and in the answer's id


@dataclass(kw_only=True)
class ServerState(OpenAIContext):
    """What the routes need, fixed at start-up. The tokenizer is only read here (chat templates,
    one-token decodes for logprobs, text prompts encoded in worker threads before they are queued,
    so that the engine thread never stops stepping to tokenize)."""

    loop: EngineLoop
    max_model_len: int
    eos_ids: frozenset[int]  # the tokens that end an output (the model's EOS and the tokenizer's)
    api_key: str | tuple[str, ...] | None  # several: each names a tenant (``key_tenant``)
    max_body_bytes: int
    max_queue_delay: float | None = None  # seconds a request may wait to start (serving/overload.py)
    stall_watch: Any = None  # overload.StallWatch: aborts streams whose client stopped reading
    gate: Any = None  # overload.ArrivalGate: refusals at arrival, decided in this process
    responses: Any = None  # responses.ResponseStore: what /v1/responses stored
    background: Any = None  # responses_background.BackgroundRuns: background responses running
    log_requests: bool = False  # a log line per engine request (serving/request_log, --enable-log-requests)
    max_log_len: int | None = None  # its prompt cut at this many characters / token ids (None: whole)


# ---- request reading ---------------------------------------------------------------------------
def authorize(state: ServerState, request: Request) -> None:
    """The API key from ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY``
    (Anthropic's). Where the server has several keys, each one is a tenant (fair shares, per-tenant
    metrics): the matched key's ``key_tenant`` is noted on the request (``request_tenant``)."""
    if state.api_key is None:
        return
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    given = [
        bearer.strip() if scheme.lower() == "bearer" else "",
        request.headers.get("x-api-key", "").strip(),
    ]
    if not any(given):
        message = "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
        raise APIError(401, message, code="invalid_api_key")
    keys = (state.api_key,) if isinstance(state.api_key, str) else state.api_key
    for key in keys:  # every key compared, in constant time each
        if any(secrets.compare_digest(token.encode(), key.encode()) for token in given if token):
            if len(keys) > 1:
                setattr(request.state, TENANT, key_tenant(key))
            return
    raise APIError(401, "incorrect API key provided", code="invalid_api_key")


TENANT = "prefixserve_tenant"  # request.state's name for the tenant its API key names


def key_tenant(key: str) -> str:
    """A key's tenant name: a digest's first hex digits, so neither metrics nor logs show the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def request_tenant(request: Request, body: Any) -> str | None:
    """The request's tenant: its API key's where the server has several (a client cannot speak for
    another key's tenant), else the body's ``user`` (OpenAI's; Anthropic's ``metadata.user_id``)."""
    return getattr(request.state, TENANT, None) or getattr(body, "user", None)


async def read_text(state: ServerState, request: Request, limit: int | None = None) -> str:
    """The body as text: refused over the size limit (the server's, or ``limit``; before reading it
    all) or if not UTF-8."""
    limit = limit or state.max_body_bytes
    too_big = APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (bad byte at offset {exc.start})") from None


def parse_json(text: str) -> Any:
    try:
        data = json.loads(text)
        surrogate = find_lone_surrogate(data)
    except json.JSONDecodeError as exc:
        message = f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        raise APIError(400, message) from None
    except RecursionError:  # arrays or objects nested some thousand deep: no request needs that
        raise APIError(400, "the request body is nested too deeply") from None
    if surrogate:
        raise APIError(400, "the request contains a lone UTF-16 surrogate escape, which is not valid text")
    return data


async def read_json(state: ServerState, request: Request, limit: int | None = None) -> Any:
    return parse_json(await read_text(state, request, limit))


async def read_named_json(state: ServerState, request: Request) -> Any:
    """A completion's or chat's body, with the ``X-Request-Id`` header, where sent, as its
    ``request_id`` (the header wins, as in vLLM)."""
    data = await read_json(state, request)
    named = request.headers.get(REQUEST_ID_HEADER)
    if not named or not REQUEST_ID.fullmatch(named) or not isinstance(data, dict):
        return data  # a header's name the answer's id cannot hold is echoed only (never a 400)
    return {**data, "request_id": named}


_RAW_PML_TYPES = ("application/xml", "text/xml", "text/plain")
_FLAGS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


async def read_schema_request(state: ServerState, request: Request) -> SchemaRequest:
    """A ``POST /v1/schemas`` body: JSON ``{"schema": PML, "encode", "pin", "replace",
    "module_recompute"}``, or the PML itself (content type application/xml, text/xml or text/plain;
    the flags then come from the query string, ``?replace=true&pin=true&module_recompute=link:16``).
    A body of another or no content type is taken as PML when it starts with ``<``, else as JSON
    (so ``curl --data-binary @schema.pml`` works)."""
    text = await read_text(state, request)
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    raw = ctype in _RAW_PML_TYPES or (ctype != "application/json" and text.lstrip().startswith("<"))
    if not raw:
        data = parse_json(text)
        if isinstance(data, dict) and data.get("schema") is not None and not isinstance(data["schema"], str):
            raise APIError(
                400,
                "'schema' must be the PML text of a schema (a string)",
                param="schema",
                code="invalid_type",
            )
        return parse_request(SchemaRequest, data, "schema")  # type: ignore[no-any-return]
    if not text.strip():
        raise APIError(400, "the request body is empty: send the PML of a <schema>", param="schema")
    flags: dict[str, bool] = {}
    for key in ("encode", "pin", "replace"):
        value = request.query_params.get(key)
        if value is None:
            continue
        if value.lower() not in _FLAGS:
            message = f"query parameter '{key}' must be true or false, got {value[:40]!r}"
            raise APIError(400, message, param=key)
        flags[key] = _FLAGS[value.lower()]
    return SchemaRequest(schema=text, module_recompute=request.query_params.get("module_recompute"), **flags)
