"""How much faster than ``torch.mm`` cuBLASLt's other candidates run a decode step's products.

For each projection of the 8B at TP=1 and TP=2 and the 70B at TP=2 (weights ``[N, K]``, ``x @ W.T``)
at a few row counts: ``torch.mm`` (cuBLAS's one pick), then every candidate of cuBLASLt's heuristic
list (``benchmarks/harness/blaslt.py``), each graphed over 8 copies of the weight so L2 holds none of it
(``benchmarks/harness/timing.graph_ms``), each candidate's product checked against ``torch.mm``'s.
Prints the best candidate per shape and what it is (tile id, split K, stages, cluster). ``--deep N``
also screens up to N of the configurations cuBLASLt accepts beyond its list (``blaslt.variants``:
tile x custom option x cluster shape x split K) and times the fastest few the same way.
``--sustained S`` also runs ``torch.mm``, the K-sliced form (``fused.split_k_matmul``, 2 and 4 slices)
and the fastest candidates back to back for S seconds with the board's power (``benchmarks.power``):
decode steps run at the power cap, where a call's time back to back is its energy, not its time in
a short burst.

PYTHONPATH=. python -m benchmarks.probes.lt_candidates --json out/lt_candidates.json
PYTHONPATH=. python -m benchmarks.probes.lt_candidates --rows 256 --deep 2000 --json out/lt_deep.json
PYTHONPATH=. python -m benchmarks.probes.lt_candidates --rows 256 --models 8b_tp1 8b_tp2 --sustained 1
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from benchmarks.harness import blaslt
from benchmarks.harness.info import git_commit
from benchmarks.harness.timing import graph_ms
from prefixserve.model.fused import split_k_matmul

# model -> projection -> (N, K), the shard a rank holds
SHAPES = {
    "8b_tp1": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "8b_tp2": {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)},
    "70b_tp2": {"qkv": (5120, 8192), "o": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)},
}


def copies_for(n: int, k: int) -> int:
    """Enough weight copies that L2 (50 MB) is cold when a copy comes round again, at least 2."""
    return max(2, min(8, -(-96 * 2**20 // (n * k * 2))))


def _timed(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    out: torch.Tensor,
    reference: torch.Tensor,
    algo: blaslt.Algo,
    reps: int = 10,
) -> dict:
    """One candidate graphed over the weight copies: microseconds a call, its largest difference from
    ``torch.mm``'s product, and what it is."""
    blaslt.matmul_into(x, weights[0], out, algo)
    err = float((out.float() - reference).abs().max())
    us = graph_ms(lambda i: blaslt.matmul_into(x, weights[i], out, algo), len(weights), reps) * 1e3
    return {"us": us, "max_abs_err": err, **blaslt.describe(algo)}


def _best(entries: list[dict]) -> dict | None:
    """The fastest entry whose product matched ``torch.mm``'s."""
    ok = [c for c in entries if "us" in c and c["max_abs_err"] < 0.05]
    return min(ok, key=lambda c: c["us"]) if ok else None


def deep(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    out: torch.Tensor,
    reference: torch.Tensor,
    seeds: list[blaslt.Algo],
    cap: int,
    finalists: int = 6,
) -> dict:
    """Screen every configuration ``blaslt.variants`` accepts (at most ``cap``, sampled; one replay a
    timing), then time the fastest few as the heuristic's candidates were timed."""
    every = blaslt.variants(blaslt.Problem.of(x, weights[0], out), x.device, seeds)
    pool = random.Random(0).sample(every, min(cap, len(every)))
    screened = []
    for algo in pool:
        try:
            screened.append((_timed(x, weights, out, reference, algo, reps=1)["us"], algo))
        except Exception:  # a configuration that fails to run is left out of the ranking
            continue
    screened.sort(key=lambda t: t[0])
    timed = [_timed(x, weights, out, reference, algo) for _, algo in screened[:finalists]]
    return {"variants": len(every), "screened": len(screened), "finalists": timed, "best": _best(timed)}


