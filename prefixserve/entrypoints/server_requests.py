"""Reading one OpenAI request off the wire: auth, body limits, strict UTF-8 JSON.

Each check raises APIError with the status and a message that names the problem; the body's own
checks (model, parameters, prompts) are ``openai_prepare``'s, shared with the batch runner.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from prefixserve.entrypoints.openai_prepare import OpenAIContext
from prefixserve.entrypoints.server_engine import EngineLoop
from prefixserve.entrypoints.server_protocol import APIError, find_lone_surrogate

MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(kw_only=True)
class ServerState(OpenAIContext):
    """What the routes need, fixed at start-up. The tokenizer is only read here (chat templates,
    one-token decodes for logprobs); encoding happens on the engine thread."""

    loop: EngineLoop
    max_model_len: int
    api_key: str | None
    max_body_bytes: int


# ---- request reading ---------------------------------------------------------------------------
def authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
    if not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


async def read_json(state: ServerState, request: Request) -> Any:
    limit = state.max_body_bytes
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
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (bad byte at offset {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        message = f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        raise APIError(400, message) from None
    if find_lone_surrogate(data):
        raise APIError(400, "the request contains a lone UTF-16 surrogate escape, which is not valid text")
    return data
