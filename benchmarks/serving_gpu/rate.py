"""Part ``rate`` (RelayAttention Fig. 5/6): latency vs arrival rate, each configuration its own server."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.server import Clients, scrape
from benchmarks.harness.text import rendered_tokens
from benchmarks.serving_gpu.points import over, summarize, sustainable
from benchmarks.serving_gpu.server import Server, ServerSpec, metrics_delta
from benchmarks.serving_gpu.workload import chat_requests, system_prompt


def rate_specs(args: argparse.Namespace, systems: dict[str, str]) -> list[ServerSpec]:
    plain = "triton_paged" if args.device == "cuda" else "reference"
    specs = {
        "on": ServerSpec("on", "auto", True, dict(systems), args.max_num_seqs),
        "off": ServerSpec("off", plain, False, {}, args.max_num_seqs),
        "pinned": ServerSpec("pinned", plain, True, dict(systems), args.max_num_seqs),
    }
    return [specs[c] for c in args.configs]


class Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.end = None if not seconds else time.monotonic() + seconds

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() > self.end


def run_point(
    clients: Clients,
    server: Server,
    tok: Any,
    system: str,
    rate: float,
    seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    n = int(min(args.max_requests, max(args.min_requests, round(rate * args.window))))
    reqs = chat_requests(tok, system, n, seed, args, rate, logprobs=args.logprobs)
    before = scrape(server.url)
    t0 = time.monotonic()
    run = clients.run(server.url, reqs, args.point_timeout)
    wall = time.monotonic() - t0
    time.sleep(0.2)  # let the engine thread's snapshot catch up
    stats = summarize(run["results"], run["start_at"], args.slo)
    stats["timed_out"] = any(r["error"] == "deadline" for r in run["results"])
    stats["server"] = metrics_delta(before, scrape(server.url))
    stats["wall_s"] = wall
    return stats


def rate_part(
    args: argparse.Namespace, tok: Any, workdir: Path, clients: Clients, deadline: Deadline
) -> dict[str, Any]:
    systems = {f"s{n}": system_prompt(tok, n, seed=n) for n in sorted(args.system_tokens, reverse=True)}
    sizes = {
        f"s{n}": rendered_tokens(tok, [{"role": "system", "content": systems[f"s{n}"]}])
        for n in args.system_tokens
    }
    section: dict[str, Any] = {
        "system_prompt_tokens": sizes,
        "servers": {},
        "points": [],
        "warm": [],
        "sustainable": {},
        "skipped": [],
    }
    for spec in rate_specs(args, systems):
        server = Server(args, spec, workdir)
        try:
            server.start(args.server_timeout)
            for k, (app, system) in enumerate(systems.items()):
                size = sizes[app]
                # warm-up: a burst with the run's lengths (kernels compile, graphs get captured); its
                # throughput says where the sweep starts (a quarter of this burst's request rate)
                warm_reqs = chat_requests(tok, system, args.warm_requests, 900 + k, args, None, args.logprobs)
                warm = summarize(clients.run(server.url, warm_reqs, args.point_timeout)["results"], 0.0)
                burst_rate = warm.get("throughput_req_s", args.rate_ladder[0])
                section["warm"].append({"config": spec.name, "system_tokens": size, **warm})
                ladder = sorted(args.rates or [r for r in args.rate_ladder if r <= args.rate_max])
                if args.rates:
                    order = ladder
                else:  # up from half the burst's rate until the SLO is crossed; down if the first crosses
                    start = max([i for i, r in enumerate(ladder) if r <= burst_rate / 2] or [0])
                    order = ladder[start:]
                print(
                    f"[rate {spec.name} {size} tok] warm-up burst: {burst_rate:.2f} req/s, "
                    f"{warm.get('throughput_tok_s', 0):.0f} tok/s; rates from {order[0]:g}",
                    flush=True,
                )
                points: list[dict[str, Any]] = []
                downward = False
                while order:
                    rate = order.pop(0)
                    if deadline.passed():
                        section["skipped"].append(
                            {"config": spec.name, "system_tokens": size, "rate_req_s": rate}
                        )
                        print(
                            f"[rate {spec.name} {size} tok] {rate:g} req/s skipped: out of time", flush=True
                        )
                        continue
                    seed = 1000 * (k + 1) + int(rate * 100)  # same requests for every configuration
                    stats = run_point(clients, server, tok, system, rate, seed, args)
                    row = {
                        "config": spec.name,
                        "system_tokens": size,
                        "app": app,
                        "rate_req_s": rate,
                        **stats,
                    }
                    points.append(row)
                    section["points"].append(row)
                    print(point_line(row), flush=True)
                    if args.rates:
                        continue
                    crossed = over(row, args.slo, args.backlog)
                    if crossed and len(points) == 1 and not downward:
                        downward = True  # the first rate is already over the SLO: walk down
                        order = [r for r in reversed(ladder) if r < rate]
                    elif (crossed and not downward) or (downward and not crossed):
                        break
                section["sustainable"].setdefault(spec.name, {})[str(size)] = sustainable(
                    points, args.slo, args.backlog
                )
        finally:
            server.stop()
            section["servers"][spec.name] = server.info
    return section


def point_line(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"[rate {r['config']} {r['system_tokens']} tok] {r['rate_req_s']:g} req/s: no request finished"
    return (
        f"[rate {r['config']} {r['system_tokens']} tok] {r['rate_req_s']:g} req/s ({r['requests']} req): "
        f"{r['throughput_req_s']:.2f} req/s served (goodput {r.get('goodput_req_s', 0.0):.2f}), "
        f"{r['throughput_tok_s']:.0f} tok/s, "
        f"norm {r['norm_latency_mean']:.4f} (p99 {r['norm_latency_p99']:.4f}) s/tok, "
        f"TTFT {r['ttft_mean_s']:.3f} (p99 {r['ttft_p99_s']:.3f}) s, "
        f"ITL {1e3 * r['itl_mean_s']:.1f} (p99 {1e3 * r['itl_p99_s']:.1f}) ms, errors {r['errors']}, "
        f"{r['wall_s']:.0f} s"
    )