def measure(rows: int, n: int, k: int, limit: int, cap: int = 0, sustained: dict | None = None) -> dict:
    """``torch.mm`` and cuBLASLt's candidates at one shape (see the module docstring); ``sustained``
    (``{"sampler": power.Sampler, "window": s, "top": n}``) adds the back-to-back runs."""
    device = torch.device("cuda")
    copies = copies_for(n, k)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    reference = torch.mm(x, weights[0].t()).float()
    mm_us = graph_ms(lambda i: torch.mm(x, weights[i].t(), out=out), copies) * 1e3
    seeds = blaslt.candidates(blaslt.Problem.of(x, weights[0], out), device, limit)
    found = []
    for rank, algo in enumerate(seeds):
        try:
            found.append({"rank": rank, **_timed(x, weights, out, reference, algo)})
        except Exception as exc:  # a candidate that fails is reported, not fatal
            found.append({"rank": rank, "error": repr(exc)[:200]})
    result = {"mm_us": mm_us, "copies": copies, "candidates": found, "best": _best(found)}
    if cap:
        result["deep"] = deep(x, weights, out, reference, seeds, cap)
    if sustained:
        forms = {"torch.mm": lambda i: torch.mm(x, weights[i].t(), out=out)}
        for splits in (2, 4):
            forms[f"split_k {splits}"] = lambda i, s=splits: split_k_matmul(x, weights[i], s)
        ok = sorted((c for c in found if "us" in c and c["max_abs_err"] < 0.05), key=lambda c: c["us"])
        for c in ok[: sustained["top"]]:
            algo = seeds[c["rank"]]
            forms[f"lt rank {c['rank']} tile {c['tile']} split {c['split_k']}"] = lambda i, a=algo: (
                blaslt.matmul_into(x, weights[i], out, a)
            )
        from benchmarks import power

        result["sustained"] = [
            {"form": name, **power.graph_back_to_back(fn, copies, sustained["sampler"], sustained["window"])}
            for name, fn in forms.items()
        ]
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--deep", type=int, default=0, help="screen up to this many configurations a shape")
    ap.add_argument("--sustained", type=float, default=0.0, help="also S seconds back to back, with power")
    ap.add_argument("--top", type=int, default=8, help="candidates run back to back (--sustained)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sustained = None
    if args.sustained:
        from benchmarks import power

        sampler = power.Sampler(gpu=str(torch.cuda.current_device()))
        sustained = {"sampler": sampler, "window": args.sustained, "top": args.top}
    results = []
    lines = []
    for model in args.models:
        for layer, (n, k) in SHAPES[model].items():
            for rows in args.rows:
                r = {
                    "model": model,
                    "layer": layer,
                    "rows": rows,
                    "N": n,
                    "K": k,
                    **measure(rows, n, k, args.limit, args.deep, sustained),
                }
                results.append(r)
                best = r["best"]
                flops = 2 * rows * n * k
                line = (
                    f"{model:8s} {layer:8s} {rows:4d}x{n:6d}x{k:6d}: mm {r['mm_us']:7.1f} us "
                    f"({flops / r['mm_us'] / 1e6:4.0f} TF/s)"
                )
                if best:
                    cfg = {
                        key: best[key] for key in ("algo_id", "tile", "split_k", "stages", "cluster", "rank")
                    }
                    line += f", best Lt {best['us']:7.1f} us ({r['mm_us'] / best['us']:.3f}x) {cfg}"
                line += (
                    f", Lt[0] {r['candidates'][0].get('us', float('nan')):7.1f}" if r["candidates"] else ""
                )
                searched = r.get("deep")
                if searched and searched["best"]:
                    d = searched["best"]
                    cfg = {key: d[key] for key in ("tile", "custom", "cluster", "split_k")}
                    line += (
                        f", deep ({searched['screened']} of {searched['variants']}) {d['us']:7.1f} us "
                        f"({r['mm_us'] / d['us']:.3f}x) {cfg}"
                    )
                print(line, flush=True)
                lines.append(line)
                runs = r.get("sustained", [])
                for e in runs:
                    base = runs[0]["us"]  # torch.mm's
                    row = (
                        f"    back to back {e['form']:34s} {e['us']:7.1f} us {base / e['us']:.3f}x "
                        f"{e['power_w'] or 0:4.0f} W {e['sm_mhz'] or 0:5.0f} MHz"
                        + (" power cap" if e["power_cap"] else "")
                    )
                    print(row, flush=True)
                    lines.append(row)
    if sustained:
        sustained["sampler"].close()
    if args.json:
        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "results": results}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
