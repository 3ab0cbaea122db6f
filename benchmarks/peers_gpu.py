"""Our decode attention against FlashInfer's on one GPU, at the same shapes, pages, dtype and KV (issue 104).

One process, one GPU, bf16, page size 16, the Llama-3.1-8B heads (32 q, 8 KV, d=128) and the 70B ones
(64 q, 8 KV, d=128). Points (``peers_gpu_batch.py`` builds them; the KV and queries are shared by
both sides):
  plain   B in {1, 16, 64, 256, 1024} x context {1K, 4K, 16K}: our paged decode ("triton_paged")
          vs FlashInfer's batch decode over a paged cache (CUDA-core and tensor-core kernels)
  shared  P in {1K, 4K, 16K} shared + own parts of 64-512 tokens, B in {64, 256, 1024}: our
          shared-segment path ("triton") vs FlashInfer's two-level cascade and its batch decode
  tree    32 prompts x 8 samples (system prompt, prompt, own 64-512): ours vs its 3-level cascade
Each point first checks that every FlashInfer output agrees with ours within bf16 tolerance (a column
that disagrees is not timed), then times each under CUDA graphs (FlashInfer's wrappers made for graphs,
planned outside the timing, as a server would) with L2 flushed. Reported: ms, achieved TB/s over the
minimal bytes (KV read once: a shared part once, every own part; q read, o written), our time /
theirs, and the memory roofline (those bytes over a device-to-device copy measured in the same run).
Targets: ours <= 1.0x the cascade's time at every shared and tree point; <= 1/0.95 of the batch
decode's (its faster kernel) at every plain point.

  PYTHONPATH=. python benchmarks/peers_gpu.py run [--quick] [--fi-dir .fi] [--out DIR]   # on a GPU
  PYTHONPATH=. python benchmarks/peers_gpu.py run --smoke --out /tmp/peers   # CPU: our side, tiny
  python benchmarks/peers_gpu.py report --json docs/benchmarks/peers_gpu.json
The slim FlashInfer in ``.fi/`` comes from ``benchmarks/peers_gpu_wheel.py build``.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, pyplot, run_info, run_or_report, write_text
from benchmarks.harness.output import cell, write_json
from benchmarks.peers_gpu_batch import Batch, agree, build, levels_reference, ours, reference

NAME = "peers_gpu"
LAYOUTS = {"8b": (32, 8, 128), "70b": (64, 8, 128)}
OWN = (64, 512)
PLAIN = [(b, c) for c in (1024, 4096, 16384) for b in (1, 16, 64, 256, 1024)]
SHARED = [(b, p) for p in (1024, 4096, 16384) for b in (64, 256, 1024)]
TREE = [(2048, 512), (4096, 2048)]  # (system prompt, each prompt's own part), 32 prompts x 8 samples
QUICK = {"plain": [(64, 4096), (1024, 16384)], "shared": [(256, 4096), (1024, 16384)], "tree": TREE[:1]}
SMOKE_HEADS = (4, 2, 64)
PLAIN_TARGET, CASCADE_TARGET = 1 / 0.95, 1.0  # the most our time may be, over theirs
TARGET_COLUMNS = {  # kind -> (ours, what the target compares it with)
    "plain": ("ours_paged", "fi_decode_best"),
    "shared": ("ours_shared", "fi_cascade"),
    "tree": ("ours_shared", "fi_cascade"),
}


def points(
    quick: bool,
    smoke: bool,
    layouts: list[str],
    kinds: list[str] | None = None,
    batches: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Every point's (kind, layout, fanouts, lengths): the full grid, the quick one or the CPU smoke's;
    ``kinds`` / ``batches``: only those kinds / batch sizes (the last fanout) of it."""
    if smoke:
        return [
            {"kind": "plain", "layout": "smoke", "fanouts": [3], "lengths": [40]},
            {"kind": "shared", "layout": "smoke", "fanouts": [1, 4], "lengths": [32, (5, 20)]},
            {"kind": "tree", "layout": "smoke", "fanouts": [1, 2, 2], "lengths": [32, 16, (3, 9)]},
        ]
    grid = QUICK if quick else {"plain": PLAIN, "shared": SHARED, "tree": TREE}
    out = []
    for lay in layouts:
        out += [
            {"kind": "shared", "layout": lay, "fanouts": [1, b], "lengths": [p, OWN]}
            for b, p in grid["shared"]
        ]
        out += [
            {"kind": "tree", "layout": lay, "fanouts": [1, 32, 8], "lengths": [r, p, OWN]}
            for r, p in grid["tree"]
        ]
        out += [{"kind": "plain", "layout": lay, "fanouts": [b], "lengths": [c]} for b, c in grid["plain"]]
    kept = [p for p in out if kinds is None or p["kind"] in kinds]
    return [p for p in kept if batches is None or p["fanouts"][-1] in batches]


