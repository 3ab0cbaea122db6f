"""What the server's chat burst loses to the offline API, and to which part of the server.

The same 256-chat bursts (8K-token system prompt, serving_gpu's chat shape) through: the offline
``LLM.chat``, then one `on` server per ``--servers`` entry, each taking the bursts streamed and not
streamed (no per-token SSE chunks on the HTTP loop): ``default``, ``switch=MS`` (``serve
--switch-interval-ms``: how long a thread that wants the GIL waits before the holder is asked to drop
it), ``stream=K`` (``--stream-interval K``) or ``process=on|off`` (``--engine-process``). Prints
tok/s per burst and the server's GPU busy / idle seconds.

PYTHONPATH=. python -m benchmarks.probes.server_compare --repeats 3 --servers process=off default
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness.server import Clients
from benchmarks.serving_gpu import cli, hydragen, workload
from benchmarks.serving_gpu.server import Server, ServerSpec
from prefixserve.model.loader import tokenizer_for


def server_bursts(args, spec, workdir, clients, warm, bursts, extra: list[str]) -> dict[str, list[float]]:
    """Streamed and unstreamed timed bursts on one fresh server, alternating; returns tok/s lists."""
    server = Server(
        argparse.Namespace(**{**vars(args), "server_arg": args.server_arg + extra}), spec, workdir
    )
    out: dict[str, list[float]] = {"streamed": [], "not streamed": []}
    try:
        server.start(args.server_timeout)
        hydragen.server_burst(clients, server, warm, args)
        for streamed, unstreamed in bursts:
            for name, reqs in (("streamed", streamed), ("not streamed", unstreamed)):
                stats = hydragen.server_burst(clients, server, reqs, args)
                s = stats.get("server", {})
                print(
                    f"  {name:13s} {stats.get('tok_s', 0):7.0f} tok/s  busy {s.get('gpu_busy_s', 0):.2f} s"
                    f"  idle {s.get('gpu_idle_s', 0):.2f} s  captures {s.get('graph_captures', 0):.0f}",
                    flush=True,
                )
                out[name].append(stats.get("tok_s", 0.0))
    finally:
        server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    cli.add_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--servers",
        nargs="+",
        default=["process=off", "default"],
        help="default, switch=MS, stream=K, process=on|off",
    )
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="server_compare_"))
    _, tok = tokenizer_for(args.model, progress=False)
    system = workload.system_prompt(tok, max(args.system_tokens), seed=max(args.system_tokens))

    def chats(seed: int, stream: bool = True) -> list:
        return workload.chat_requests(
            tok, system, args.burst, seed, args, None, logprobs=False, stream=stream, tag="b"
        )

    warm = chats(7000)
    seeds = [7001 + r for r in range(args.repeats)]
    pairs = [(chats(s), chats(s, stream=False)) for s in seeds]
    results: dict[str, list[float]] = {}
    offline = hydragen.offline_runs(args, {"chat": [warm, *(p[0] for p in pairs)]})
    results["offline"] = offline["runs"]["chat"]
    print(f"offline: {results['offline']}", flush=True)
    spec = ServerSpec("on", "auto", True, {}, args.hydragen_max_num_seqs)
    clients = Clients(args.clients)
    try:
        for config in args.servers:
            kind, _, value = config.partition("=")
            extra = {
                "default": [],
                "switch": ["--switch-interval-ms", value],
                "stream": ["--stream-interval", value],
                "process": ["--engine-process", value],
            }
            print(f"server {config}:", flush=True)
            for name, runs in server_bursts(args, spec, workdir, clients, warm, pairs, extra[kind]).items():
                results[f"server {config}, {name}"] = runs
    finally:
        clients.close()
    best = max(results["offline"])
    print("\n| run | tok/s | mean | best / offline best |\n|---|---|---:|---:|")
    for name, values in results.items():
        runs = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {runs} | {statistics.mean(values):.0f} | {max(values) / best:.1%} |")


if __name__ == "__main__":
    main()
