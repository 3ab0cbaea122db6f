"""Reading and checking one OpenAI request: auth, body limits, JSON, model, sampling parameters.

Each check raises APIError with the status and a message that names the problem; nothing here
touches the engine (the engine itself puts an application's pinned prompt first).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from prefixserve.entrypoints.server_engine import EngineLoop
from prefixserve.entrypoints.server_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    find_lone_surrogate,
    normalize_stop,
    param_of,
)
from prefixserve.sampling.params import SamplingParams

MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class ServerState:
    """What the routes need, fixed at start-up. The tokenizer is only read here (chat templates,
    one-token decodes for logprobs); encoding happens on the engine thread."""

    loop: EngineLoop
    model: str
    max_model_len: int
    tokenizer: Any
    api_key: str | None
    system_prompts: dict[str, str]
    max_body_bytes: int
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


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


def check_model(state: ServerState, name: str | None) -> None:
    if name is None or name in (state.model, "default"):
        return
    message = f"the model '{name}' does not exist; this server serves '{state.model}' (or use 'default')"
    raise APIError(404, message, param="model", code="model_not_found")


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.presence_penalty not in (None, 0, 0.0):
        raise APIError(400, "presence_penalty is not supported (only 0)", param="presence_penalty")
    if req.frequency_penalty not in (None, 0, 0.0):
        raise APIError(400, "frequency_penalty is not supported (only 0)", param="frequency_penalty")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
    else:
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", param="response_format")


def sampling(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=normalize_stop(req.stop),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as exc:
        param, code = param_of(str(exc), "prompt")
        raise APIError(400, str(exc), param=param, code=code) from None


def application_prompt(state: ServerState, application: str) -> str:
    system = state.system_prompts.get(application)
    if system is None:
        known = ", ".join(sorted(state.system_prompts)) or "none are configured"
        raise APIError(400, f"unknown application {application!r} (known: {known})", param="application")
    return system
