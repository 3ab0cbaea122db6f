"""Is the gate-up projection with SiLU-and-mul in its epilogue faster than cuBLAS plus the SiLU kernel?

Llama-3.1-8B's fused gate-up ([28672, 4096]) at 1 to 8,192 rows: the unfused pair (``F.linear``,
then ``silu_mul.silu_and_mul``; at 64 rows or fewer also the skinny kernel's linear, as the engine
runs it) against the fused kernels over a grid of tiles: the skinny kernel's gated form (rows <= 64)
and ``gate_up.gate_up_tiled`` (the first sweep also had a pointer-load form: 2-15% slower than
TMA at every size, removed). Each is timed as a CUDA graph over enough
weight copies that none stays in L2. Prints per row count the unfused time, the best fused tiles
and the rules' picks; ``--json`` keeps every timing.

PYTHONPATH=. python -m benchmarks.probes.gate_up_gemm --rows 1 16 64 128 256 512 1024 8192 [--tp 2]
(``--tp N``: one tensor-parallel rank's shard, an N-th of the intermediate columns; ``--model 70b``:
Llama-3.1-70B's gate-up, [57344, 8192]). ``--sustained S`` then runs the unfused pair, cuBLAS's product
alone and the ``--top`` fused tiles back to back for S seconds each, two rounds in turn, with the
board's power sampled: at the power cap, where a decode step's products run, a call's time is its
energy, which the burst sweep does not show (docs/kernels.md §4).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.harness.info import git_commit
from benchmarks.harness.timing import cold_weights, graph_ms, measure_ceilings
from prefixserve.model import fused
from prefixserve.model.kernels import gate_up, skinny_matmul
from prefixserve.model.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

INTER, HIDDEN = 14336, 4096
MODELS = {"8b": (INTER, HIDDEN), "70b": (28672, 8192)}  # (intermediate, hidden)


def skinny_configs():
    """(BLOCK_N, STAGES) of the gated skinny kernel (two weight tiles a stage) that fit shared memory."""
    for bn, stages in itertools.product((16, 32, 64), (3, 4, 6, 8)):
        if (2 * bn + 64) * skinny_matmul.BLOCK_K * 2 * stages <= 200 * 1024:
            yield bn, stages


def tiled_configs(m: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps) that fit shared memory (and do not waste rows)."""
    for bm, bn, bk, stages in itertools.product((64, 128), (64, 128), (64, 128), (3, 4, 5)):
        if bm > max(64, m) or (bm + 2 * bn) * bk * 2 * stages > 220 * 1024:
            continue
        for warps in (4, 8) if bm == 128 else (4,):
            yield bm, bn, bk, stages, warps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 128, 256, 512, 1024, 8192])
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--engine-ab", type=int, default=0, help="no sweep: N rounds of engine steps, kernel on/off"
    )
    ap.add_argument("--ab", type=int, default=0, help="no sweep: N alternations of the pair and the rule")
    ap.add_argument("--tp", type=int, default=1, help="sweep one tensor-parallel rank's shard")
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--sustained", type=float, default=0.0, help="also S seconds back to back, with power")
    ap.add_argument("--top", type=int, default=3, help="fused tiles run back to back (--sustained)")
    args = ap.parse_args()
    if args.engine_ab:
        return engine_ab(args.rows, args.engine_ab)
    if args.ab:
        return ab(args.rows, args.ab)
    dev = torch.device("cuda")
    copy_tbps, gemm_tflops = measure_ceilings(dev)
    print(f"copy {copy_tbps:.2f} TB/s, GEMM {gemm_tflops:.0f} TFLOP/s", flush=True)
    inter, hidden = MODELS[args.model]
    n, k = 2 * inter // args.tp, hidden
    sampler = floor_w = None
    if args.sustained:
        from benchmarks import power

        sampler = power.Sampler(gpu=str(torch.cuda.current_device()))
        floor_w = power.spin_floor_w(sampler)
        print(f"spin floor {floor_w} W", flush=True)
    ws = cold_weights(n, k, 1 / 32)
    rows, table = [], []
    for m in args.rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = silu_and_mul_ref(F.linear(x.float(), ws[0].float()))
        scale = float(ref.abs().max())
        floor_ms = max(n * k * 2 / (copy_tbps * 1e9), 2 * m * n * k / (gemm_tflops * 1e9))
        cublas = graph_ms(lambda i, x=x: silu_and_mul(F.linear(x, ws[i])), len(ws))
        engine_unfused = graph_ms(lambda i, x=x: silu_and_mul(fused.linear(x, ws[i])), len(ws))
        best = None
        cands = (
            [("skinny", c) for c in skinny_configs()]
            if m <= skinny_matmul.MAX_ROWS
            else [("tiled", c) for c in tiled_configs(m)]
        )
        for kind, cfg in cands:

            def run(i, x=x, cfg=cfg, kind=kind):
                if kind == "skinny":
                    return skinny_matmul.skinny_gated(x, ws[i], config=cfg)
                return gate_up.gate_up_tiled(x, ws[i], cfg)

            try:
                out = run(0)
                torch.cuda.synchronize()
            except Exception as exc:  # a tile that does not compile or launch
                print(f"  m={m} {kind} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            err = float((out.float() - ref).abs().max()) / scale
            if err > 2e-2:
                print(f"  m={m} {kind} {cfg}: error {err:.2e}")
                continue
            ms = graph_ms(run, len(ws))
            rows.append({"m": m, "kind": kind, "config": list(cfg), "ms": ms})
            if best is None or ms < best[0]:
                best = (ms, kind, cfg)
        pick = gate_up.gate_up_silu(x, ws[0]) is not None
        rule_ms = graph_ms(lambda i, x=x: fused.linear_silu_and_mul(x, ws[i]), len(ws))
        line = {
            "m": m,
            "cublas_pair_ms": cublas,
            "engine_unfused_ms": engine_unfused,
            "rule_ms": rule_ms,
            "rule_fused": pick,
            "best": None if best is None else dict(zip(("ms", "kind", "config"), best, strict=True)),
            "floor_ms": floor_ms,
        }
        if sampler is not None:
            fused_tiles = sorted((r for r in rows if r["m"] == m), key=lambda r: r["ms"])[: args.top]
            line["sustained"] = back_to_back(x, ws, fused_tiles, sampler, args.sustained, floor_w)
        table.append(line)
        b = "-" if best is None else f"{best[0] * 1e3:.1f} us {best[1]} {best[2]}"
        print(
            f"| {m} | cuBLAS+silu {cublas * 1e3:.1f} us | engine unfused {engine_unfused * 1e3:.1f} us | "
            f"best fused {b} | rule {rule_ms * 1e3:.1f} us ({'fused' if pick else 'unfused'}) | "
            f"floor {floor_ms * 1e3:.1f} us |",
            flush=True,
        )
    if sampler is not None:
        sampler.close()
        print("| rows | form | us a call (rounds) | board W | mJ a call above the floor |")
        for line in table:
            for form, runs in line["sustained"].items():
                print(f"| {line['m']} | {form} | {power.rounds_cells(runs)} |")
    if args.json:
        with open(args.json, "w") as f:
            ceilings = {"copy_tbps": copy_tbps, "gemm_tflops": gemm_tflops, "spin_floor_w": floor_w}
            info = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "tp": args.tp}
            info |= {"model": args.model, "sustained_s": args.sustained}
            json.dump({**info, **ceilings, "table": table, "rows": rows}, f, indent=1)