KV_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}  # vLLM's --kv-cache-dtype names


def make_batch(pt: dict[str, Any], device: torch.device, kv_cache_dtype: str = "auto") -> Batch:
    heads = SMOKE_HEADS if pt["layout"] == "smoke" else LAYOUTS[pt["layout"]]
    return build(pt["kind"], pt["fanouts"], pt["lengths"], heads, device, kv_dtype=KV_DTYPES[kv_cache_dtype])


def result_name(kv_cache_dtype: str) -> str:
    """The results' file stem: ``peers_gpu``, or ``peers_gpu_fp8`` over an FP8 cache."""
    return NAME if kv_cache_dtype == "auto" else f"{NAME}_{kv_cache_dtype}"


class Columns:
    """Each column's closure builders; a FlashInfer column that has never worked and fails is skipped at
    every later point (a JIT build that failed once would fail, slowly, again)."""

    def __init__(self, fi: Any, fi_error: str | None) -> None:
        self.fi, self.broken, self.worked = fi, {}, set()
        if fi is None:
            self.broken = {
                c: f"flashinfer unavailable: {fi_error}" for c in ("fi_decode", "fi_decode_tc", "fi_cascade")
            }

    def builders(self, batch: Batch) -> dict[str, Callable[[], tuple[Any, float]]]:
        from benchmarks import peers_gpu_fi as fi_side

        fi = self.fi
        cols: dict[str, Callable[[], tuple[Any, float]]] = {"ours_paged": lambda: ours(batch, False)}
        if len(batch.levels) > 1:
            cols["ours_shared"] = lambda: ours(batch, True)
            cols["fi_cascade"] = lambda: fi_side.cascade(fi, batch)
        cols["fi_decode"] = lambda: fi_side.decode(fi, batch, tensor_cores=False)
        cols["fi_decode_tc"] = lambda: fi_side.decode(fi, batch, tensor_cores=True)
        return cols


