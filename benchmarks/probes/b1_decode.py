"""Probe: our merged paged decode at B=1 (``--batch``: B sequences) over a long context beside FlashInfer's
batch decode, over a bf16 or (``--kv-cache-dtype fp8``) an e4m3 cache, by launch variant (split count,
tile width, warps, pipeline stages, block ids read ahead of their tiles, packed sequences), each
checked against the default launch's output and timed under CUDA graphs with L2 flushed; the variants
run in turn, ``--rounds`` times (runs of one build move by about 1 us at 16K). ``profile`` runs the
default launch and FlashInfer's two decode kernels a few times, eagerly, for Nsight Compute.

    PYTHONPATH=. python -m benchmarks.probes.b1_decode sweep [--fi-dir .fi] [--out DIR]
    ncu --clock-control none -k regex:'paged|Decode|Prefill|Merge' \\
        python -m benchmarks.probes.b1_decode profile

A variant is named by its changes from the default: ``s48`` splits, ``n128`` tile width, ``w8`` warps,
``st3`` stages, ``r128`` registers a thread at most (ptxas), ``k4`` an e4m3 walk cut into 4 walks
(``k1``: one; default: the launcher's rule, ``e4m3_walks.e4m3_walks``), ``a256`` a split's block
ids (up to 256) read before its walk (``paged_attention.launch_paged(pages_ahead=)``, 3 stages unless named;
``a0``: each tile loads its own, as before), ``p4`` four sequences a program (the packed decode
kernel). ``--widening cast``: the whole run with e4m3 tiles widened by Triton's own cast instead of
the kernels' inline PTX; ``--fetch pipeline``: loaded through Triton's software pipeline instead of
into registers a tile ahead; ``--walks 4``: a fetched program's tiles cut into four walks, one a warp.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers_gpu import KV_DTYPES, LAYOUTS
from benchmarks.peers_gpu_batch import build, ours
from benchmarks.probes.ptx_census import choose_fetch, choose_walks, choose_widening

VARIANTS = ["base", "a0", "a256st2", "a256st4", "n128", "a0n128", "s48", "a0s48"]


def parse(name: str) -> dict[str, int]:
    """A variant name's launch changes (``base``: none)."""
    keys = {"s": "splits", "n": "block_n", "w": "warps", "st": "stages", "a": "pages_ahead", "p": "pack"}
    keys |= {"r": "max_registers", "k": "walks"}
    return {keys[k]: int(v) for k, v in re.findall(r"(st|s|n|w|a|p|r|k)(\d+)", name)}


