"""vLLM's ``POST /reset_prefix_cache``: its path and its answer (``reset: false`` where blocks of
running requests stayed). The server answers it for its engine; the Ray ingress sends it to every
replica and answers with each one's ``reset``."""

from __future__ import annotations

from typing import Any

RESET_ROUTE = "/reset_prefix_cache"


def reset_body(reset: bool, replicas: dict[str, bool] | None = None) -> dict[str, Any]:
    """The answer: ``reset`` true where every cached block is gone; behind the Ray ingress, each
    replica's own ``reset`` too."""
    body: dict[str, Any] = {"object": "prefix_cache_reset", "reset": reset}
    if replicas is not None:
        body["replicas"] = replicas
    return body


__all__ = ["RESET_ROUTE", "reset_body"]