def back_to_back(x, ws, fused_tiles: list[dict], sampler, window_s: float, floor_w: float) -> dict:
    """The unfused pair, cuBLAS's product alone and each fused tile back to back (graphed over the weight
    copies), two rounds in turn: per form, each round's us a call, power and mJ above the floor."""
    from benchmarks import power

    forms = {
        "cuBLAS + SiLU kernel": lambda i: silu_and_mul(F.linear(x, ws[i])),
        "cuBLAS product alone": lambda i: F.linear(x, ws[i]),
    }
    for r in fused_tiles:
        forms[f"{r['kind']} {r['config']}"] = lambda i, c=tuple(r["config"]), kind=r["kind"]: (
            skinny_matmul.skinny_gated(x, ws[i], config=c)
            if kind == "skinny"
            else gate_up.gate_up_tiled(x, ws[i], c)
        )
    return power.forms_in_turn(forms, len(ws), sampler, window_s, floor_w)


def ab(row_counts: list[int], rounds: int) -> None:
    """The unfused pair (cuBLAS, the SiLU kernel) and ``fused.linear_silu_and_mul``'s rule, timed in
    turn ``rounds`` times per row count (a sweep's last timings run on a hotter GPU than its first)."""
    dev = torch.device("cuda")
    n, k = 2 * INTER, HIDDEN
    ws = cold_weights(n, k, 1 / 32)
    for m in row_counts:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        pair, rule = [], []
        for _ in range(rounds):
            with fused.gate_up_kernels(False):
                pair.append(graph_ms(lambda i, x=x: fused.linear_silu_and_mul(x, ws[i]), len(ws)))
            rule.append(graph_ms(lambda i, x=x: fused.linear_silu_and_mul(x, ws[i]), len(ws)))
        p, r = sorted(pair)[rounds // 2], sorted(rule)[rounds // 2]
        rule_of = gate_up.tiled_config if m > skinny_matmul.MAX_ROWS else skinny_matmul.gated_config
        tiles = rule_of(m, INTER)
        print(
            f"| {m} | pair {p * 1e3:.1f} us | rule {r * 1e3:.1f} us {tiles} | pair / rule {p / r:.3f} |",
            flush=True,
        )


def engine_ab(batches: list[int], rounds: int) -> None:
    """Decode steps of the engine (attention="none", as ``benchmarks/dense.py``) with the gate-up kernel
    on and off, a fresh engine each time (graphs capture the switch's choice), in turn ``rounds`` times."""
    from benchmarks.dense import _collect, _engine, engine_decode

    args = argparse.Namespace(model="dummy:llama-3.1-8b", dtype="bfloat16", batches=batches, prefill_tokens=0)
    args.prompt_len, args.gen = 64, 64
    times: dict[tuple[int, bool], list[float]] = {(b, on): [] for b in batches for on in (True, False)}
    for _ in range(rounds):
        for on in (True, False):
            with fused.gate_up_kernels(on):
                llm = _engine(args)
                for b in batches:
                    times[b, on].append(engine_decode(llm, b, args.prompt_len, args.gen)["ms"])
                del llm
                _collect()
    for b in batches:
        on, off = (sorted(times[b, x]) for x in (True, False))
        ratio = off[rounds // 2] / on[rounds // 2]
        print(f"| B={b} | kernel on {on} ms | off {off} ms | off / on (medians) {ratio:.3f} |")


if __name__ == "__main__":
    main()
