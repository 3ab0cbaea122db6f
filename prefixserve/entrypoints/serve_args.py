"""``serve``'s options for the HTTP listener (TLS, root path, uvicorn's logs), the engine's seed and
the model named first, under vLLM's names: a ``vllm serve`` command line runs here as it is.

Only the standard library is imported: ``cli`` builds its parser without the server's packages.
"""

from __future__ import annotations

import argparse
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # the formats tools.parse_calls reads
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
    t = s.add_argument_group(
        "tool calling (always on; the output is read as Hermes <tool_call> blocks "
        "or one bare JSON call object, whichever it holds)"
    )
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's switch for tool_choice 'auto': accepted, as it is always on here",
    )
    t.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="vLLM's parser names whose formats the reader takes: hermes (Qwen2.5, Hermes) and "
        'llama3_json (a bare {"name", "parameters"} object)',
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
        "--enable-log-requests",
        action="store_true",
        help="log each request as it is queued: its id, prompt and parameters (off by default)",
    )
    h.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        help="vLLM's older name for the default: no request is logged",
    )
    h.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        metavar="N",
        help="with --enable-log-requests: a prompt's first N characters and token ids (default: whole)",
    )
    h.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic log line of throughput, running and waiting requests, KV use and cache hits",
    )


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's keywords for the listener options on the command line."""
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
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
