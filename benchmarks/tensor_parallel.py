"""Tensor parallelism on several GPUs of one host: decode throughput with a shared prefix, per rank count.

Three parts, each adding its rows to ``docs/benchmarks/tensor_parallel.{json,md}`` (a run too long for
one call goes in parts):
  grid      the 70B-shaped dummy model at TP=N: B x P, sharing on, off and the no-attention ceiling
            (``benchmarks/throughput.py``'s measurement: decode tokens/s, first token to last finish);
  compare   the 8B-shaped model at TP=1 and TP=N, the same workload (sharing on);
  allreduce NCCL all-reduces of one decode step (two per layer, [B, hidden] bf16), captured in a CUDA
            graph as the engine's are, timed bare; their share of the measured step (B / tok/s).

    python -m benchmarks.throughput --tensor-parallel-size 2 --parts grid compare allreduce

Each part keeps the device, commit and date of the run that wrote it (``runs``): parts run on different
calls or machines say so in the table. ``--merge FILE`` takes the named parts from another result file
(with its runs) instead of measuring them, e.g. a grid run elsewhere into this file; parts measured on
another kind of machine are refused (``tensor_parallel_files.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.decode_run import MODES, measure, shared_prompts
from benchmarks.harness import RESULTS, run_info, write_results
from benchmarks.harness.models import model_config
from benchmarks.harness.output import cell, pyplot, ratio_cell
from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.tensor_parallel_files import RUN_KEYS, merge_parts, runs_of, stamp_cells
from benchmarks.tensor_parallel_power import compare_power_lines, grid_power_lines, start_boards

NAME = "tensor_parallel"


def _graph_us(fn, reps: int = 20, calls: int = 64) -> float:
    """Mean microseconds of one ``fn()`` call, ``calls`` of them captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / calls * 1e3


def _symm_variants(b: int, hidden: int, group: str, want: torch.Tensor, x: torch.Tensor) -> dict:
    """PyTorch's symmetric-memory all-reduces over NVLink peer memory (one-shot: every rank reads
    every peer's buffer; two-shot: reduce-scatter then all-gather), checked against NCCL's sum of
    the same inputs, timed graphed. An error is recorded, not raised: the op set is alpha."""
    import torch.distributed._symmetric_memory as symm_mem

    out: dict = {}
    try:
        buf = symm_mem.empty(b, hidden, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group)
        buf.copy_(x)
        got = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)
        out["one_shot_max_err"] = float((got.float() - want.float()).abs().max())
        out["one_shot_us"] = _graph_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group))
        buf.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
        out["two_shot_max_err"] = float((buf.float() - want.float()).abs().max())
        out["two_shot_us"] = _graph_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _allreduce_worker(
    rank: int, size: int, init: str, queue, hidden: int, layers: int, batches: list[int], symm: bool = False
) -> None:
    """One rank: per B, a graph of ``2 * layers`` in-place NCCL all-reduces of [B, hidden] bf16,
    replayed; with ``symm`` also PyTorch's symmetric-memory one-shot and two-shot all-reduces."""
    import torch.distributed as dist

    join_group(rank, size, init)
    group = dist.group.WORLD.group_name
    peer = None
    if symm:  # the engine's own path: copy in, two-shot over peer memory, copy out
        from prefixserve.model.peer_allreduce import PeerAllReduce

        peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "bench-peer")
    result = {}
    for b in batches:
        x = torch.zeros(b, hidden, dtype=torch.bfloat16, device="cuda")  # zeros: sums stay finite
        one_us = _graph_us(lambda x=x: dist.all_reduce(x), calls=2 * layers)
        nbytes = b * hidden * 2
        result[b] = {
            "step_allreduce_ms": one_us * 2 * layers / 1e3,
            "one_allreduce_us": one_us,
            "bus_GBps": 2 * (size - 1) / size * nbytes / (one_us * 1e-6) / 1e9,
            "bytes": nbytes,
        }
        if symm:
            gen = torch.Generator(device="cuda").manual_seed(rank + 7 * b)
            data = torch.randn(b, hidden, generator=gen, device="cuda").to(torch.bfloat16)
            want = data.clone()
            dist.all_reduce(want)
            result[b]["symm"] = _symm_variants(b, hidden, group, want, data)
        if peer is not None and peer.fits(x):
            engine_us = _graph_us(lambda x=x: peer(x), calls=2 * layers)
            result[b].update(engine_peer_us=engine_us, engine_peer_step_ms=engine_us * 2 * layers / 1e3)
    leave_group(queue, rank, result)


