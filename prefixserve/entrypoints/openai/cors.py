"""Cross-origin requests (vLLM's ``--allowed-origins``): browser pages on those origins may call the
server. Off unless origins are given: the server binds 127.0.0.1 by default, and a page anywhere on
the web could otherwise reach it through its visitor's browser."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

# what a page may read of an answer besides the usual: its request's name, when to retry a 429,
# and which replica answered
EXPOSED = ["X-Request-Id", "Retry-After", "X-Prefixserve-Replica"]
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")  # scheme://host[:port], no path


def read_origins(given: Sequence[str] | None) -> list[str] | None:
    """``--allowed-origins`` as given: origins, or vLLM's one JSON list (``'["https://ui"]'``); each
    ``*`` or ``scheme://host[:port]``, else ValueError (a typo must not leave CORS silently off)."""
    if not given:
        return None
    origins = list(given)
    if len(origins) == 1 and origins[0].lstrip().startswith("["):
        try:
            origins = json.loads(origins[0])
        except ValueError:
            raise ValueError(f"--allowed-origins: not a JSON list: {origins[0]!r}") from None
    for origin in origins:
        if not isinstance(origin, str) or not (origin == "*" or ORIGIN.fullmatch(origin)):
            raise ValueError(f"--allowed-origins takes '*' or scheme://host[:port], got {origin!r}")
    return origins


def allow_origins(app: FastAPI, origins: Sequence[str] | None) -> None:
    """Answer CORS preflights and tag answers for ``origins`` (``*``: any); nothing for None."""
    origins = read_origins(origins)
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=EXPOSED,
    )


__all__ = ["allow_origins", "read_origins"]
