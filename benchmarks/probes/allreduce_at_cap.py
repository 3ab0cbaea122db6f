"""The fused all-reduce + norm inside a TP=2 layer at the board's power cap, against its other forms.

A 70B TP=2 step runs at the cap (docs/kernels.md §8), where the peer read's time and energy need not be
what they are alone at full clock. Two GPUs, one process each (``PeerAllReduce``'s product slots).
Per hidden size, graphs of 32 calls at 256 rows, each replayed back to back for S seconds on both
ranks (the same count), each rank sampling its own board:

- ``mm``: the down shard's matmul alone (into a plain tensor);
- ``fused wN``: the matmul into the product slot, then the engine's fused all-reduce + norm (the
  count meeting) with N warps a program;
- ``pull``: the matmul, the peer's product copied by the copy engine (``Tensor.copy_``), a local
  norm; no meeting (a lower bound: the peer's product may not be complete);
- ``pull met``: the same after a one-row fused call (the meeting);
- ``fused alone``, ``copy alone``, ``meeting alone``: the parts without the matmul, below the cap.

    PYTHONPATH=. python -m benchmarks.probes.allreduce_at_cap [--hidden 8192 4096] [--json F]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import power
from benchmarks.harness.output import write_or_print
from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.harness.timing import replay_graph
from benchmarks.probes.peer_signal import SHARDS, VARIANTS, Meeting

ROWS = 256
CALLS = 32  # calls a graph


def ranks_back_to_back(graph: Any, sampler: power.Sampler, seconds: float, floor_w: float) -> dict[str, Any]:
    """``graph`` replayed back to back on every rank the same number of times (rank 0 sizes the run:
    a rank that stopped early would leave the other waiting in a meeting): us a call, this rank's
    board, mJ a call above its spin floor."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(10):
        graph.replay()
    stop.record()
    stop.synchronize()
    replays = torch.tensor([max(20, int(seconds / (start.elapsed_time(stop) / 10e3)))], device="cuda")
    dist.broadcast(replays, 0)
    n = int(replays.item())
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.time()
    start.record()
    for _ in range(n):
        graph.replay()
    stop.record()
    stop.synchronize()
    us = start.elapsed_time(stop) * 1e3 / (n * CALLS)
    return power.call_cost(us, sampler.window(t0 + 0.2, time.time()), floor_w)


def _forms(meet: Meeting, hidden: int, warps: list[int]) -> dict[str, Callable[[int], Any]]:
    from prefixserve.model import fused

    dtype = torch.bfloat16
    k = SHARDS[hidden]["down"]
    x = torch.randn(ROWS, k, device="cuda").to(dtype)
    w = (torch.randn(hidden, k, device="cuda") / k**0.5).to(dtype)
    residual = torch.randn(ROWS, hidden, device="cuda").to(dtype)
    weight = torch.ones(hidden, device="cuda", dtype=dtype)
    plain = torch.empty(ROWS, hidden, device="cuda", dtype=dtype)
    pulled = torch.empty_like(plain)
    count = VARIANTS["count"]

    def mm(i: int) -> None:
        torch.mm(x, w.t(), out=meet.mine(i % 2, ROWS, hidden, dtype))

    def pull(i: int) -> None:
        pulled.copy_(meet.slots.views(i % 2, ROWS, hidden, dtype)[1])

    def meeting(i: int) -> None:
        meet.call(count, i % 2, residual[:1], weight)

    forms: dict[str, Callable[[int], Any]] = {"mm": lambda i: torch.mm(x, w.t(), out=plain)}
    for n in warps:
        forms[f"fused w{n}"] = lambda i, n=n: (mm(i), meet.call(count, i % 2, residual, weight, n))
    forms["pull"] = lambda i: (mm(i), pull(i), fused.add_rms_norm(pulled, weight, 1e-5, residual))
    forms["pull met"] = lambda i: (
        mm(i),
        meeting(i),
        pull(i),
        fused.add_rms_norm(pulled, weight, 1e-5, residual),
    )
    forms["fused alone"] = lambda i: meet.call(count, i % 2, residual, weight)
    forms["copy alone"] = pull
    forms["meeting alone"] = meeting
    return forms


def _worker(rank: int, size: int, init: str, queue: Any, args: argparse.Namespace) -> None:
    join_group(rank, size, init)
    from prefixserve.model.peer_allreduce import PeerAllReduce

    meet = Meeting(PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "probe-allreduce-at-cap"))
    sampler = power.Sampler(gpu=str(rank))
    floor_w = power.spin_floor_w(sampler)
    rows = []
    for hidden in args.hidden:
        forms = _forms(meet, hidden, args.warps)
        for rnd in range(args.rounds):
            for name, fn in forms.items():
                dist.barrier()
                graph = replay_graph(fn, CALLS)
                row = ranks_back_to_back(graph, sampler, args.seconds, floor_w)
                rows.append({"hidden": hidden, "round": rnd, "form": name} | row)
                del graph
    sampler.close()
    leave_group(queue, rank, {"rank": rank, "floor_w": floor_w, "rows": rows})


def report(result: dict[str, Any]) -> str:
    lines = [
        f"# The fused all-reduce + norm in a TP=2 layer at the power cap ({result['device']} x 2, "
        f"{result['date']}, commit {result['commit']})",
        "",
        f"{ROWS} rows; graphs of {CALLS} calls back to back {result['settings']['seconds']} s on both ranks; "
        "mJ a call above each board's spin floor ("
        + ", ".join(f"rank {r['rank']} {r['floor_w']:.0f} W" for r in result["ranks"])
        + "). `fused wN`, `pull`, `pull met` include the down shard's matmul (`mm`).",
        "",
        "| hidden | round | form | rank | us a call | board W | SM MHz | mJ above floor |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["ranks"]:
        for row in r["rows"]:
            lines.append(
                f"| {row['hidden']} | {row['round']} | {row['form']} | {r['rank']} | {row['us']:.1f} | "
                f"{row['power_w']:.0f} | {row['sm_mhz']:.0f} | {row['mj_above_floor']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[8192, 4096], choices=sorted(SHARDS))
    ap.add_argument("--warps", type=int, nargs="+", default=[8, 16, 32], help="the fused kernel's widths")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from benchmarks.harness.info import run_info

    result = run_info() | {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    result["ranks"] = run_ranks(_worker, (args,))
    write_or_print(args.json, result, report(result) + "\n")


if __name__ == "__main__":
    main()
