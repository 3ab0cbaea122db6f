"""Cross-origin requests (vLLM's ``--allowed-origins``): browser pages on those origins may call the
server. Off unless origins are given: the server binds 127.0.0.1 by default, and a page anywhere on
the web could otherwise reach it through its visitor's browser."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

# what a page may read of an answer besides the usual: its request's name, when to retry a 429,
# and which replica answered
EXPOSED = ["X-Request-Id", "Retry-After", "X-Prefixserve-Replica"]


def allow_origins(app: FastAPI, origins: Sequence[str] | None) -> None:
    """Answer CORS preflights and tag answers for ``origins`` (``*``: any); nothing for None."""
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=EXPOSED,
    )


__all__ = ["allow_origins"]