def allreduce(size: int, hidden: int, layers: int, batches: list[int], symm: bool = False) -> dict[int, dict]:
    return run_ranks(_allreduce_worker, (hidden, layers, batches, symm), size=size, timeout=300)[0]


def _measure(
    model: str, device: str, attention: str, prompts, gen: int, tp: int, peer: bool, out=None
) -> dict:
    """``measure`` of one engine; with ``out`` (a queue) its result also goes there."""
    r = measure(model, device, attention, prompts, gen, tp=tp, peer_allreduce=peer)
    if out is not None:
        out.put(r)
    return r


def _measure_elsewhere(run: tuple, env: dict[str, str]) -> dict:
    """``_measure(*run)`` in a new process with ``env`` set (its tensor-parallel workers inherit it)."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child copies the environment at start
    try:
        proc = ctx.Process(target=_measure, args=(*run, queue))
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    result = queue.get(timeout=600)
    proc.join(120)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--parts", nargs="+", default=["grid", "compare", "allreduce"])
    ap.add_argument("--model", default="dummy:llama-3.1-70b", help="the grid's model")
    ap.add_argument("--compare-model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--compare-prefix", type=int, default=1024)
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=list(MODES),
        help="the grid's modes (one a process: only a process's first tensor-parallel engine "
        "gets the peer all-reduce)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--max-batched-tokens",
        type=int,
        default=16384,
        help="the grid's step token budget (a 70B shard leaves about 12 GiB a GPU: a smaller "
        "budget keeps more of it for the KV pool)",
    )
    ap.add_argument(
        "--symm",
        action="store_true",
        help="allreduce part: also PyTorch's symmetric-memory one-shot and two-shot all-reduces",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="compare part: TP=1 and TP=N (the default path) run this many times in turn, each in a "
        "process of its own; a cell is the median run (runs on one machine differ by 1-2%%)",
    )
    ap.add_argument(
        "--power",
        action="store_true",
        help="grid and compare parts: each board's power, SM clock and throttle reasons over each timed "
        "decode (nvidia-smi every 20 ms); for the grid, benchmarks.power's ceilings on the first GPU too",
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="where tensor_parallel.{json,md} go")
    ap.add_argument("--merge", type=Path, help="take --parts from this result file instead of measuring")
    args = ap.parse_args(argv)
    tp = args.tensor_parallel_size
    path = args.out / f"{NAME}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    payload = {**run_info(), "tensor_parallel_size": tp, "gpus": torch.cuda.device_count()}
    payload.update({k: old.get(k, []) for k in ("grid", "compare")})
    payload["allreduce"] = old.get("allreduce", {})
    payload["power"] = old.get("power", {})  # the grid's last --power run: its ceilings
    payload["runs"] = runs_of(old)
    stamp_cells(payload)
    payload.update(model=args.model, compare_model=args.compare_model, own=args.own, gen=args.gen)
    if args.merge:
        other = json.loads(args.merge.read_text())
        merge_parts(payload, other, args.parts, args.batches, args.prefixes, args.modes, args.merge)
        kept = (*RUN_KEYS, "cpu_count", "python", "model", "own", "gen")
        payload.update({k: other[k] for k in kept if k in other})
        write_results(NAME, payload, markdown(payload), args.out)
        plot(payload, args.out / f"{NAME}.png")
        return
    modes = {
        k: (v if args.device == "cuda" else ("reference" if v == "triton_paged" else v))
        for k, v in MODES.items()
    }

    def save() -> None:
        for part in args.parts:  # this run's parts: written by this run
            if payload.get(part):
                payload["runs"][part] = {k: payload[k] for k in RUN_KEYS}
        write_results(NAME, payload, markdown(payload), args.out)
        plot(payload, args.out / f"{NAME}.png")

    if "allreduce" in args.parts:
        cfg = model_config(args.model)
        result = allreduce(tp, cfg["hidden_size"], cfg["num_hidden_layers"], args.batches, args.symm)
        payload["allreduce"] = {str(b): v for b, v in result.items()}
        print(payload["allreduce"], flush=True)
        save()
    measured = {"grid", "compare"} & set(args.parts)
    boards = start_boards(payload, grid="grid" in measured) if args.power and measured else None
    if "compare" in args.parts:
        p = args.compare_prefix
        for b in args.batches:
            prompts = (shared_prompts(b, p, args.own), shared_prompts(b, p, args.own, seed=1))
            row = {"B": b, "P": p, "commit": payload["commit"]}
            # TP=1; TP=N with every all-reduce through NCCL; TP=N as configured by default (decode-sized
            # all-reduces over peer memory): one run, one machine
            # (key, ranks, peer all-reduce, environment of a process of its own)
            runs: list[tuple[str, int, bool, dict[str, str]]] = [
                ("tp1", 1, False, {}),
                (f"tp{tp}", tp, True, {}),
                (f"tp{tp}_nccl", tp, False, {}),
            ]
            results: dict[str, list[dict]] = {}
            for rep in range(max(1, args.repeats)):
                for key, size, peer, env in runs if rep == 0 else runs[:2]:  # repeats: TP=1 and TP=N
                    run = (args.compare_model, args.device, "auto", prompts, args.gen, size, peer)
                    # each run in a process of its own: only a process's first tensor-parallel engine gets
                    # the peer all-reduce (a second B in one process ran on NCCL); workers inherit ``env``
                    r = _measure_elsewhere(run, env)
                    if boards is not None:  # the run's decode on the boards (one monotonic clock per host)
                        r["boards"] = boards.during(*r["decode_window"])
                    results.setdefault(key, []).append(r)
            for key, rs in results.items():
                r = sorted(rs, key=lambda x: x["tok_s"])[len(rs) // 2]  # the median run (upper, if even)
                row[f"{key}_tok_s"] = r["tok_s"]
                if len(rs) > 1:
                    row[f"{key}_tok_s_runs"] = [x["tok_s"] for x in rs]
                # rank 0's GPU idle between decode steps: a host-bound step shows here
                row[f"{key}_host_overhead_frac"] = r["host_overhead_frac"]
                if "boards" in r:
                    row[f"{key}_boards"] = r["boards"]
            print(row, flush=True)
            payload["compare"] = [x for x in payload["compare"] if x["B"] != b] + [row]
            payload["compare"].sort(key=lambda x: x["B"])
            save()
    if "grid" in args.parts:
        for b in args.batches:
            for p in args.prefixes:
                prompts = (shared_prompts(b, p, args.own), shared_prompts(b, p, args.own, seed=1))
                row = next((x for x in payload["grid"] if (x["B"], x["P"]) == (b, p)), {})
                row.update({"B": b, "P": p, "tp": tp, "max_batched_tokens": args.max_batched_tokens})
                for mode, attention in ((m, modes[m]) for m in args.modes):
                    try:
                        r = measure(
                            args.model,
                            args.device,
                            attention,
                            prompts,
                            args.gen,
                            tp=tp,
                            max_batched=args.max_batched_tokens,
                        )
                    except Exception as exc:  # e.g. a point that does not fit: recorded, the rest go on
                        row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                        print(row, flush=True)
                        continue
                    row[f"{mode}_tok_s"], row[f"{mode}_prefill_s"] = r["tok_s"], r["prefill_s"]
                    row[f"{mode}_commit"] = payload["commit"]
                    row[f"{mode}_memory_needed_gb"] = r.get("memory_needed_gb")
                    # a pool too small for B runs the batch in waves: preemptions show it
                    row[f"{mode}_preemptions"], row["kv_blocks_total"] = (
                        r["preemptions"],
                        r["kv_blocks_total"],
                    )
                    row[f"{mode}_kv_blocks_used_peak"] = r["kv_blocks_used_peak"]
                    if boards is not None:
                        row[f"{mode}_boards"] = boards.during(*r["decode_window"])
                    if mode == "auto":
                        row["host_overhead_frac"] = r["host_overhead_frac"]
                        row["graphs_captured"] = r["graphs_captured"]
                print(row, flush=True)
                payload["grid"] = [x for x in payload["grid"] if (x["B"], x["P"]) != (b, p)] + [row]
                payload["grid"].sort(key=lambda x: (x["B"], x["P"]))
                save()
    if boards is not None:
        boards.close()
    save()


AB_RUNS = (("two_shot", "two-shot"), ("swap", "swap"))  # compare's optional runs: key suffix, label


def _run_line(payload: dict, part: str) -> list[str]:
    run = payload.get("runs", {}).get(part)
    if not run:
        return []
    if part in ("grid", "compare"):  # cells or rows of several runs: each names its commit
        latest = f"latest run {run['date']}"
        return ["", f"Measured on {run['device']} x {run['gpus']}, torch {run['torch']}, {latest}."]
    return [
        "",
        f"Measured on {run['device']} x {run['gpus']}, torch {run['torch']}, commit {run['commit']}, "
        f"{run['date']}.",
    ]


def markdown(payload: dict) -> str:
    tp = payload["tensor_parallel_size"]
    md = [
        "# Tensor parallelism",
        "",
        f"Decode-only tokens/s (first token to last finish), {payload['own']} own prompt "
        f"tokens and {payload['gen']} generated per request, B requests sharing one P-token prefix; "
        "NCCL, NVLink multicast off, decode steps under CUDA graphs (all-reduces captured). "
        "Written by `benchmarks/tensor_parallel.py`.",
        "",
    ]
    if payload["grid"] or payload["allreduce"]:  # a compare-only file (e.g. an MoE model) has neither
        md += [f"## {payload['model']} at TP={tp}", *_run_line(payload, "grid"), ""]
    if payload["grid"]:
        md += [
            "| B | P | sharing on tok/s | sharing off tok/s | ceiling tok/s | on/off | on/ceiling | step ms "
            "| all-reduce ms / step | all-reduce share | step tokens | preempted on / off / ceiling "
            "| commit on / off / ceiling |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    elif payload["allreduce"]:
        md.append("No grid run here yet; the all-reduces of its decode steps:")
    for r in payload["grid"]:
        # a pool short of the batch recomputes requests (preemptions): such a row is not clean
        preempted = " / ".join(cell(r.get(f"{m}_preemptions")) for m in ("auto", "sharing_off", "ceiling"))
        commits = " / ".join(r.get(f"{m}_commit", "-") for m in ("auto", "sharing_off", "ceiling"))
        on, off, ceil = (r.get(f"{m}_tok_s") for m in ("auto", "sharing_off", "ceiling"))
        step = r["B"] / on * 1e3 if on else None
        measured = payload["allreduce"].get(str(r["B"]), {})
        # the all-reduce the engine runs: peer memory where measured (the default), else NCCL
        ar = measured.get("engine_peer_step_ms", measured.get("step_allreduce_ms"))
        md.append(
            f"| {r['B']} | {r['P']} | {cell(on)} | {cell(off)} | {cell(ceil)} | {ratio_cell(on, off, 'x')} | "
            f"{ratio_cell(on, ceil, '%')} | {cell(step, '.1f')} | {cell(ar, '.2f')} | "
            f"{ratio_cell(ar, step, '%')} | {cell(r.get('max_batched_tokens'))} | {preempted} | {commits} |"
        )
    md += grid_power_lines(payload)
    if payload["allreduce"]:
        md += [
            "",
            "All-reduce: the step's 2 x layers all-reduces of [B, hidden] bf16 in one CUDA graph, timed "
            "bare (20 replays); share = that / the step (B / sharing-on tok/s), through the engine's "
            "peer-memory path (copy in, two-shot, copy out) where `--symm` measured it, else NCCL. Per call: "
            + ", ".join(
                f"B={b}: NCCL {v['one_allreduce_us']:.1f} us ({v['bus_GBps']:.0f} GB/s bus)"
                + (f", engine peer {v['engine_peer_us']:.1f} us" if "engine_peer_us" in v else "")
                for b, v in payload["allreduce"].items()
            ),
        ]
        md += _symm_lines(payload["allreduce"])
    if payload["compare"]:
        md += [
            "",
            f"## {payload['compare_model']}: TP=1 vs TP={tp} (sharing on)",
            *_run_line(payload, "compare"),
            "",
            *_routing_lines(payload),
            f"TP={tp} NCCL: every all-reduce through NCCL (`--no-tp-peer-allreduce`); TP={tp}: the default, "
            "decode-sized all-reduces over NVLink peer memory (those before a norm fused with it: at TP=2 "
            "`kernels/peer_norm.py`, past two ranks up to 32 rows `kernels/ranks_norm.py`, in runs from "
            "4c31f73 on); two-shot: the same with the fused call off (PyTorch's "
            "two-shot all-reduce, then the norm), and swap: the fused kernel's ranks meeting by "
            "compare-and-swap flags, in runs before 5e4f618 that had them (both A/B switches are gone). "
            "GPU idle: rank 0's GPU between decode steps, "
            "as a fraction of the decode time.",
            "",
        ]
        variants = [(f"tp{tp}_nccl", "NCCL")] + [
            (f"tp{tp}_{k}", label)
            for k, label in AB_RUNS
            if any(f"tp{tp}_{k}_tok_s" in r for r in payload["compare"])
        ]
        variants.append((f"tp{tp}", f"TP={tp}"))
        head = ["B", "P", "TP=1 tok/s"] + [f"{label} tok/s" for _, label in variants]
        head += [f"{label} / TP=1" for _, label in variants]
        head.append("GPU idle TP=1 / " + " / ".join(label for _, label in variants))
        head.append("commit")
        md += ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
        for r in payload["compare"]:
            one = r.get("tp1_tok_s", 0)
            cells = [str(r["B"]), str(r["P"]), f"{one:.0f}"]
            cells += [cell(r.get(f"{k}_tok_s")) for k, _ in variants]
            cells += [ratio_cell(r.get(f"{k}_tok_s"), one, "x") for k, _ in variants]
            idle = [r.get(f"{k}_host_overhead_frac") for k in ("tp1", *(k for k, _ in variants))]
            cells.append(" / ".join("-" if x is None else f"{x:.1%}" for x in idle))
            cells.append(r.get("commit", "-"))
            md.append("| " + " | ".join(cells) + " |")
        md += compare_power_lines(payload, [("tp1", "TP=1"), *variants])
        md += _repeat_lines(payload["compare"], tp)
    return "\n".join(md) + "\n"


def _routing_lines(payload: dict) -> list[str]:
    """For an MoE model: how its dummy routers chose experts (``model/dummy_routing.py``)."""
    try:
        cfg = model_config(payload["compare_model"])
    except (FileNotFoundError, ValueError):  # a model this machine does not have: nothing to say
        return []
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
        return []
    how = payload.get("dummy_routing", "weights")
    return [f"Dummy MoE routing: {how} (a dummy model's routers, `model/dummy_routing.py`).", ""]


def _repeat_lines(compare: list[dict], tp: int) -> list[str]:
    """The runs behind ``--repeats`` rows: each run's tok/s in order, and each pair's ratio."""
    rows = [r for r in compare if "tp1_tok_s_runs" in r and f"tp{tp}_tok_s_runs" in r]
    if not rows:
        return []
    md = [
        "",
        f"Repeated rows (`--repeats`): TP=1 and TP={tp} ran in turn, each run in a process of its own; the "
        "table's cells are the median runs (GPU idle and boards are theirs). Each run, tok/s in order, and "
        f"TP={tp} / TP=1 of the runs made one after the other:",
        "",
        f"| B | P | TP=1 runs | TP={tp} runs | TP={tp} / TP=1 by pair | median ratio |",
        "| ---: | ---: | --- | --- | --- | ---: |",
    ]
    for r in rows:
        one, many = r["tp1_tok_s_runs"], r[f"tp{tp}_tok_s_runs"]
        pairs = " / ".join(f"{m / o:.3f}" for o, m in zip(one, many, strict=False))
        md.append(
            f"| {r['B']} | {r['P']} | {' / '.join(f'{x:.0f}' for x in one)} | "
            f"{' / '.join(f'{x:.0f}' for x in many)} | {pairs} | "
            f"{ratio_cell(r.get(f'tp{tp}_tok_s'), r.get('tp1_tok_s'), 'x')} |"
        )
    return md


def plot(payload: dict, path: Path) -> None:
    """Bars of decode tok/s: the compare model at TP=1 and TP=N (NCCL alone, as configured) per B,
    and the grid model's sharing on / off / ceiling per (B, P), each panel titled with its run."""
    plt = pyplot()
    parts = [p for p in ("compare", "grid") if payload.get(p)]
    if plt is None or not parts:
        return
    tp = payload["tensor_parallel_size"]
    series = {
        "compare": [("tp1", "TP=1"), (f"tp{tp}_nccl", f"TP={tp} NCCL"), (f"tp{tp}", f"TP={tp}")],
        "grid": [("auto", "sharing on"), ("sharing_off", "sharing off"), ("ceiling", "no attention")],
    }
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.2), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        rows = payload[part]
        labels = [f"B={r['B']}" + (f"\nP={r['P']}" if part == "grid" else "") for r in rows]
        width = 0.8 / len(series[part])
        for j, (key, label) in enumerate(series[part]):
            values = [r.get(f"{key}_tok_s") or 0 for r in rows]
            ax.bar([i + j * width for i in range(len(rows))], values, width, label=label)
        ax.set_xticks([i + width * (len(series[part]) - 1) / 2 for i in range(len(rows))], labels)
        ax.set_ylabel("decode tokens/s")
        run = payload.get("runs", {}).get(part, {})
        model = payload["compare_model" if part == "compare" else "model"]
        ax.set_title(f"{model} ({run.get('device', '?')} x {run.get('gpus', '?')}, {run.get('commit', '?')})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _symm_lines(allreduce: dict) -> list[str]:
    """NCCL beside PyTorch's symmetric-memory all-reduces, per B (``--symm``)."""
    rows = {b: v["symm"] for b, v in allreduce.items() if "symm" in v}
    if not rows:
        return []
    md = [
        "",
        "One all-reduce of [B, hidden] bf16, graphed (64 calls a graph), microseconds; max error against "
        "NCCL's sum of the same random inputs:",
        "",
        "| B | MB | NCCL us | symm one-shot us | symm two-shot us | one-shot max err | two-shot max err |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b, v in rows.items():
        if "error" in v:
            md.append(f"| {b} | | {allreduce[b]['one_allreduce_us']:.1f} | {v['error']} | | | |")
            continue
        mb = allreduce[b].get("bytes", 0) / 1e6
        md.append(
            f"| {b} | {mb:.2f} | {allreduce[b]['one_allreduce_us']:.1f} | {v['one_shot_us']:.1f} "
            f"| {v['two_shot_us']:.1f} | {v['one_shot_max_err']:.3g} | {v['two_shot_max_err']:.3g} |"
        )
    return md


if __name__ == "__main__":
    main()
