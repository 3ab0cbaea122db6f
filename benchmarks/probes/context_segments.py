"""Whether a prefill's query rows over its cached context run faster as a one-holder segment on the
shared kernels (``attention/planning/context_segments.py``) than on the paged kernel (or SDPA, for
the long prefills it takes), and from which query rows and context tokens.

One layer's attention call of one sequence (Q query rows behind C cached tokens, the 8B's heads by
default), the step planned each way and timed alone (L2 flushed between calls), the outputs checked
against each other and, where the scores fit, against an fp32 reference. ``--kv-dtype fp8`` stores the
cache in e4m3; ``--scattered`` gives the context blocks in a shuffled order (no TMA).

PYTHONPATH=. python -m benchmarks.probes.context_segments [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

ROWS = (8, 16, 32, 64, 168, 512, 1024, 2048)
CONTEXTS = (512, 1024, 2048, 5120, 16384)
BLOCK = 16


def case(
    q_len: int, context: int, heads: tuple[int, int], kv_dtype: torch.dtype, scattered: bool, seed: int = 0
):
    """(q, k_cache, v_cache, meta) for one sequence of ``q_len`` rows behind ``context`` tokens."""
    from prefixserve.attention.metadata import build_metadata

    hq, hkv = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_len = context + q_len
    n_blocks = -(-seq_len // BLOCK)
    shape = (n_blocks + 1, BLOCK, hkv, 128)
    k = (torch.randn(shape, device="cuda", generator=gen) * 0.5).to(kv_dtype)
    v = torch.randn(shape, device="cuda", generator=gen).to(kv_dtype)
    blocks = torch.arange(1, n_blocks + 1)
    if scattered:
        ctx_blocks = context // BLOCK
        blocks[:ctx_blocks] = blocks[:ctx_blocks][torch.randperm(ctx_blocks)]
    meta = build_metadata(BLOCK, [q_len], [seq_len], [blocks.tolist()], "cuda")
    q = torch.randn(q_len, hq, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, k, v, meta


def every_rule() -> Any:
    """A ``ContextRule`` that takes every prefill behind a whole block, in runs of any length: the
    forced 'on' of the A/B runs (this probe's and ``promptcache_ttft.py --context-segments every``)."""
    from prefixserve.attention.planning.context_segments import ContextRule

    return ContextRule(1, BLOCK, min_work=0, min_run=BLOCK)


def planned(q, k, v, meta, scale: float, context: bool) -> tuple[Any, Any]:
    """A TritonBackend with the step planned one way, and the per-layer call."""
    from prefixserve.attention.planning.step_plan import host_plan
    from prefixserve.attention.triton_backend import TritonBackend

    meta.plan, meta.stats = None, {}
    be = TritonBackend()
    if context:
        be.context_rule = every_rule()
        be.install(meta, be.with_context(host_plan(meta), meta))
    else:
        be.context_rule = None
        be.prepare(meta)
    return be, lambda: be.forward(q, k, v, meta, scale)


def reference(q, k, v, meta, scale: float) -> torch.Tensor | None:
    """fp32 attention of the one sequence (causal from its context on), where the scores fit."""
    q_len, hq = q.shape[:2]
    seq_len = meta.seq_lens_host[0]
    if q_len * hq * seq_len > 400_000_000:
        return None
    table = torch.as_tensor(meta.block_tables_host[0], device="cuda").long()
    kk = k.index_select(0, table).flatten(0, 1)[:seq_len].float()  # [N, Hkv, D]
    vv = v.index_select(0, table).flatten(0, 1)[:seq_len].float()
    group = hq // k.shape[2]
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    s = torch.einsum("qhd,nhd->hqn", q.float(), kk) * scale
    pos = torch.arange(seq_len - q_len, seq_len, device="cuda")[:, None]
    s = s.masked_fill(torch.arange(seq_len, device="cuda")[None, :] > pos, float("-inf"))
    return torch.einsum("hqn,nhd->qhd", torch.softmax(s, -1), vv)


def measure(q_len: int, context: int, heads, kv_dtype, scattered: bool) -> dict[str, Any]:
    from benchmarks.harness.timing import bench_ms, graphed

    q, k, v, meta = case(q_len, context, heads, kv_dtype, scattered)
    scale = 1 / math.sqrt(128)
    row: dict[str, Any] = {"rows": q_len, "context": context}
    outs = {}
    for name, ctx in (("paged", False), ("context", True)):
        t0 = time.perf_counter()
        _, call = planned(q, k, v, meta, scale, ctx)
        row[f"{name}_plan_us"] = (time.perf_counter() - t0) * 1e6
        outs[name] = call()
        row[f"{name}_path"] = (
            "sdpa"
            if meta.plan.dense is not None and meta.plan.shared is None
            else ("segments" if meta.plan.shared is not None else "paged")
        )
        row[f"{name}_us"] = bench_ms(call) * 1e3  # as an eager prefill launches it: host time too
        replay = graphed(call)  # the GPU's time alone
        row[f"{name}_graph_us"] = bench_ms(replay) * 1e3 if replay is not call else None
    flops = 4 * q_len * heads[0] * 128 * (context + (q_len + 1) / 2)
    for name in ("paged", "context"):
        row[f"{name}_tflops"] = flops / (row[f"{name}_graph_us"] or row[f"{name}_us"]) / 1e6
    row["speedup"] = row["paged_us"] / row["context_us"]
    if row["paged_graph_us"] and row["context_graph_us"]:
        row["graph_speedup"] = row["paged_graph_us"] / row["context_graph_us"]
    diff = (outs["context"].float() - outs["paged"].float()).abs().max().item()
    row["max_abs_diff"] = diff
    ref = reference(q, k, v, meta, scale)
    if ref is not None:
        for name in ("paged", "context"):
            row[f"{name}_err"] = (outs[name].float() - ref).abs().max().item()
    return row


def host_cost(args: argparse.Namespace) -> None:
    """Host time of a prefill step's attention as the eager engine launches it: prepare, then one
    forward a layer over ``--layers`` caches in turn, each way; then each way's cProfile, top calls."""
    import cProfile
    import pstats

    for q_len in args.rows:
        for context in args.contexts:
            q, k, v, meta = case(q_len, context, (32, 8), _dtype(args), args.scattered)
            caches = [(k.clone(), v.clone()) for _ in range(args.layers)]
            for ctx in (False, True):
                for rep in range(4):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    prof = cProfile.Profile() if rep == 3 else None
                    if prof:
                        prof.enable()
                    be, _ = planned(q, k, v, meta, 1 / math.sqrt(128), ctx)
                    t1 = time.perf_counter()
                    for kc, vc in caches:
                        be.forward(q, kc, vc, meta, 1 / math.sqrt(128))
                    t2 = time.perf_counter()
                    if prof:
                        prof.disable()
                    torch.cuda.synchronize()
                    t3 = time.perf_counter()
                    print(
                        f"rows {q_len} context {context} {'segments' if ctx else 'paged'} rep {rep}: "
                        f"prepare {(t1 - t0) * 1e3:.3f} ms, layers {(t2 - t1) * 1e6 / len(caches):.1f} us "
                        f"each on the host, {(t3 - t1) * 1e3:.3f} ms to the end"
                    )
                    if prof:
                        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16


def engine_ttft(args: argparse.Namespace) -> list[dict[str, Any]]:
    """First-token times of whole requests on the dummy model: a document of C tokens prefilled once
    (prefix cache), then requests of that document plus R new tokens, the rule off / on alternating
    in one engine (``TritonBackend.context_rule`` switched between requests: None, or ``--rule``'s),
    median of the trials."""
    import random
    import statistics

    from benchmarks.promptcache_workload import ttft
    from prefixserve import LLM
    from prefixserve.attention.triton_backend import TritonBackend

    extra: dict[str, Any] = {"kv_memory_fraction": 0.6, "max_num_batched_tokens": 8192}
    if args.kv_dtype == "fp8":
        extra["kv_cache_dtype"] = "fp8"
    llm = LLM(args.model, device="cuda", progress=False, **extra)
    rng = random.Random(0)
    shipped = TritonBackend.context_rule
    on_rule = shipped if args.rule == "shipped" else every_rule()
    rows = []
    for context in args.contexts:
        doc = [rng.randrange(1000, 30000) for _ in range(context)]
        ttft(llm, {"prompt_token_ids": doc})  # the document's blocks into the prefix cache
        for q_len in args.rows:
            times: dict[str, list[float]] = {"off": [], "on": []}
            for trial in range(args.trials + 1):
                for mode in ("off", "on"):
                    TritonBackend.context_rule = None if mode == "off" else on_rule
                    question = [rng.randrange(1000, 30000) for _ in range(q_len)]
                    took = ttft(llm, {"prompt_token_ids": doc + question}) * 1e3
                    if trial:
                        times[mode].append(took)
            TritonBackend.context_rule = shipped
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            row = {"rows": q_len, "context": context, "off_ms": off, "on_ms": on, "speedup": off / on}
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--heads", default="32/8", help="query / KV heads (head size 128)")
    ap.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--scattered", action="store_true", help="context blocks in a shuffled order")
    ap.add_argument("--out", default=None, help="directory for context_segments.json")
    ap.add_argument(
        "--engine", action="store_true",
        help="first-token times of whole requests (a cached document, then document + R tokens) instead",
    )  # fmt: skip
    ap.add_argument("--model", default="dummy:llama-3.1-8b", help="--engine's model")
    ap.add_argument("--trials", type=int, default=3, help="--engine's timed requests a point and mode")
    ap.add_argument(
        "--rule", choices=("every", "shipped"), default="every",
        help="--engine's 'on': every prefill behind a whole block, or the shipped ContextRule",
    )  # fmt: skip
    ap.add_argument("--host", action="store_true", help="the eager launches' host time a layer instead")
    ap.add_argument("--layers", type=int, default=32, help="--host's layers (caches) a step")
    args = ap.parse_args()
    from benchmarks.harness.info import run_info

    if args.host:
        host_cost(args)
        return

    if args.engine:
        rows = engine_ttft(args)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            payload = {**run_info(), "model": args.model, "kv_dtype": args.kv_dtype, "rule": args.rule}
            payload["rows"] = rows
            name = f"context_segments_engine_{args.kv_dtype}_{args.rule}.json"
            (out / name).write_text(json.dumps(payload, indent=1))
        print(f"\n{'rows':>5} {'context':>7} {'off ms':>8} {'on ms':>8} {'speed-up':>8}")
        for r in rows:
            times = f"{r['off_ms']:>8.2f} {r['on_ms']:>8.2f}"
            print(f"{r['rows']:>5} {r['context']:>7} {times} {r['speedup']:>7.2f}x")
        return

    heads = tuple(int(x) for x in args.heads.split("/"))
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    rows = []
    for q_len in args.rows:
        for context in args.contexts:
            r = measure(q_len, context, heads, kv_dtype, args.scattered)
            rows.append(r)
            shown = {k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()}
            print(json.dumps(shown), flush=True)
    payload = {**run_info(), "heads": args.heads, "kv_dtype": args.kv_dtype, "scattered": args.scattered}
    payload["rows"] = rows
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"context_segments_{args.kv_dtype}{'_scattered' if args.scattered else ''}.json"
        (out / name).write_text(json.dumps(payload, indent=1))
    head = ("rows", "context", "path", "eager us", "speed-up", "graphed us", "speed-up", "TFLOP/s")
    print("\n{:>5} {:>7} {:>6} {:>13} {:>8} {:>13} {:>8} {:>9}".format(*head))
    for r in rows:
        graph = (r["paged_graph_us"] or 0, r["context_graph_us"] or 0, r.get("graph_speedup", 0))
        print(
            f"{r['rows']:>5} {r['context']:>7} {r['paged_path']:>6} "
            f"{r['paged_us']:>6.1f}/{r['context_us']:<6.1f} "
            f"{r['speedup']:>7.2f}x {graph[0]:>6.1f}/{graph[1]:<6.1f} {graph[2]:>7.2f}x "
            f"{r['paged_tflops']:>4.0f}/{r['context_tflops']:<4.0f}"
        )


if __name__ == "__main__":
    main()
