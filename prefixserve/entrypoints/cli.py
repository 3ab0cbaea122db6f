"""The ``prefixserve`` command: generate, chat, bench, batch and serve, on the default model by default;
``schema`` manages the Prompt Cache schemas of a running server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefixserve.entrypoints.args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    parse_bytes,
    parse_logit_bias,
)
from prefixserve.entrypoints.demo import DEMO_QUESTIONS, DEMO_SYSTEM, sharing_report
from prefixserve.entrypoints.serve_args import add_serve_args
from prefixserve.promptcache.pml import is_pml_prompt


def _make_llm(args: argparse.Namespace, sequences: int | None = None) -> Any:
    """The engine the options describe. ``sequences``: how many sequences the command runs (generate,
    chat): without ``--max-num-seqs`` that many run at once, and the default KV pool holds that many
    of the model's context, not 256 of them."""
    from prefixserve.entrypoints.llm import LLM

    config = engine_config_from_args(args)
    if sequences is not None and args.max_num_seqs is None:
        config.max_num_seqs = max(1, min(sequences, config.max_num_seqs))
    return LLM.from_config(config)


def _params(args: argparse.Namespace) -> Any:
    from prefixserve.sampling.params import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=parse_logit_bias(args.logit_bias),
    )


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            raise ValueError(f"prompt file {args.file!r} not found")
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError) as exc:
                    raise ValueError(f"bad JSONL line in {args.file}: {exc}") from exc
            else:
                prompts.append(line)
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    system = args.system
    if not prompts:
        prompts, system = DEMO_QUESTIONS, system or DEMO_SYSTEM
        print(f"(no prompts given: running a demo of {len(prompts)} questions sharing one system prompt)")
    params = _params(args)
    llm = _make_llm(args, sequences=len(prompts) * params.num_samples)
    # PML prompts (<prompt schema="...">, with --schema) go as they are: their schema has the roles
    pml = [is_pml_prompt(p) for p in prompts]
    if args.raw:
        texts = [p if is_pml else (system or "") + p for p, is_pml in zip(prompts, pml, strict=True)]
        outs = llm.generate(texts, params)
    else:
        convs = [
            ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
            for p, is_pml in zip(prompts, pml, strict=True)
            if not is_pml
        ]
        chats = iter(llm.chat(convs, params) if convs else [])
        pml_prompts = [p for p, is_pml in zip(prompts, pml, strict=True) if is_pml]
        raws = iter(llm.generate(pml_prompts, params) if pml_prompts else [])
        outs = [next(raws) if is_pml else next(chats) for is_pml in pml]
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"\n>>> {prompt}")
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{c.text.strip()}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    print("\n" + sharing_report(llm.metrics(), modules=any(pml)))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _make_llm(args, sequences=params.num_samples)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("prefixserve chat: type a message, /reset to clear the history, Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            continue
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.render_chat(history)
        print("bot> ", end="", flush=True)
        shown = ""
        final = None
        for out in llm.stream(prompt, params):
            text = out.outputs[0].text
            if text.startswith(shown) and not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text
            final = out
        text = final.outputs[0].text if final else ""
        sys.stdout.write(text[len(shown) :] + "\n")
        history.append({"role": "assistant", "content": text})


def cmd_bench(args: argparse.Namespace) -> int:
    from prefixserve.entrypoints.bench import run_shared_prefix_bench

    llm = _make_llm(args)
    report = run_shared_prefix_bench(
        llm,
        num_requests=args.num_requests,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        seed=args.bench_seed,
    )
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shared-prefix bench: {args.num_requests} requests, prefix {args.prefix_len}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    """An OpenAI Batch file, grouped by shared prefix (BatchLLM); --analyze plans it without the model."""
    if not Path(args.input).is_file():
        raise ValueError(f"batch input {args.input!r} not found")
    if args.analyze:
        return _analyze(args)
    if not args.output:
        raise ValueError("give the output file: prefixserve batch INPUT.jsonl -o OUTPUT.jsonl")
    if args.ray:
        from prefixserve.ray_scaleout.ray_batch import run_batch_file_ray

        config = engine_config_from_args(args)
        summary = run_batch_file_ray(
            config, args.input, args.output, args.replicas, args.grouping, not args.no_progress
        )
    else:
        llm = _make_llm(args)
        summary = llm.batch(args.input, args.output, args.grouping, progress=not args.no_progress)
    print(json.dumps(summary))
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from prefixserve.entrypoints.args import read_system_prompts
    from prefixserve.entrypoints.batch_runner import analyze_batch_file
    from prefixserve.model.loader import tokenizer_for

    name, tokenizer = tokenizer_for(args.model)
    if tokenizer is None:
        raise ValueError(f"model {name!r} has no tokenizer to analyze a batch with")
    systems = read_system_prompts(args.system_prompt)
    report = analyze_batch_file(tokenizer, name, systems, args.input, args.grouping, args.block_size)
    table = Table(title=f"batch plan: {args.input} ({args.grouping} grouping)")
    table.add_column("")
    table.add_column("value", justify="right")
    for key, value in report.items():
        shown = f"{value:.1%}" if key.endswith("saving") else value
        table.add_row(key.replace("_", " "), str(shown))
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return _serve_replicas(args)
    try:
        from prefixserve.entrypoints.openai.server import serve
    except ImportError as exc:
        raise SystemExit(
            f"error: the server needs fastapi, uvicorn, pydantic and prometheus-client ({exc}); "
            "reinstall prefixserve (pip install -e .) to get them"
        ) from exc
    return serve(args)


def _serve_replicas(args: argparse.Namespace) -> int:
    """``serve --replicas N``: N engines on Ray Serve behind one prefix-affinity endpoint."""
    import logging

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.ingress_replicas is not None and args.ingress_replicas < 1:
        raise ValueError(f"--ingress-replicas must be >= 1, got {args.ingress_replicas}")
    if args.switch_interval_ms <= 0:
        raise ValueError(f"--switch-interval-ms must be > 0, got {args.switch_interval_ms}")
    if args.ssl_keyfile or args.ssl_certfile or args.root_path:
        raise ValueError(
            "--ssl-keyfile, --ssl-certfile and --root-path are not taken with --replicas "
            "(Ray Serve's proxy is the listener; put a TLS proxy in front of it)"
        )
    try:
        from prefixserve.ray_scaleout.serve_app import run_replicas
    except ImportError as exc:
        raise SystemExit(f"error: {exc}") from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from prefixserve.entrypoints.openai.server import batch_settings, overload_settings
    from prefixserve.ray_scaleout.router import RoutingPolicy

    config = engine_config_from_args(args)
    overload = overload_settings(args)
    policy = RoutingPolicy(routing=args.routing)
    return run_replicas(
        config,
        args.replicas,
        args.host,
        args.port,
        args.api_key,
        args.replica_cpus,
        overload=overload,
        policy=policy,
        engine_process=args.engine_process,
        ingress_replicas=args.ingress_replicas,
        switch_interval_ms=args.switch_interval_ms,
        max_stored_responses=args.max_stored_responses,
        allowed_origins=args.allowed_origins,
        batches=batch_settings(args),
    )


# ---- prefixserve schema: a running server's Prompt Cache schemas ---------------------------------
class ServerError(Exception):
    """The server refused (its error message), or could not be reached."""


def _server_call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    """One JSON request to the server at ``--url`` (stdlib only: the CLI needs no HTTP client)."""
    import urllib.error
    import urllib.request

    url = args.url.rstrip("/") + path
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode("utf-8")
        headers["Content-Type"] = "application/json"
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode("utf-8", "replace")
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.strip() or exc.reason
        raise ServerError(f"{method} {url}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"cannot reach the server at {args.url}: {reason}") from None


def _schema_line(info: dict[str, Any]) -> str:
    modules = info.get("modules", [])
    return (
        f"{info['name']}: {len(modules)} module{'s' if len(modules) != 1 else ''} "
        f"({', '.join(modules) or 'none'}), {info.get('tokens', 0)} tokens in {info.get('pieces', 0)} "
        f"pieces, {info.get('positions', 0)} positions"
        + (f", recompute {info['module_recompute']}" if info.get("module_recompute") else "")
    )


def cmd_schema(args: argparse.Namespace) -> int:
    try:
        if args.action == "add":
            if args.file == "-":
                text = sys.stdin.read()
            else:
                path = Path(args.file)
                if not path.is_file():
                    raise ValueError(f"schema file {args.file!r} not found")
                text = path.read_text(encoding="utf-8")
            body = {"schema": text, "replace": args.replace, "pin": args.pin, "encode": not args.no_encode}
            if args.module_recompute is not None:
                body["module_recompute"] = args.module_recompute
            info = _server_call(args, "POST", "/v1/schemas", body)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                print(f"registered {_schema_line(info)}{' (pinned)' if args.pin else ''}")
        elif args.action == "list":
            schemas = _server_call(args, "GET", "/v1/schemas")["data"]
            if args.json:
                print(json.dumps(schemas, indent=2))
            elif not schemas:
                print("no schemas registered")
            else:
                for info in schemas:
                    print(_schema_line(info))
        else:
            from urllib.parse import quote

            _server_call(args, "DELETE", f"/v1/schemas/{quote(args.name, safe='')}")
            print(f"removed schema {args.name!r}")
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_schema_parser(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    common.add_argument("--api-key", default=None, help="the server's API key (--api-key of serve)")
    common.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
    common.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p = sub.add_parser(
        "schema", help="add, list or remove the Prompt Cache schemas (PML) of a running server"
    )
    actions = p.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", parents=[common], help="register the PML <schema> in FILE ('-': stdin)")
    add.add_argument("file", metavar="FILE")
    add.add_argument("--replace", action="store_true", help="replace a schema of the same name")
    add.add_argument("--pin", action="store_true", help="keep its modules on the GPU for good")
    add.add_argument("--no-encode", action="store_true", help="encode its modules at first use, not now")
    add.add_argument(
        "--module-recompute",
        default=None,
        metavar="MODE",
        help="the schema's accuracy recovery: none, link:K or blend:R (requests may override)",
    )
    actions.add_parser("list", parents=[common], help="the registered schemas")
    rm = actions.add_parser("rm", parents=[common], help="remove a schema")
    rm.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_schema)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts (args or --file) and print the results")
    g.add_argument("prompts", nargs="*", help="prompts (default: a small shared-system-prompt demo)")
    g.add_argument("--file", help="one prompt per line, or JSONL with a 'prompt' field")
    g.add_argument("--system", default=None, help="system prompt shared by every prompt")
    g.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    add_engine_args(g)
    add_sampling_args(g, max_tokens=64)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams tokens as they come")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="offline throughput on a synthetic shared-prefix workload")
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--prefix-len", type=int, default=1000, help="shared prefix tokens")
    b.add_argument("--suffix-len", type=int, default=64, help="unique prompt tokens per request")
    b.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    b.add_argument("--bench-seed", type=int, default=0)
    b.add_argument("--json", default=None, help="also write the report as JSON here")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("batch", help="run an OpenAI Batch file (JSONL), grouped by shared prefix; resumable")
    t.add_argument("input", help="OpenAI Batch input: one request per line (custom_id, method, url, body)")
    t.add_argument("-o", "--output", default=None, help="output JSONL (appended; a rerun resumes)")
    t.add_argument("--analyze", action="store_true", help="print the plan and its token saving, run nothing")
    t.add_argument("--json", default=None, help="with --analyze: also write the report as JSON here")
    t.add_argument("--grouping", default="first_level", choices=["first_level", "tree"])
    t.add_argument("--ray", action="store_true", help="spread the groups over Ray replicas")
    t.add_argument("--replicas", type=int, default=None, help="with --ray: replicas (default: GPUs, or 2)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(t)
    t.set_defaults(func=cmd_batch)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require Authorization: Bearer KEY (or x-api-key: KEY); several keys: each one a tenant "
        "(fair shares, per-tenant metrics)",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="browser origins that may call the server (CORS; '*': any); none by default",
    )
    s.add_argument(
        "--switch-interval-ms",
        type=float,
        default=SERVER_SWITCH_INTERVAL_MS,
        help="Python's thread switch interval in the server (with --replicas: in each replica): how long "
        "the engine thread can wait for the GIL while the HTTP loop holds it (Python's default is 5)",
    )
    s.add_argument(
        "--engine-process",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the engine in its own process, apart from the HTTP loop's GIL (auto: on a GPU); "
        "with --replicas: each replica's engine",
    )
    s.add_argument(
        "--max-stored-responses",
        type=int,
        default=1024,
        metavar="N",
        help="/v1/responses kept for previous_response_id and GET, least recently used dropped first "
        "(default 1024; 0: none are stored); with --replicas: each replica's",
    )
    b = s.add_argument_group("files and batches (OpenAI's /v1/files and /v1/batches)")
    b.add_argument(
        "--files-dir",
        default=None,
        metavar="DIR",
        help="where uploaded files, batches and their results are kept; a restarted server resumes the "
        "unfinished batches it finds there (default: a temporary folder removed at exit)",
    )
    b.add_argument(
        "--max-file-bytes",
        type=parse_bytes,
        default="200M",
        metavar="SIZE",
        help="largest upload (default 200M, OpenAI's limit on a batch input file)",
    )
    b.add_argument(
        "--batch-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="rows in flight at once over all batches (default: twice --max-num-seqs)",
    )
    b.add_argument(
        "--batch-grouping",
        default="first_level",
        choices=("first_level", "tree", "none"),
        help="the order a batch's rows run in: prefix-sharing groups (first_level, tree) or the "
        "file's order (none)",
    )
    o = s.add_argument_group("overload (beyond a bound: 429 with Retry-After)")
    o.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests that may wait to start (default: 4 x --max-num-seqs; 0: unbounded)",
    )
    o.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens the waiting requests may still have to compute, shared prefixes counted once "
        "(default: 2 x the KV pool's tokens; 0: unbounded)",
    )
    o.add_argument(
        "--max-queue-delay",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a request that has not started this long after it came is dropped before it runs (429); "
        "a request's X-Max-Queue-Delay header may ask for less (default: no deadline)",
    )
    o.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a stream whose client takes nothing for this long has its requests aborted, freeing "
        "their KV (default 60; 0: never)",
    )
    s.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas on Ray Serve behind a prefix-affinity router (pip install -e '.[ray]')",
    )
    s.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="with --replicas: CPUs Ray reserves per replica (default: 1, or what fits beside the ingresses)",
    )
    s.add_argument(
        "--ingress-replicas",
        type=int,
        default=None,
        metavar="K",
        help="with --replicas: ingresses relaying the streams (default: one per replica, at least 2, "
        "when replicas run on GPUs; else 1); each routes with its own loads and sessions",
    )
    s.add_argument(
        "--routing",
        choices=["prefix", "round_robin"],
        default="prefix",
        help="with --replicas: prefix affinity (default), or round robin (the baseline for affinity)",
    )
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    _add_schema_parser(sub)
    return parser


# The engine thread releases the GIL at every torch call and must win it back from the HTTP loop;
# at Python's 5 ms it waited long enough to leave the GPU idle: 256 streamed chats after an 8K-token
# system prompt ran 6,900 -> 7,850 tok/s at 0.5 ms on an H100 (benchmarks/probes/server_compare.py).
SERVER_SWITCH_INTERVAL_MS = 0.5


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) is not None and getattr(args, "max_tokens", 1) < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
