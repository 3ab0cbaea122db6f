"""Engine replicas on Ray Serve: prefix affinity against round robin, 2 replicas against 1, the router's cost.

Workload (issue 52): ``--apps`` applications with ``--system-tokens`` system prompts (chats) and ``--docs``
documents of ``--doc-tokens`` tokens with questions (completions); each request picks one of these shared
prefixes uniformly at random and arrives by a Poisson process. Every configuration is its own server,
started as a user starts it:

- ``direct``: ``prefixserve serve`` (one engine, no Ray);
- ``replicas1``: ``prefixserve serve --replicas 1`` (the same engine behind the Ray Serve ingresses, with
  the defaults a user gets: ``--engine-process auto``, ``--ingress-replicas`` per ``serve_app``);
- ``affinity``: ``--replicas N`` with prefix-affinity routing;
- ``round_robin``: ``--replicas N --routing round_robin``.

Each configuration is warmed (every prefix sent once per replica, so round robin starts with every
replica holding what it would hold), then walks a rate ladder up from half its warm-up burst's rate
until it stops keeping up (``serving_gpu.points.over``: served < 0.95 x offered, mean normalised latency
over ``--slo``, or a growing queue). A rate counts as sustained only below that. Prefix-cache hit tokens
are the clients' ``cached_tokens``. ``direct`` and ``replicas1`` also serve one closed burst of streamed
chats, all at once, for the router's cost in streamed tokens/s.

``python -m benchmarks.replicas --device cuda --model dummy:.whl/smol8b/config.json`` (8B config with
SmolLM2's tokenizer) on a 2-GPU machine writes ``docs/benchmarks/replicas.{json,md,png}``;
``--configs`` runs a subset and ``--merge`` adds an earlier run's configurations (one call each within the
device's time limit). ``--smoke``: the tiny model on the CPU, into a temp dir.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import TINY, dummy_model, run_info
from benchmarks.harness.output import RESULTS, pyplot, write_results
from benchmarks.harness.server import Clients, ServerProcess, free_port, http_get
from benchmarks.harness.text import text_of_tokens
from benchmarks.serving_gpu.points import over, summarize, sustainable

NAME = "replicas"
CONFIGS = ("direct", "replicas1", "affinity", "round_robin")

SMOKE = dict(
    apps=4,
    system_tokens=256,
    docs=8,
    doc_tokens=512,
    question_tokens=16,
    output_tokens=8,
    rate_ladder=[1.0, 2.0, 4.0, 8.0],
    start_rate=2.0,
    window=3.0,
    min_requests=6,
    max_requests=24,
    burst=8,
    slo=10.0,
    backlog=30.0,
    max_num_seqs=32,
    point_timeout=120.0,
    server_timeout=300.0,
    replica_cpus=0.5,
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--replicas", type=int, default=2, help="replicas of the affinity and round-robin configs")
    p.add_argument("--apps", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=4096)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rate-ladder", type=float, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48])
    p.add_argument(
        "--no-ladder", dest="ladder", action="store_false", help="skip the rate ladder (bursts only)"
    )
    p.add_argument("--start-rate", type=float, default=4.0, help="the ladder's first rate (req/s)")
    p.add_argument("--window", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=24)
    p.add_argument("--max-requests", type=int, default=480)
    p.add_argument("--burst", type=int, default=128, help="closed burst of streamed chats (router cost)")
    p.add_argument("--slo", type=float, default=0.1, help="mean normalised latency bound (s/token)")
    p.add_argument(
        "--backlog", type=float, default=4.0, help="TTFT growth across a window that means a queue"
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="each engine's KV pool (default: sized)")
    p.add_argument("--replica-cpus", type=float, default=None)
    p.add_argument(
        "--ingress-replicas",
        type=int,
        default=None,
        help="ingresses of the replica configs (default: the server's, 2+ on GPUs, 1 on the CPU)",
    )
    p.add_argument(
        "--engine-process",
        choices=["auto", "on", "off"],
        default=None,
        help="where every config runs its engines (default: the server's, auto)",
    )
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--point-timeout", type=float, default=180.0)
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="where replicas.{json,md,png} go (default docs/benchmarks)")
    p.add_argument("--merge", nargs="*", default=[], help="earlier replicas.json files whose configs to keep")
    p.add_argument(
        "--report",
        type=Path,
        help="a replicas.json: its sustained rates and ratios judged again from its points by the current "
        "rules, its Markdown and plot written beside it (nothing measured)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes on the CPU, into a temp dir")


# ---- the workload ------------------------------------------------------------------------------
def prefixes(tok: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The shared prefixes: applications' system prompts, then documents."""
    out = []
    for a in range(args.apps):
        rng = random.Random(f"app-{a}")
        text = f"You are assistant {a} of a shop. House rules follow. " + text_of_tokens(
            tok, rng, args.system_tokens
        )
        out.append({"kind": "chat", "text": text})
    for d in range(args.docs):
        rng = random.Random(f"doc-{d}")
        out.append(
            {"kind": "completion", "text": f"Document {d}. " + text_of_tokens(tok, rng, args.doc_tokens)}
        )
    return out