def measure(
    pt: dict[str, Any],
    cols: Columns,
    device: torch.device,
    copy_tbps: float | None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """One point: build, check agreement, time (on a GPU), per-column errors recorded, not raised."""
    from benchmarks.harness.timing import bench_ms, graphed

    t0 = time.perf_counter()
    batch = make_batch(pt, device, kv_cache_dtype)
    row: dict[str, Any] = {**batch.info, "layout": pt["layout"], "bytes": batch.min_bytes(), "errors": {}}
    fns: dict[str, Any] = {}
    for col, make in cols.builders(batch).items():
        if col in cols.broken:
            row["errors"][col] = f"skipped: {cols.broken[col]}"
            continue
        try:
            fn, row[f"{col}_plan_ms"] = make()
            fns[col] = (fn, fn())  # its output, for the agreement check
            cols.worked.add(col)
        except Exception as exc:
            row["errors"][col] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
            if col not in cols.worked:
                cols.broken[col] = row["errors"][col][:300]
    mine = "ours_shared" if "ours_shared" in fns else "ours_paged"
    if mine not in fns:
        raise RuntimeError(f"our kernels failed: {row['errors'].get(mine)}")
    base = fns[mine][1]
    if device.type == "cpu":  # no FlashInfer: ours and the cascade's page lists against fp32 references
        ref = reference(batch)
        row["agree"] = {c: agree(out, ref)[1] for c, (_, out) in fns.items()}
        row["agree"]["levels_reference"] = agree(levels_reference(batch), ref)[1]
    else:
        row["agree"] = {c: agree(out, base)[1] for c, (_, out) in fns.items() if c != mine}
    for col in list(fns):
        ok = row["agree"].get(col, 0.0) <= 1e-2
        if not ok:
            row["errors"][col] = f"outputs disagree: relative error {row['agree'][col]:.3g} > 1e-2"
            del fns[col]
        elif device.type == "cuda":
            try:
                replay = graphed(fns[col][0])
                row[f"{col}_graphed"] = replay is not fns[col][0]  # False: capture failed, timed eager
                row[f"{col}_ms"] = bench_ms(replay)
            except Exception as exc:
                row["errors"][col] = f"timing: {type(exc).__name__}: {exc}"[:2000]
    _derive(row, copy_tbps)
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def _derive(row: dict[str, Any], copy_tbps: float | None) -> None:
    """Best decode kernel, achieved TB/s, our time / theirs, the roofline and whether the target holds."""
    decodes = [row[c] for c in ("fi_decode_ms", "fi_decode_tc_ms") if row.get(c)]
    row["fi_decode_best_ms"] = min(decodes) if decodes else None
    for col in ("ours_shared", "ours_paged", "fi_cascade", "fi_decode", "fi_decode_tc", "fi_decode_best"):
        if row.get(f"{col}_ms"):
            row[f"{col}_TBps"] = row["bytes"] / (row[f"{col}_ms"] * 1e-3) / 1e12
    if copy_tbps:
        row["roofline_ms"] = row["bytes"] / (copy_tbps * 1e12) * 1e3
    mine, theirs = TARGET_COLUMNS[row["kind"]]
    a, b = row.get(f"{mine}_ms"), row.get(f"{theirs}_ms")
    row["ours_over_theirs"] = a / b if a and b else None
    if row["kind"] != "plain" and a and row.get("fi_decode_best_ms"):
        row["ours_over_fi_decode"] = a / row["fi_decode_best_ms"]
    limit = PLAIN_TARGET if row["kind"] == "plain" else CASCADE_TARGET
    row["target_met"] = None if row["ours_over_theirs"] is None else row["ours_over_theirs"] <= limit


def run(args: argparse.Namespace) -> None:
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # our kernels on the CPU (triton not yet imported)
    device = torch.device("cpu" if args.smoke else "cuda")
    out = Path(args.out)
    fi, fi_error = None, "not loaded (--smoke)" if args.smoke else None
    if not args.smoke:
        try:
            from benchmarks import peers_gpu_fi

            fi = peers_gpu_fi.load(Path(args.fi_dir))
        except Exception as exc:
            fi_error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
            print("flashinfer failed to load:", fi_error, flush=True)
    copy_tbps = None
    if device.type == "cuda":
        from benchmarks.harness.timing import measure_ceilings

        copy_tbps = measure_ceilings(device)[0]
    result: dict[str, Any] = {
        **run_info(("flashinfer-python", "triton")),
        "flashinfer": getattr(fi, "__version__", None),
        "flashinfer_error": fi_error,
        "copy_TBps": copy_tbps,
        "settings": {
            "quick": args.quick,
            "smoke": args.smoke,
            "layouts": args.layouts,
            "kinds": args.kinds,
            "batches": args.batches,
            "page_size": 16,
            "kv_cache_dtype": args.kv_cache_dtype,
            "name": result_name(args.kv_cache_dtype),
        },
        "complete": False,
        "rows": [],
    }
    cols = Columns(fi, fi_error)
    start = time.perf_counter()
    for pt in points(args.quick, args.smoke, args.layouts, args.kinds, args.batches):
        where = {"kind": pt["kind"], "layout": pt["layout"], "fanouts": pt["fanouts"]}
        if time.perf_counter() - start > args.budget_s:
            result["rows"].append({**where, "error": f"skipped: past the {args.budget_s} s budget"})
            continue
        try:
            row = measure(pt, cols, device, copy_tbps, args.kv_cache_dtype)
        except Exception as exc:  # keep the rest of the grid; the row says what failed
            traceback.print_exc()
            row = {**where, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        result["rows"].append(row)
        print(_line(row), flush=True)
        write_json(out / f"{result_name(args.kv_cache_dtype)}.json", result)  # a cut-short run keeps it
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["complete"] = True
    result["wall_s"] = round(time.perf_counter() - start, 1)
    write_json(out / f"{result_name(args.kv_cache_dtype)}.json", result)
    report(result, out)


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['kind']} {row['layout']} {row['fanouts']}: {row['error']}"
    ratio = row.get("ours_over_theirs")
    agree_s = ", ".join(f"{k} {v:.1e}" for k, v in row.get("agree", {}).items())
    return (
        f"{row['kind']} {row['layout']} B={row['B']} {row['lengths']}: ours/theirs "
        f"{cell(ratio, '.3f')}; agreement {agree_s}; errors {list(row['errors'])} ({row['wall_s']} s)"
    )


def report(result: dict[str, Any], out: Path) -> None:
    """The Markdown table (one row a point) and a plot of our time / theirs."""
    settings = result.get("settings", {})
    kv, name = settings.get("kv_cache_dtype", "auto"), settings.get("name", NAME)
    kv_text = "bf16 queries, an FP8 (e4m3) KV cache" if kv == "fp8" else "bf16"
    lines = [
        "# prefixserve vs FlashInfer: decode attention, one GPU" + (", FP8 KV cache" if kv == "fp8" else ""),
        "",
        f"{result['device']}; torch {result['torch']}; triton {result.get('triton')}; flashinfer "
        f"{result.get('flashinfer')}; commit {result['commit']}; {result['date']}; {kv_text}, page size 16; "
        f"copy rate {cell(result.get('copy_TBps'), '.2f')} TB/s. Written by `benchmarks/peers_gpu.py`"
        + ("" if result.get("complete") else " (incomplete run)")
        + ".",
        "",
    ]
    if result.get("flashinfer_error"):
        lines += [f"FlashInfer did not load: `{result['flashinfer_error'].splitlines()[0]}`", ""]
    lines += [
        "ours / theirs is our time over FlashInfer's cascade (shared, tree) or its faster batch decode "
        "(plain); target <= 1.0 (cascade), <= 1.053 (plain). TB/s over the minimal bytes.",
        "",
        "| kind | heads | B | lengths | ours ms | cascade ms | decode ms | decode tc ms | roofline ms "
        "| ours TB/s | ours / theirs | ours / decode | target | max err | errors |",
        "| --- | --- | ---: | --- |" + " ---: |" * 8 + " --- | ---: | --- |",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['kind']} | {r['layout']} | | {r['fanouts']} | | | | | | | | | | | {r['error'][:80]} |"
            )
            continue
        mine = TARGET_COLUMNS[r["kind"]][0]
        errs = "; ".join(f"{k}: {v[:60]}" for k, v in r["errors"].items())
        worst = max(r["agree"].values(), default=None)
        met = {True: "yes", False: "NO", None: "-"}[r.get("target_met")]
        lines.append(
            f"| {r['kind']} | {r['layout']} | {r['B']} | {' + '.join(r['lengths'])} "
            f"| {cell(r.get(f'{mine}_ms'), '.4f')} "
            f"| {cell(r.get('fi_cascade_ms'), '.4f')} | {cell(r.get('fi_decode_ms'), '.4f')} "
            f"| {cell(r.get('fi_decode_tc_ms'), '.4f')} | {cell(r.get('roofline_ms'), '.4f')} "
            f"| {cell(r.get(f'{mine}_TBps'), '.2f')} | {cell(r.get('ours_over_theirs'), '.3f')} "
            f"| {cell(r.get('ours_over_fi_decode'), '.3f')} | {met} | {cell(worst, '.1e')} | {errs} |"
        )
    write_text(out, f"{name}.md", lines)
    _plot(result, out, name)


