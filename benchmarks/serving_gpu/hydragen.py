"""Part ``hydragen`` (a document's questions, samples after a few-shot prefix), and the offline API
against the server on the same bursts."""

from __future__ import annotations

import argparse
import gc
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import mean
from benchmarks.harness.server import Clients, scrape
from benchmarks.harness.text import rendered_tokens
from benchmarks.serving_gpu.server import Server, ServerSpec, metrics_delta
from benchmarks.serving_gpu.workload import chat_requests, doc_requests, sample_requests, system_prompt


def burst_stats(run: dict[str, Any]) -> dict[str, Any]:
    res = run["results"]
    ok = [r for r in res if r["error"] is None and r["end"] is not None]
    out: dict[str, Any] = {"requests": len(res), "ok": len(ok), "errors": len(res) - len(ok)}
    if len(ok) < len(res):
        out["error_sample"] = next(r["error"] for r in res if r["error"] is not None)
    if ok:
        span = max(r["end"] for r in ok) - min(r["sent"] for r in ok)
        tokens = sum(r["tokens"] for r in ok)
        out.update(
            time_to_all_s=span,
            generated_tokens=tokens,
            tok_s=tokens / span,
            cached_prompt_fraction=sum(r["cached_tokens"] for r in ok)
            / max(1, sum(r["prompt_tokens"] for r in ok)),
        )
    return out


def server_burst(
    clients: Clients, server: Server, reqs: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    before = scrape(server.url)
    stats = burst_stats(clients.run(server.url, reqs, args.point_timeout * 2))
    time.sleep(0.2)
    stats["server"] = metrics_delta(before, scrape(server.url))
    return stats


def offline_runs(args: argparse.Namespace, bursts: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """The same bursts through the offline LLM API (this process), with the `on` server's settings;
    the engine is shut down and its GPU memory given back before the servers start."""
    import torch

    try:
        return _offline_runs(args, bursts)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _offline_runs(args: argparse.Namespace, bursts: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    from prefixserve import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        args.model,
        device=args.device,
        attention="auto",
        max_num_seqs=args.hydragen_max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        progress=False,
    )
    out: dict[str, Any] = {"load_s": time.monotonic() - t0, "runs": {}}

    def run(reqs: list[dict[str, Any]]) -> float:
        params = [
            SamplingParams(
                n=r["body"].get("n", 1),
                max_tokens=r["body"]["max_tokens"],
                temperature=r["body"]["temperature"],
                seed=r["body"].get("seed"),
                ignore_eos=True,
            )
            for r in reqs
        ]
        start = time.perf_counter()
        if reqs[0]["kind"] == "chat":
            outs = llm.chat([r["body"]["messages"] for r in reqs], params)
        else:
            outs = llm.generate([r["body"]["prompt"] for r in reqs], params)
        elapsed = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed

    try:
        for name, runs in bursts.items():
            warm, *timed = runs
            run(warm)
            out["runs"][name] = [run(r) for r in timed]
            print(f"[offline] {name}: {', '.join(f'{x:.0f}' for x in out['runs'][name])} tok/s", flush=True)
        if llm.engine.graphs is not None:
            out["graphs_captured"] = llm.engine.graphs.captures
        out["kv_blocks_total"] = llm.metrics()["kv_blocks_total"]
    finally:
        llm.shutdown()
    return out


def hydragen_part(
    args: argparse.Namespace, tok: Any, workdir: Path, clients: Clients
) -> tuple[dict[str, Any], dict[str, Any]]:
    plain = "triton_paged" if args.device == "cuda" else "reference"
    specs = [
        ServerSpec("on", "auto", True, {}, args.hydragen_max_num_seqs),
        ServerSpec("off", plain, True, {}, args.hydragen_max_num_seqs),
        ServerSpec("ceiling", "none", True, {}, args.hydragen_max_num_seqs),
    ]
    system = system_prompt(tok, max(args.system_tokens), seed=max(args.system_tokens))
    # the offline-vs-server bursts: [warm-up, timed...]; identical requests on both sides
    bursts = {
        "chat": [
            chat_requests(tok, system, args.burst, 7000 + r, args, None, logprobs=False, tag="b")
            for r in range(args.repeats + 1)
        ],
        "document": [doc_requests(tok, args, 8000 + r) for r in range(args.repeats + 1)],
    }
    comparison: dict[str, Any] = {
        "settings": {
            "burst_requests": args.burst,
            "system_tokens": rendered_tokens(tok, [{"role": "system", "content": system}]),
            "questions": args.questions,
            "repeats": args.repeats,
        }
    }
    if args.offline:
        comparison["offline"] = offline_runs(args, bursts)
    section: dict[str, Any] = {
        "settings": {
            "doc_tokens": bursts["document"][0][0]["doc"],
            "questions": args.questions,
            "problems": args.problems,
            "samples": args.samples,
            "fewshot_tokens": args.fewshot_tokens,
            "gen": args.gen,
        },
        "servers": {},
        "modes": {},
    }
    for spec in specs:
        if spec.name not in args.hydragen_modes:
            continue
        server = Server(args, spec, workdir)
        try:
            server.start(args.server_timeout)
            mode: dict[str, Any] = {}
            # untimed first: the same shapes with other tokens (compiles, graph captures)
            server_burst(clients, server, doc_requests(tok, args, 9000), args)
            if spec.name == "on":  # its timed document runs are the offline comparison's server side
                mode["document_runs"] = [
                    server_burst(clients, server, reqs, args) for reqs in bursts["document"][1:]
                ]
                mode["document"] = min(mode["document_runs"], key=lambda s: s.get("time_to_all_s", math.inf))
            else:
                mode["document"] = server_burst(clients, server, bursts["document"][1], args)
            server_burst(clients, server, sample_requests(tok, args, 9100), args)
            mode["samples"] = server_burst(clients, server, sample_requests(tok, args, 9200), args)
            for part in ("document", "samples"):
                print(f"[hydragen {spec.name}] {part}: {hydragen_line(mode[part])}", flush=True)
            if spec.name == "on" and args.offline:
                server_burst(clients, server, bursts["chat"][0], args)
                chat_runs = [server_burst(clients, server, reqs, args) for reqs in bursts["chat"][1:]]
                comparison["server"] = {
                    "chat": [s.get("tok_s", 0.0) for s in chat_runs],
                    "document": [s.get("tok_s", 0.0) for s in mode["document_runs"]],
                    "chat_runs": chat_runs,
                }
            section["modes"][spec.name] = mode
        finally:
            server.stop()
            section["servers"][spec.name] = server.info
    if "offline" in comparison and "server" in comparison:
        comparison["ratios"] = {
            name: {
                "best": max(comparison["server"][name]) / max(comparison["offline"]["runs"][name]),
                "mean": mean(comparison["server"][name]) / mean(comparison["offline"]["runs"][name]),
            }
            for name in ("chat", "document")
        }
        for name, r in comparison["ratios"].items():
            print(
                f"[offline vs server] {name}: server/offline {r['best']:.1%} (best), {r['mean']:.1%} (mean)"
            )
    return section, comparison


def hydragen_line(s: dict[str, Any]) -> str:
    if not s.get("ok"):
        return f"nothing finished ({s.get('error_sample')})"
    return (
        f"{s['time_to_all_s']:.2f} s to all answers, {s['tok_s']:.0f} tok/s, "
        f"prompt tokens computed {s['server']['prompt_tokens_computed']:.0f}, "
        f"KV read saving {s['server']['kv_read_saving_x']:.1f}x, errors {s['errors']}"
    )
