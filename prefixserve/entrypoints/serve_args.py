"""``serve``'s options for the HTTP listener (TLS, root path, uvicorn's logs), the engine's seed and
the model named first, under vLLM's names: a ``vllm serve`` command line runs here as it is.

Only the standard library is imported: ``cli`` builds its parser without the server's packages.
"""

from __future__ import annotations

import argparse
from typing import Any

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as vLLM's 'serve MODEL' names it (same as --model)",
    )
    s.add_argument(
        "--seed",
        dest="engine_seed",
        type=int,
        default=None,
        help="the engine's seed: requests without a seed sample from its stream (default 0)",
    )
    h = s.add_argument_group("HTTP listener (uvicorn)")
    h.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key")
    h.add_argument("--ssl-certfile", default=None, metavar="FILE", help="and this certificate (chain)")
    h.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a proxy in front of the server adds (ASGI root_path)",
    )
    h.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info")
    h.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no line logged per HTTP request"
    )
    h.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic log line of throughput, running and waiting requests, KV use and cache hits",
    )


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's keywords for the listener options on the command line."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    return {
        "log_level": args.uvicorn_log_level,
        "access_log": not args.disable_uvicorn_access_log,
        "root_path": args.root_path,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
    }


__all__ = ["add_serve_args", "uvicorn_options"]
