"""Refusals every API answers with: ``APIError`` (a status and OpenAI's ``{"error": {...}}`` body,
which the Anthropic routes reshape), the error for outputs the engine failed, and which request field
a parameter's ValueError is about.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixserve.outputs import RequestOutput


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers  # sent with the error (e.g. Retry-After on a 429)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def as_sent(error: APIError, req: Any) -> APIError:
    """``error`` about ``max_tokens`` named as ``req`` sent its limit: a chat request that gave
    ``max_completion_tokens`` is told about that field, not one it never sent."""
    if getattr(req, "max_completion_tokens", None) is None or "max_tokens" not in error.message:
        return error
    message = error.message.replace("max_tokens", "max_completion_tokens")
    param = "max_completion_tokens" if error.param == "max_tokens" else error.param
    return APIError(error.status, message, param=param, code=error.code, headers=error.headers)


def engine_failure(outputs: Iterable[RequestOutput]) -> APIError | None:
    """The error for outputs that finished with "error", or None. Where the engine said why, the
    request can never run here (it needs more of the KV pool than can ever be free): a 400 naming
    the numbers, not to be retried. Otherwise the engine failed while running it: a 500."""
    failed = [o for o in outputs if any(c.finish_reason == "error" for c in o.outputs)]
    if not failed:
        return None
    reasons = [o.error for o in failed if o.error]
    if reasons:
        return APIError(400, reasons[0], code="kv_capacity_exceeded")
    return APIError(500, "the engine failed while running this request", code="engine_error")


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def param_of(message: str, prompt_field: str) -> tuple[str | None, str]:
    """Which request field a ValueError from SamplingParams or Engine.add_request is about."""
    fields = (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "logprobs",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "best_of",
        "prompt_logprobs",
        "application",
        "cache_salt",
        "module_recompute",
        "allowed_token_ids",
        "truncate_prompt_tokens",
        "bad_words",
        "priority",
        "thinking_token_budget",
        "length_penalty",
    )
    head = message.split(" ", 1)[0].split("=", 1)[0]
    if head.startswith("structured_outputs"):
        return head.rstrip(":"), "invalid_value"
    if head in fields:
        return head, "invalid_value"
    if "stop" in message:
        return "stop", "invalid_value"
    if "context length" in message and "max_tokens" not in message:
        return prompt_field, "context_length_exceeded"
    if "max_tokens" in message:
        return "max_tokens", "invalid_value"
    if "prompt" in message:
        return prompt_field, "invalid_value"
    if "application" in message:
        return "application", "invalid_value"
    return None, "invalid_value"