def merged_call(batch: Any, ctx: int, change: dict[str, int]) -> Any:
    """The decode step's paged kernel as ``paged_attention`` launches it (its splits merged in the
    kernel; one split: straight into the output), with ``change`` applied to its launch (``pack``:
    the packed decode kernel, its splits merged by the merge kernel)."""
    from prefixserve.attention.kernels.merge import merge_partials
    from prefixserve.attention.kernels.paged_attention import choose_split, launch_paged, merge_counts

    q, m = batch.q, batch.meta
    kv_heads, pack = batch.heads[1], change.get("pack", 1)
    block_n = change.get("block_n", 64)
    programs = math.ceil(q.shape[0] / pack) * kv_heads
    splits, size = choose_split(ctx, programs, q.device, block_n, kv_dtype=batch.k_cache.dtype)
    if "splits" in change:
        size = math.ceil(math.ceil(ctx / change["splits"]) / block_n) * block_n
        splits = math.ceil(ctx / size)
    o_part = torch.empty(splits, *q.shape, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(splits, *q.shape[:2], dtype=torch.float32, device=q.device)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    counts = merge_counts(q.device, q.shape[0] * kv_heads)
    args = (q, batch.k_cache, batch.v_cache, m.block_tables, m.seq_lens, m.query_start_loc, batch.scale, 1)
    tiles = {
        "num_warps": change.get("warps"), "num_stages": change.get("stages"),
        "pages_ahead": change.get("pages_ahead"), "pack": pack, "max_registers": change.get("max_registers"),
        "walks": change.get("walks"),
    }  # fmt: skip

    def run() -> torch.Tensor:
        if splits == 1:
            launch_paged(*args, 1, size, out, lse, 0, 0, block_n, **tiles)
        elif pack > 1:
            launch_paged(*args, splits, size, o_part[0], lse_part[0], o_part[0].numel(), lse_part[0].numel(),
                         block_n, **tiles)  # fmt: skip
            t = q.shape[0]
            merge_partials(o_part.view(-1, *q.shape[1:]), lse_part.view(-1, q.shape[1]), t, num_parts=splits,
                           part_stride=t, out=out, out_lse=lse)  # fmt: skip
        else:
            launch_paged(*args, splits, size, o_part[0], lse_part[0], o_part[0].numel(), lse_part[0].numel(),
                         block_n, merged=(out, lse, counts), **tiles)  # fmt: skip
        return out

    return run, splits


def kv_dtype(args: argparse.Namespace) -> torch.dtype | None:
    return KV_DTYPES[args.kv_cache_dtype]


def fi_column(fi_dir: str, batch: Any, tensor_cores: bool) -> Any:
    """FlashInfer's batch decode closure (its CUDA-core or tensor-core kernel), or None without it.
    Time each right after it is planned, as peers_gpu.py does: two planned wrappers replayed in turn
    faulted (an illegal address in the first one's replay)."""
    from benchmarks import peers_gpu_fi

    try:
        return peers_gpu_fi.decode(peers_gpu_fi.load(Path(fi_dir)), batch, tensor_cores=tensor_cores)[0]
    except Exception as exc:  # a probe: report and go on with our side
        print(f"flashinfer unavailable: {exc!r}"[:300], flush=True)
        return None


def sweep(args: argparse.Namespace) -> None:
    from benchmarks.harness.timing import bench_ms, graphed
    from prefixserve.attention.kernels.paged_attention import paged_attention

    rows: list[dict[str, Any]] = []
    for layout in args.layouts:
        for ctx in args.contexts:
            batch = build(
                "plain", [args.batch], [ctx], LAYOUTS[layout], "cuda", kv_dtype=KV_DTYPES[args.kv_cache_dtype]
            )
            m = batch.meta
            call = (batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.seq_lens, m.query_start_loc)
            ref = paged_attention(*call, batch.scale, 1, max_seq_len=ctx, pack=1)[0].float()
            fns: dict[str, Any] = {}
            for name in args.variants:
                try:
                    fn, splits = merged_call(batch, ctx, parse(name))
                    err = float((fn().float() - ref).abs().max())
                    fns[name] = (graphed(fn), {"splits": splits, "max_err": err})
                except Exception as exc:
                    rows.append({"layout": layout, "ctx": ctx, "variant": name, "error": repr(exc)[:300]})
            engine = ours(batch, False)[0]  # the engine backend's forward, as peers_gpu.py times it
            fns["engine"] = (graphed(engine), {"max_err": float((engine().float() - ref).abs().max())})
            times: dict[str, list[float]] = {name: [] for name in fns}
            for name, tc in (("fi_decode", False), ("fi_decode_tc", True)):
                fn = fi_column(args.fi_dir, batch, tc)
                if fn is not None:
                    fn()
                    graph = graphed(fn)
                    times[name] = [bench_ms(graph) * 1e3 for _ in range(args.rounds)]
                    torch.cuda.synchronize()
                    del fn, graph
            for _ in range(args.rounds):
                for name, (fn, _info) in fns.items():
                    print(f"timing {layout} {ctx} {name}", flush=True)
                    times[name].append(bench_ms(fn) * 1e3)
                    torch.cuda.synchronize()  # a fault shows under the name that made it
            best_fi = min((statistics.median(times[c]) for c in times if c.startswith("fi_")), default=None)
            for name in times:
                info = fns[name][1] if name in fns else {}
                us = statistics.median(times[name])
                row = {"layout": layout, "ctx": ctx, "variant": name, "us": us, "runs_us": times[name]}
                row |= info
                if best_fi:
                    row["over_fi_best"] = us / best_fi
                rows.append(row)
            del batch, fns
            torch.cuda.empty_cache()
            new = [r for r in rows if r["layout"] == layout and r["ctx"] == ctx]
            settings = {"batch": args.batch, "kv": args.kv_cache_dtype, "widening": args.widening}
            settings["fetch"], settings["walks"] = args.fetch, args.walks
            write(args.out, settings, rows, new)


def write(out_dir: str, settings: dict[str, Any], rows: list[Any], new: list[dict[str, Any]]) -> None:
    """Every row so far to the JSON (with the run's settings), the newest point's rows printed as a
    table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(), **settings, "rows": rows}
    (out / "b1_decode.json").write_text(json.dumps(record))
    print("| layout | ctx | variant | splits | us | runs | / FlashInfer best | max err |")
    print("| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |")
    for r in new:
        if "us" not in r:
            print(f"| {r['layout']} | {r['ctx']} | {r['variant']} | error: {r.get('error')} |")
            continue
        runs = " / ".join(f"{t:.1f}" for t in r["runs_us"])
        ratio = f"{r['over_fi_best']:.3f}" if "over_fi_best" in r else "-"
        head = f"| {r['layout']} | {r['ctx']} | {r['variant']} | {r.get('splits', '-')}"
        print(f"{head} | {r['us']:.1f} | {runs} | {ratio} | {r.get('max_err', 0):.1e} |")


def profile(args: argparse.Namespace) -> None:
    """Each kernel a few times, eagerly, for a profiler wrapped around this process."""
    for layout in args.layouts:
        for ctx in args.contexts:
            batch = build(
                "plain", [args.batch], [ctx], LAYOUTS[layout], "cuda", kv_dtype=KV_DTYPES[args.kv_cache_dtype]
            )
            cols = {
                "ours": merged_call(batch, ctx, {})[0],
                "fi_decode": fi_column(args.fi_dir, batch, False),
                "fi_decode_tc": fi_column(args.fi_dir, batch, True),
            }
            for name, fn in cols.items():
                for _ in range(args.rounds if fn is not None else 0):
                    fn()
                torch.cuda.synchronize()
                print(f"profiled {layout} {ctx} {name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["sweep", "profile"])
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--layouts", nargs="+", default=["8b", "70b"], choices=list(LAYOUTS))
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="sequences of the plain decode point")
    ap.add_argument("--kv-cache-dtype", choices=list(KV_DTYPES), default="auto", help="fp8: an e4m3 cache")
    ap.add_argument("--fi-dir", default=".fi")
    ap.add_argument("--out", default="/tmp/b1_decode")
    ap.add_argument(
        "--widening",
        choices=("opaque", "cast"),
        default="opaque",
        help="e4m3 tiles widened by the kernels' inline PTX (attend.widened_kv) or Triton's own cast",
    )
    ap.add_argument(
        "--fetch",
        choices=("registers", "pipeline"),
        default="registers",
        help="e4m3 tiles loaded into registers a tile ahead (attend.attend_range_fetched) or by the pipeline",
    )
    ap.add_argument(
        "--walks", type=int, default=4, help="the runs attend.E4M3_WALKS cuts a long e4m3 walk into"
    )
    args = ap.parse_args()
    choose_widening(args.widening)
    choose_fetch(args.fetch)
    choose_walks(args.walks)
    (sweep if args.mode == "sweep" else profile)(args)


if __name__ == "__main__":
    main()