def request(tok: Any, prefix: dict[str, Any], rng: random.Random, i: int, offset: float, gen: int) -> dict:
    question = f"Question {i}: " + text_of_tokens(tok, rng, 16) + "?"
    if prefix["kind"] == "chat":
        messages = [{"role": "system", "content": prefix["text"]}, {"role": "user", "content": question}]
        body: dict[str, Any] = {"model": "default", "messages": messages}
    else:
        body = {"model": "default", "prompt": f"{prefix['text']}\n\n{question}\nAnswer:"}
    body.update(max_tokens=gen, temperature=0.0, extra_body={"ignore_eos": True})
    return {"i": i, "offset": offset, "kind": prefix["kind"], "stream": True, "body": body}


def poisson_requests(
    tok: Any, shared: list[dict[str, Any]], rate: float, n: int, seed: int, gen: int
) -> list[dict[str, Any]]:
    """``n`` requests at Poisson ``rate``, each on a uniformly chosen prefix (same seed: same requests)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        out.append(request(tok, shared[rng.randrange(len(shared))], rng, i, t, gen))
        t += rng.expovariate(rate)
    return out


def warm_requests(tok: Any, shared: list[dict[str, Any]], passes: int, gen: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    order = [p for _ in range(passes) for p in shared]
    return [request(tok, p, rng, i, 0.05 * i, gen) for i, p in enumerate(order)]


def burst_requests(tok: Any, shared: list[dict[str, Any]], n: int, gen: int) -> list[dict[str, Any]]:
    """``n`` chats after the applications' prompts, all at once (the prefixes are warm)."""
    rng = random.Random(11)
    apps = [p for p in shared if p["kind"] == "chat"]
    return [request(tok, apps[i % len(apps)], rng, i, 0.0, gen) for i in range(n)]


# ---- one configuration -------------------------------------------------------------------------
def server_for(name: str, args: argparse.Namespace, workdir: Path) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", args.model, "--device", args.device, "--max-num-seqs", str(args.max_num_seqs)]
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.engine_process is not None:
        cmd += ["--engine-process", args.engine_process]
    if name != "direct":
        cmd += ["--replicas", "1" if name == "replicas1" else str(args.replicas)]
        cmd += ["--routing", "round_robin" if name == "round_robin" else "prefix"]
        if args.replica_cpus is not None:
            cmd += ["--replica-cpus", str(args.replica_cpus)]
        if args.ingress_replicas is not None:
            cmd += ["--ingress-replicas", str(args.ingress_replicas)]
    return ServerProcess(cmd, workdir / f"server_{name}.log", name)


def replica_count(name: str, args: argparse.Namespace) -> int:
    return 1 if name in ("direct", "replicas1") else args.replicas