def _plot(result: dict[str, Any], out: Path, name: str) -> None:
    rows = [r for r in result["rows"] if r.get("ours_over_theirs")]
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(rows)), 3.4))
    colors = {"plain": "tab:blue", "shared": "tab:orange", "tree": "tab:green"}
    ax.bar(range(len(rows)), [r["ours_over_theirs"] for r in rows], color=[colors[r["kind"]] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(PLAIN_TARGET, color="tab:blue", lw=0.8, ls="--")
    labels = [f"{r['kind'][0]} {r['layout']} B{r['B']} {'+'.join(r['lengths'])[:12]}" for r in rows]
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("our time / FlashInfer's")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--quick", action="store_true", help="a reduced grid")
    r.add_argument("--smoke", action="store_true", help="CPU: our side only, tiny points, fp32 references")
    r.add_argument("--fi-dir", default=".fi", help="the slim FlashInfer from peers_gpu_wheel.py build")
    r.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    r.add_argument("--kinds", nargs="+", choices=list(TARGET_COLUMNS), help="only these kinds of point")
    r.add_argument("--batches", nargs="+", type=int, help="only points of these batch sizes (last fanout)")
    r.add_argument("--budget-s", type=float, default=420.0, help="start no point after this many seconds")
    r.add_argument(
        "--kv-cache-dtype", choices=list(KV_DTYPES), default="auto",
        help="fp8: both sides over an e4m3 KV cache (results in peers_gpu_fp8.*)",
    )  # fmt: skip


if __name__ == "__main__":
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)
