"""Power and clocks under the attention benchmark's heavy points: is the board's power cap the limit?

``attention.py``'s roofline T* = max(bytes / copy rate, FLOPs / GEMM rate) takes each ceiling alone. A
copy alone runs at full clock well under the cap; a GEMM alone runs at the cap with its clock pulled
down. A call that needs both at once can draw more than the board may, so the cap sets a third bound.
This script measures, in one run (GPU, prints a table, writes JSON + Markdown + plot):

- sustained ceilings: back-to-back copies, GEMMs and a spin kernel (the clocked-up board doing almost
  nothing), each looped for ``--window`` seconds with ``nvidia-smi`` sampled every 20 ms beside it
  (median SM clock, power, throttle reasons);
- a linear energy model from them: joules per byte moved (copy) and per FLOP (GEMM) above the spin
  kernel's power, and for each point the power-bound time
  T_P = (J/byte x bytes + J/FLOP x FLOPs) / (cap - spin power), with bytes and FLOPs as T* counts them;
- at every grid point the %T* targets count (T* >= 50 us): the shared path's call as attention.py
  times it (do_bench, L2 flushed: "burst") and back to back ("sustained"), each of its launches alone
  back to back, and the clocks, power and throttle reasons of each.

Reading only: the card's clocks and power limit are left as they are.

Usage (GPU): PYTHONPATH=. python -m benchmarks.power run [--out DIR] [--window S]
             python -m benchmarks.power report --json FILE [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.attention import Case
from benchmarks.attention_grid import GRID_B, GRID_P, GRID_S, HKV, HQ, D
from benchmarks.harness import RESULTS, pyplot, run_info, run_or_report, write_text
from benchmarks.harness.timing import PART_OF, bench_ms, graphed, replay_graph

FIELDS = "clocks.sm,power.draw,power.limit,clocks_event_reasons.active,temperature.gpu"
# nvidia-smi's clocks_event_reasons bits (nvmlClocksEventReasons)
REASONS = {
    0x1: "idle",
    0x4: "power cap",
    0x8: "HW slowdown",
    0x20: "SW thermal",
    0x40: "HW thermal",
    0x80: "power brake",
}


class Sampler:
    """nvidia-smi polled every 20 ms in a child process; rows kept with host timestamps (``time.time``).
    ``gpu``: the one board to poll (an index, UUID or PCI bus id as nvidia-smi's ``-i`` takes it)."""

    def __init__(self, gpu: str | None = None) -> None:
        self.rows: list[tuple[float, list[str]]] = []
        which = ["-i", gpu] if gpu is not None else []
        self.proc = subprocess.Popen(
            ["nvidia-smi", *which, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.rows.append((time.time(), [x.strip() for x in line.split(",")]))

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Median SM clock, power and temperature, the lowest clock, and every throttle reason seen."""
        got = [r for t, r in self.rows if t0 <= t <= t1]

        def col(i: int) -> list[float]:
            out = []
            for r in got:
                with contextlib.suppress(ValueError, IndexError):
                    out.append(float(r[i]))
            return sorted(out)

        def med(i: int) -> float | None:
            v = col(i)
            return v[len(v) // 2] if v else None

        bits = 0
        for r in got:
            with contextlib.suppress(ValueError, IndexError):
                bits |= int(r[3], 16)
        return {
            "samples": len(got),
            "sm_mhz": med(0),
            "sm_mhz_min": col(0)[0] if col(0) else None,
            "power_w": med(1),
            "limit_w": med(2),
            "temp_c": med(4),
            "reasons": [name for bit, name in REASONS.items() if bits & bit],
        }

    def close(self) -> None:
        self.proc.terminate()


def sustained(fn: Callable[[], Any], sampler: Sampler, window_s: float) -> dict[str, Any]:
    """fn back to back for window_s seconds after 0.5 s of warm-up: ms per call and the board's state."""
    end = time.time() + 0.5
    while time.time() < end:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < window_s:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    stop.record()
    torch.cuda.synchronize()
    return {"ms": start.elapsed_time(stop) / n, **sampler.window(t0 + 0.1, time.time())}


def back_to_back(
    fn: Callable[[], Any], sampler: Sampler, window_s: float, floor_w: float | None = None, calls: int = 1
) -> dict[str, Any]:
    """``fn`` (``calls`` calls a run) back to back for ``window_s`` seconds: microseconds a call, the
    board's median power and SM clock, whether the cap held it, and (given the spin kernel's
    ``floor_w``) millijoules a call above that floor, which is what a call costs a step that runs
    at the cap."""
    st = sustained(fn, sampler, window_s)
    return call_cost(1e3 * st["ms"] / calls, st, floor_w)


def call_cost(us: float, board: dict[str, Any], floor_w: float | None = None) -> dict[str, Any]:
    """A call's microseconds with its run's board state (``Sampler.window``): power, SM clock, whether
    the cap held it, and (given the spin floor) millijoules a call above that floor."""
    out = {
        "us": us,
        "power_w": board["power_w"],
        "sm_mhz": board["sm_mhz"],
        "power_cap": "power cap" in board["reasons"],
    }
    if floor_w is not None and board["power_w"] is not None:
        out["mj_above_floor"] = (board["power_w"] - floor_w) * us * 1e-3
    return out


def graph_back_to_back(
    fn: Callable[[int], Any], copies: int, sampler: Sampler, window_s: float, floor_w: float | None = None
) -> dict[str, Any]:
    """``back_to_back`` of ``fn(i)`` over ``copies`` weight copies, all in one CUDA graph."""
    return back_to_back(replay_graph(fn, copies).replay, sampler, window_s, floor_w, calls=copies)


def forms_in_turn(
    forms: dict[str, Callable[[int], Any]],
    copies: int,
    sampler: Sampler,
    window_s: float,
    floor_w: float | None = None,
    rounds: int = 2,
) -> dict[str, list[dict[str, Any]]]:
    """Each form ``graph_back_to_back`` in turn, ``rounds`` times over (a board warms between the first
    form and the last): per form, each round's result."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, fn in forms.items():
            runs[name].append(graph_back_to_back(fn, copies, sampler, window_s, floor_w))
    return runs


def rounds_cells(runs: list[dict[str, Any]]) -> str:
    """Table cells of ``forms_in_turn``'s rounds of one form: us a call | board W | mJ above the floor."""
    us = " / ".join(f"{r['us']:.1f}" for r in runs)
    watts = " / ".join(f"{r['power_w']:.0f}" for r in runs)
    mj = " / ".join(f"{r['mj_above_floor']:.2f}" for r in runs)
    return f"{us} | {watts} | {mj}"


def spin(sampler: Sampler, window_s: float) -> dict[str, Any]:
    """One spinning thread back to back: the clocked-up board doing almost nothing (its floor)."""
    return sustained(lambda: torch.cuda._sleep(1_000_000), sampler, window_s)


def spin_floor_w(sampler: Sampler, window_s: float = 1.0) -> float:
    """The board's power with its clocks up and almost nothing switching (``spin``)."""
    return spin(sampler, window_s)["power_w"]


def flushed(fn: Callable[[], Any], sampler: Sampler, window_s: float) -> dict[str, Any]:
    """do_bench's pattern (256 MB L2 flush, then fn, each fn timed by its own events) looped for
    window_s seconds: the median ms per call and the board's state while attention.py's timing runs."""
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    times: list[float] = []
    t0 = time.time()
    while time.time() - t0 < window_s:
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)
        ]
        for a, b in pairs:
            cache.zero_()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in pairs]
    times.sort()
    return {"ms": times[len(times) // 2], **sampler.window(t0 + 0.1, time.time())}


def _read_rate(sampler: Sampler, window_s: float) -> dict[str, Any]:
    """A 2 GiB bf16 tensor summed back to back: TB/s read (how the kernels use HBM: reads)."""
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    res = sustained(lambda: x.sum(dtype=torch.float32), sampler, window_s)
    res["TBps"] = 2 * x.numel() / res["ms"] / 1e9
    return res


def _copy_rate(sampler: Sampler, window_s: float) -> dict[str, Any]:
    """A 2 GiB device copy back to back: TB/s counting read + write, as attention.py measures it."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    res = sustained(lambda: dst.copy_(src), sampler, window_s)
    res["TBps"] = 2 * src.numel() / res["ms"] / 1e9
    res["burst_TBps"] = 2 * src.numel() / bench_ms(lambda: dst.copy_(src), 200) / 1e9
    return res


def _gemm_rate(sampler: Sampler, window_s: float, n: int = 8192) -> dict[str, Any]:
    """An n^3 bf16 matrix product back to back on random data: TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    res = sustained(lambda: a @ b, sampler, window_s)
    res["TFLOPs"] = 2 * n**3 / res["ms"] / 1e9
    res["burst_TFLOPs"] = 2 * n**3 / bench_ms(lambda: a @ b, 300) / 1e9
    return res


def ceilings(sampler: Sampler, window_s: float) -> dict[str, Any]:
    """Copy, GEMM and spin kernel back to back, and the energy model they give."""
    out: dict[str, Any] = {}
    time.sleep(0.5)
    out["idle"] = sampler.window(time.time() - 0.4, time.time())
    out["copy"] = _copy_rate(sampler, window_s)
    out["read"] = _read_rate(sampler, window_s)
    out["gemm"] = _gemm_rate(sampler, window_s)
    # one spinning thread: the clocks stay up, almost nothing switches (the board's floor at speed)
    out["spin"] = spin(sampler, window_s)
    torch.cuda.empty_cache()
    floor, cap = out["spin"]["power_w"], out["gemm"]["limit_w"]
    out["model"] = {
        "floor_w": floor,
        "cap_w": cap,
        "j_per_byte": (out["copy"]["power_w"] - floor) / (out["copy"]["TBps"] * 1e12),
        "j_per_byte_read": (out["read"]["power_w"] - floor) / (out["read"]["TBps"] * 1e12),
        "j_per_flop": (out["gemm"]["power_w"] - floor) / (out["gemm"]["TFLOPs"] * 1e12),
    }
    return out


def counted(b: int, p: int, s: int) -> tuple[int, int]:
    """(bytes, FLOPs) as attention.py's T* counts them: prefix KV once, every suffix KV, q and o."""
    return (p + b * s) * HKV * D * 2 * 2 + 2 * b * HQ * D * 2, 4 * HQ * D * b * (p + s)


def launch_fns(case: Case) -> dict[str, Callable[[], Any]]:
    """Each recorded launch of the shared path at this point, graphed alone (as ``time_launches``)."""
    from prefixserve.attention import triton_backend as tb
    from prefixserve.attention.step_launch import relaunch_layer

    be = tb.TritonBackend()
    be.overlap_min_rows = 0
    meta = dataclasses.replace(case.meta, plan=None, stats={})
    be.prepare(meta)
    be.forward(case.q, case.k_cache, case.v_cache, meta, case.scale)
    lay = next(iter(meta.plan.layouts.values()))
    tensors = (case.q, case.k_cache, case.v_cache, torch.empty_like(case.q))
    fns = {}
    for launch, pos, _ in lay.launches:
        part = PART_OF.get(getattr(launch.kernel, "__name__", "?"), "other")
        fns[part] = graphed(lambda la=launch, po=pos: relaunch_layer(la, po, tensors))
    return fns


def measure_point(b: int, p: int, s: int, sampler: Sampler, window_s: float) -> dict[str, Any]:
    case = Case(b, p, s, torch.device("cuda"))
    call = graphed(case.backend("triton", overlap=True)[0])
    nbytes, flops = counted(b, p, s)
    row: dict[str, Any] = {"B": b, "P": p, "S": s, "bytes": nbytes, "flops": flops}
    time.sleep(0.3)
    row["burst"] = flushed(call, sampler, window_s)
    row["call"] = sustained(call, sampler, window_s)
    row["parts"] = {name: sustained(fn, sampler, window_s) for name, fn in launch_fns(case).items()}
    return row


def run(args: argparse.Namespace) -> None:
    import triton

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sampler = Sampler()
    try:
        ceil = ceilings(sampler, args.window)
        print(json.dumps(ceil), flush=True)
        copy_tbps, gemm_tflops = ceil["copy"]["burst_TBps"], ceil["gemm"]["burst_TFLOPs"]
        rows = []
        for b, p, s in [(b, p, s) for b in GRID_B for p in GRID_P for s in GRID_S]:
            nbytes, flops = counted(b, p, s)
            if max(nbytes / copy_tbps / 1e9, flops / gemm_tflops / 1e9) < 0.05:
                continue  # not a point the %T* targets count
            try:
                rows.append(measure_point(b, p, s, sampler, args.window))
            except Exception as exc:  # keep the rest; the row says what failed
                rows.append({"B": b, "P": p, "S": s, "error": repr(exc)[:300]})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    finally:
        sampler.close()
    info = run_info()
    result = {
        "device": info["device"],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": info["commit"],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "window_s": args.window,
        "ceilings": ceil,
        "rows": rows,
    }
    (out_dir / "power.json").write_text(json.dumps(result, indent=1))
    report(result, out_dir)


def bounds(row: dict[str, Any], ceil: dict[str, Any]) -> dict[str, Any]:
    """T* from the burst ceilings (as attention.py), what 80% (60%) of it needs, the model's energy
    per call and its power-bound time T_P, and the energy the sustained call measured."""
    m = ceil["model"]
    bytes_ms = row["bytes"] / (ceil["copy"]["burst_TBps"] * 1e9)
    flops_ms = row["flops"] / (ceil["gemm"]["burst_TFLOPs"] * 1e9)
    t_star = max(bytes_ms, flops_ms)
    memory = bytes_ms >= flops_ms
    model_mj = (m["j_per_byte_read"] * row["bytes"] + m["j_per_flop"] * row["flops"]) * 1e3
    return {
        "t_star": t_star,
        "need": t_star / (0.8 if memory else 0.6),
        "memory": memory,
        "model_mj": model_mj,
        "power_ms": model_mj / (m["cap_w"] - m["floor_w"]),
        "measured_mj": (row["call"]["power_w"] - m["floor_w"]) * row["call"]["ms"],  # W x ms = mJ
    }


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "—" if x is None else format(x, fmt)


def _why(state: dict[str, Any]) -> str:
    """The throttle reasons seen in a window, or a dash."""
    return ", ".join(state["reasons"]) or "—"


def _state(st: dict[str, Any]) -> str:
    """'ms @ MHz (min), W, reasons' of one window."""
    return f"{st['ms']:.3f} @ {_f(st['sm_mhz'])} ({_f(st['sm_mhz_min'])}), {_f(st['power_w'])} W, {_why(st)}"


def report(result: dict[str, Any], out_dir: Path) -> None:
    """power.md (tables) and power.png (sustained SM clock and power per point) from the JSON."""
    ceil = result["ceilings"]
    m = ceil["model"]
    lines = [
        f"# Power and clocks at the attention benchmark's heavy points ({result['device']})",
        "",
        f"torch {result['torch']}, triton {result['triton']}, commit {result['commit']}, {result['date']}. "
        "Written by `benchmarks/power.py`. Each window runs for "
        f"{result['window_s']} s with nvidia-smi sampled every 20 ms beside it: medians of SM clock and "
        "board power, `(min)` = the lowest SM clock seen, and every throttle reason seen. "
        "`back to back` = graph replays with nothing between (after 0.5 s of warm-up); `as benchmarked` = "
        "attention.py's pattern (256 MB L2 flush before each call, each call timed by its own events: "
        "median ms).",
        "",
        "## Ceilings (back to back, random data)",
        "",
        "| workload | rate | rate, do_bench (attention.py's T*) | SM MHz (min) | W | limit | throttle |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, c, rate, burst in (
        (
            "copy 2 GiB",
            ceil["copy"],
            f"{ceil['copy']['TBps']:.2f} TB/s",
            f"{ceil['copy']['burst_TBps']:.2f} TB/s",
        ),
        ("sum of 2 GiB bf16 (reads)", ceil["read"], f"{ceil['read']['TBps']:.2f} TB/s", "—"),
        (
            "bf16 GEMM 8192^3",
            ceil["gemm"],
            f"{ceil['gemm']['TFLOPs']:.0f} TFLOP/s",
            f"{ceil['gemm']['burst_TFLOPs']:.0f} TFLOP/s",
        ),
        ("spin kernel (1 thread)", ceil["spin"], "—", "—"),
    ):
        lines.append(
            f"| {name} | {rate} | {burst} | {_f(c['sm_mhz'])} ({_f(c['sm_mhz_min'])}) | {_f(c['power_w'])} "
            f"| {_f(c['limit_w'])} | {_why(c)} |"
        )
    lines += [
        "",
        f"Energy model (linear, above the spin kernel's {m['floor_w']:.0f} W, which keeps the clocks up "
        f"with almost nothing switching): {m['j_per_byte_read'] * 1e12:.0f} pJ per byte read "
        f"({m['j_per_byte'] * 1e12:.0f} per byte a copy counts, read + write) and "
        f"{m['j_per_flop'] * 1e12:.2f} pJ per bf16 FLOP at the GEMM's clock. The cap leaves "
        f"{m['cap_w'] - m['floor_w']:.0f} W for both, so a call of `bytes` and `FLOPs` (as T* counts them) "
        "takes at least T_P = (pJ/byte read x bytes + pJ/FLOP x FLOPs) / that, back to back. `model mJ` is "
        "that energy; `measured mJ` = (W - floor) x ms of the back-to-back call. The model is a lead, not "
        "a wall (a FLOP at the GEMM's throttled clock costs less than at full clock; attention moves its "
        "operands differently from a GEMM).",
        "",
        "## The shared path at each point (T* >= 50 us)",
        "",
        "| B | P | S | bound | T* | need | T_P | as benchmarked: ms @ MHz (min), W | back to back "
        "| model mJ | measured mJ | launches alone, back to back |",
        "|" + " ---: |" * 3 + " --- |" + " ---: |" * 3 + " --- | --- |" + " ---: |" * 2 + " --- |",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['B']} | {r['P']} | {r['S']} | error: {r['error'][:80]} |")
            continue
        bd = bounds(r, ceil)
        parts = "; ".join(f"{k}: {_state(v)}" for k, v in r["parts"].items())
        lines.append(
            f"| {r['B']} | {r['P']} | {r['S']} | {'bytes' if bd['memory'] else 'FLOPs'} | {bd['t_star']:.3f} "
            f"| {bd['need']:.3f} | {bd['power_ms']:.3f} | {_state(r['burst'])} | {_state(r['call'])} "
            f"| {bd['model_mj']:.0f} | {bd['measured_mj']:.0f} | {parts} |"
        )
    write_text(out_dir, "power.md", lines)
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if "error" not in r]
    labels = ["copy", "reads", "GEMM"] + [f"{r['B']}/{r['P'] // 1024}K/{r['S']}" for r in rows]
    ceils = [ceil["copy"], ceil["read"], ceil["gemm"]]
    back = ceils + [r["call"] for r in rows]
    bench = ceils + [r["burst"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    x = list(range(len(labels)))
    ax.bar([i - 0.2 for i in x], [st["sm_mhz"] for st in bench], 0.4, label="SM MHz, as benchmarked")
    ax.bar([i + 0.2 for i in x], [st["sm_mhz"] for st in back], 0.4, label="SM MHz, back to back")
    ax2 = ax.twinx()
    ax2.plot(x, [st["power_w"] for st in back], "ko-", label="board W, back to back")
    ax2.axhline(m["cap_w"], color="tab:red", ls="--", lw=1, label="power limit")
    ax.set_xticks(x, labels, rotation=45, fontsize=8)
    ax.set_ylabel("SM clock, MHz (median)")
    ax2.set_ylabel("W (median)")
    ax.set_title("Clocks and power: the ceilings, then the shared path's call at B/P/S")
    ax.set_ylim(0, 2700)  # room for the legend above the bars
    ax2.set_ylim(0, m["cap_w"] * 1.4)
    fig.legend(loc="upper center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, 0.9))
    fig.tight_layout()
    fig.savefig(out_dir / "power.png", dpi=120)


def main() -> None:
    def add_run_args(r: argparse.ArgumentParser) -> None:
        r.add_argument("--window", type=float, default=1.0)

    run_or_report(__doc__, "power", RESULTS, add_run_args, run, report)


if __name__ == "__main__":
    main()