def point_line(name: str, r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"[{name}] {r['rate_req_s']:g} req/s: no request finished"
    return (
        f"[{name}] {r['rate_req_s']:g} req/s ({r['requests']} req, "
        f"arrivals {r.get('arrival_req_s', 0):.2f}/s): "
        f"served {r['served_fraction']:.3f}, "
        f"{r['throughput_tok_s']:.0f} tok/s, hit {r['cached_prompt_fraction']:.3f}, "
        f"TTFT {r['ttft_mean_s']:.2f} (p99 {r['ttft_p99_s']:.2f}) s, "
        f"norm {r['norm_latency_mean']:.4f} s/tok, "
        f"errors {r['errors']}"
    )


def hit_tokens(results: list[dict[str, Any]]) -> dict[str, int]:
    ok = [r for r in results if r["error"] is None]
    return {
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": sum(r["cached_tokens"] for r in ok),
    }


def point(rate: float, results: list[dict[str, Any]], start_at: float, slo: float) -> dict[str, Any]:
    """One rate's record. A finite window makes ``ok / (last end - first arrival)`` fall short of the
    offered rate even for a server that keeps up (the last arrival still needs its service time), and
    a Poisson draw of n requests spans more or less than n / rate: so ``served_fraction`` compares the
    actual finish with an ideal one, the last arrival plus an unqueued service time (the median
    end-to-end time of the first quarter of arrivals)."""
    row = {"rate_req_s": rate, **summarize(results, start_at, slo), **hit_tokens(results)}
    row["timed_out"] = any(r["error"] == "deadline" for r in results)
    ok = sorted((r for r in results if r["error"] is None and r["end"] is not None), key=lambda r: r["due"])
    if len(ok) >= 2:
        first_due, last_due = ok[0]["due"], max(r["due"] for r in results)
        quarter = ok[: max(1, len(ok) // 4)]
        service = sorted(r["end"] - r["sent"] for r in quarter)[len(quarter) // 2]
        ideal = last_due - first_due + service
        actual = max(r["end"] for r in ok) - first_due
        row["arrival_req_s"] = (len(results) - 1) / max(1e-9, last_due - first_due)
        row["served_fraction"] = len(ok) / len(results) * min(1.0, ideal / actual)
    else:
        row["served_fraction"] = 0.0
    return row


def keep_up_view(row: dict[str, Any]) -> dict[str, Any]:
    """The point as ``serving_gpu.points.over`` judges it: served = ``served_fraction`` x offered."""
    return {**row, "throughput_req_s": row.get("served_fraction", 0.0) * row["rate_req_s"]}


def run_config(
    name: str,
    args: argparse.Namespace,
    tok: Any,
    shared: list[dict[str, Any]],
    clients: Clients,
    workdir: Path,
) -> dict[str, Any]:
    server = server_for(name, args, workdir)
    section: dict[str, Any] = {"command": " ".join(server.cmd[1:]), "points": []}
    try:
        section["start_s"] = server.launch(args.server_timeout)
        print(f"[{name}] up in {section['start_s']:.1f} s", flush=True)
        warm = clients.run(
            server.url, warm_requests(tok, shared, replica_count(name, args), 8), args.point_timeout
        )
        w = summarize(warm["results"], warm["start_at"])
        section["warm"] = {**w, **hit_tokens(warm["results"])}
        if name in ("direct", "replicas1") and args.burst:
            # twice: the first puts the applications' prompts back in the cache (the warm-up's documents
            # pushed them out of a pool smaller than the workload); the second is the one kept
            for _ in range(2):
                run = clients.run(
                    server.url,
                    burst_requests(tok, shared, args.burst, args.output_tokens),
                    args.point_timeout,
                )
            section["burst"] = summarize(run["results"], run["start_at"])
            print(
                f"[{name}] burst: {section['burst'].get('throughput_tok_s', 0):.0f} streamed tok/s",
                flush=True,
            )
        ladder = sorted(args.rate_ladder)
        order = [r for r in ladder if r >= args.start_rate] if args.ladder else []
        downward = False
        while order:
            rate = order.pop(0)
            n = int(min(args.max_requests, max(args.min_requests, round(rate * args.window))))
            reqs = poisson_requests(tok, shared, rate, n, seed=int(rate * 1000), gen=args.output_tokens)
            run = clients.run(server.url, reqs, args.point_timeout)
            row = point(rate, run["results"], run["start_at"], args.slo)
            section["points"].append(row)
            print(point_line(name, row), flush=True)
            crossed = over(keep_up_view(row), args.slo, args.backlog)
            if crossed and len(section["points"]) == 1:
                downward = True  # the first rate is already too much: walk down
                order = [r for r in reversed(ladder) if r < rate]
            elif crossed != downward:
                break
        if section["points"]:
            section["sustained"] = sustainable(
                [keep_up_view(p) for p in section["points"]], args.slo, args.backlog
            )
        status, health = http_get(server.url + "/health")
        section["health"] = {"status": status, "body": health[:2000]}
    finally:
        section["exit"] = str(server.terminate(120.0))
        section["log_tail"] = server.log_tail(15)
    return section


# ---- the report --------------------------------------------------------------------------------
def sustained_rate(section: dict[str, Any]) -> float | None:
    s = section.get("sustained") or {}
    return s.get("interpolated") if s.get("interpolated") is not None else s.get("measured")


def common_hits(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int] | None:
    """Hit tokens of two configurations over the rates both ran (same requests at a rate)."""
    rates = {p["rate_req_s"] for p in a["points"]} & {p["rate_req_s"] for p in b["points"]}
    if not rates:
        return None
    return tuple(sum(p["cached_tokens"] for p in s["points"] if p["rate_req_s"] in rates) for s in (a, b))


def ratios(configs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    aff, rr, r1, direct = (configs.get(k) for k in ("affinity", "round_robin", "replicas1", "direct"))
    if aff and rr:
        sa, sr = sustained_rate(aff), sustained_rate(rr)
        out["affinity_vs_round_robin_sustained_x"] = sa / sr if sa and sr else None
        hits = common_hits(aff, rr)
        out["affinity_vs_round_robin_hit_tokens_x"] = hits[0] / hits[1] if hits and hits[1] else None
    if aff and r1:
        sa, s1 = sustained_rate(aff), sustained_rate(r1)
        out["affinity_vs_one_replica_sustained_x"] = sa / s1 if sa and s1 else None
    if r1 and direct and r1.get("burst") and direct.get("burst"):
        b1, bd = r1["burst"].get("throughput_tok_s"), direct["burst"].get("throughput_tok_s")
        out["router_streamed_tok_s_cost"] = 1.0 - b1 / bd if b1 and bd else None
    return out


TARGETS = {
    "affinity_vs_round_robin_sustained_x": (">=", 1.5),
    "affinity_vs_round_robin_hit_tokens_x": (">=", 2.0),
    "affinity_vs_one_replica_sustained_x": (">=", 1.8),
    "router_streamed_tok_s_cost": ("<=", 0.03),
}


def markdown(payload: dict[str, Any]) -> str:
    a = payload["args"]
    lines = [
        "# Replicas on Ray Serve: prefix affinity vs round robin",
        "",
        f"`{payload['command']}`: {a['apps']} applications with {a['system_tokens']}-token system "
        f"prompts and {a['docs']} documents of {a['doc_tokens']} tokens with questions, each request on a "
        f"uniformly chosen prefix, Poisson arrivals, {a['output_tokens']} streamed tokens each; "
        f"sustained = the highest rate "
        f"served at >= 0.95 x offered with mean normalised latency <= {a['slo']} s/token and TTFT growing "
        f"by <= {a['backlog']} s over a window.",
        "",
        *([payload["note"], ""] if payload.get("note") else []),
        "| config | replicas | sustained req/s | hit tokens / prompt tokens | burst streamed tok/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, s in payload["configs"].items():
        rate = sustained_rate(s)
        prompt = sum(p["prompt_tokens"] for p in s["points"])
        cached = sum(p["cached_tokens"] for p in s["points"])
        burst = (s.get("burst") or {}).get("throughput_tok_s")
        lines.append(
            f"| {name} | {s['replicas']} | {'-' if rate is None else f'{rate:.2f}'} "
            f"({(s.get('sustained') or {}).get('bound', '-')}) | {cached / max(1, prompt):.3f} | "
            f"{'-' if burst is None else f'{burst:,.0f}'} |"
        )
    lines += ["", "| ratio | value | target | met |", "| --- | ---: | ---: | --- |"]
    for key, value in payload["ratios"].items():
        op, goal = TARGETS[key]
        met = "-" if value is None else ("yes" if (value >= goal if op == ">=" else value <= goal) else "no")
        lines.append(f"| {key} | {'-' if value is None else f'{value:.3f}'} | {op} {goal} | {met} |")
    lines += ["", "Points (offered req/s: served fraction, hit fraction, mean TTFT):", ""]
    for name, s in payload["configs"].items():
        pts = ", ".join(
            f"{p['rate_req_s']:g}: served {p.get('served_fraction', 0):.3f} "
            f"({p.get('cached_prompt_fraction', 0):.2f}, "
            f"{p.get('ttft_mean_s', 0):.2f} s)"
            for p in sorted(s["points"], key=lambda p: p["rate_req_s"])
        )
        lines.append(f"- {name}: {pts}")
    info = payload["info"]
    lines += [
        "",
        f"Device: {info.get('device')} ({info.get('cpu_count')} CPUs); torch {info.get('torch')}, "
        f"ray {info.get('ray')}; commit {info.get('commit')}; {info.get('date')}."
        + (
            f" Sustained rates judged again from these points at {payload['judged']}."
            if "judged" in payload
            else ""
        ),
        "",
        f"![served vs offered]({NAME}.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, s in payload["configs"].items():
        pts = sorted(s["points"], key=lambda p: p["rate_req_s"])
        x = [p["rate_req_s"] for p in pts]
        ax1.plot(x, [p.get("served_fraction", 0) for p in pts], marker="o", label=name)
        ax2.plot(x, [p.get("ttft_mean_s", float("nan")) for p in pts], marker="o", label=name)
    ax1.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax1.set(xlabel="offered req/s", ylabel="served fraction", title="served / offered")
    ax2.set(xlabel="offered req/s", ylabel="mean TTFT (s)", title="TTFT", yscale="log")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(path: Path) -> int:
    """Rewrite a result from its own points (the rules of ``serving_gpu.points`` as they are now)."""
    payload = json.loads(path.read_text())
    slo, backlog = payload["args"]["slo"], payload["args"]["backlog"]
    for section in payload["configs"].values():
        if section.get("points"):
            section["sustained"] = sustainable([keep_up_view(p) for p in section["points"]], slo, backlog)
    payload["ratios"] = ratios(payload["configs"])
    payload["judged"] = run_info()["commit"]
    write_results(NAME, payload, markdown(payload), path.parent)
    plot(payload, path.parent / f"{NAME}.png")
    return 0


# ---- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    args = p.parse_args(argv)
    if args.report:
        return report(args.report)
    tmp = Path(tempfile.mkdtemp(prefix="replicas-"))
    if args.smoke:
        p.set_defaults(**SMOKE, device="cpu")
        args = p.parse_args(argv)
        if args.model == "dummy:llama-3.1-8b":
            args.model = dummy_model(TINY, tmp / "tiny")
    from prefixserve.model.loader import tokenizer_for

    _, tok = tokenizer_for(args.model, progress=False)
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer: the benchmark needs text prompts")
    shared = prefixes(tok, args)
    configs: dict[str, Any] = {}
    for path in args.merge:
        configs.update(json.loads(Path(path).read_text())["configs"])
    clients = Clients(args.clients)
    try:
        for name in args.configs:
            fresh = {
                "replicas": replica_count(name, args),
                **run_config(name, args, tok, shared, clients, tmp),
            }
            if not fresh["points"] and name in configs:  # bursts only: the earlier run's ladder stays
                fresh = {
                    **fresh,
                    **{k: configs[name][k] for k in ("points", "sustained") if k in configs[name]},
                }
            configs[name] = fresh
    finally:
        clients.close()
    info = run_info(("ray", "transformers"))
    payload = {
        "command": "python -m benchmarks.replicas " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: v for k, v in vars(args).items() if k != "merge"},
        "info": info,
        "configs": {k: configs[k] for k in CONFIGS if k in configs},
    }
    payload["ratios"] = ratios(payload["configs"])
    out = Path(args.out) if args.out else (tmp / "out" if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(payload)
    write_results(NAME, payload, md, out)
    plot(payload, out / f"{NAME}.png")
    if not args.smoke:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
