"""One log line per engine request as it is queued, as vLLM's ``--enable-log-requests`` writes: its
id, prompt (text and token ids, cut at ``max_len`` characters / ids) and parameters. Off by default:
prompts are the clients' data."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("prefixserve.requests")


def _cut(value: str | list[int] | None, max_len: int | None) -> str | list[int] | None:
    if value is None or max_len is None or len(value) <= max_len:
        return value
    return value[:max_len]


def log_request(
    request_id: str, text: str | None, tokens: list[int] | None, params: Any, max_len: int | None
) -> None:
    """``params``: the SamplingParams or PoolingParams the request runs with."""
    count = None if tokens is None else len(tokens)
    log.info(
        "received request %s: prompt: %r, prompt_token_ids: %s (%s tokens), params: %s",
        request_id,
        _cut(text, max_len),
        _cut(tokens, max_len),
        "?" if count is None else count,
        params,
    )


__all__ = ["log_request"]
