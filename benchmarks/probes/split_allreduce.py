"""Does splitting a row-parallel product in two column halves hide the all-reduce behind the matmul?

Two GPUs, one process each (NCCL group, the engine's product slots: ``PeerAllReduce``). Per hidden
size (4,096: the 8B; 8,192: the 70B), TP=2 shard (o_proj, down_proj) and rows B, microseconds a
layer's product + all-reduce + residual add + RMSNorm, graphed (32 a graph, slots alternating, the
weight L2-cold: copies cycled past 100 MB):

- ``matmul``: the product alone, into the slot;
- ``whole``: the engine's path, the product then ``peer_norm``'s fused kernel (count meeting);
- ``split``: the first half's product, then its sum with the peer's (``split_norm.peer_sum``) on a
  second stream while the second half's product runs, then ``peer_finish_norm``;
- ``split serial``: the same kernels on one stream (what the split costs without the overlap);
- ``split p32``: ``split`` with the first sum on 32 programs (fewer SMs taken from the matmul).

Correctness first: 100 graphed split calls with fresh products (written into the two planes as the
two matmuls would), every output against the sum of the gathered products, the ranks' outputs equal.

    PYTHONPATH=. python -m benchmarks.probes.split_allreduce [--hidden 4096 8192] [--rows 64 256] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.harness.timing import ranks_graph_us
from benchmarks.probes.peer_signal import SHARDS

EPS = 1e-5
L2_COLD_BYTES = 100 << 20


class Split:
    """The engine's product slots viewed as two column planes, and one split or whole call."""

    def __init__(self, peer) -> None:
        self.peer, self.s = peer, peer.fused
        self.side = torch.cuda.Stream()
        self.firsts: dict = {}

    def planes(self, slot: int, rows: int, hidden: int, dtype: torch.dtype):
        mine, theirs = self.s.views(slot, rows, hidden, dtype)
        half = hidden // 2
        return mine.view(2, rows, half), theirs.view(2, rows, half)

    def first(self, slot: int, rows: int, half: int, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, rows, half, dtype)
        if key not in self.firsts:
            self.firsts[key] = torch.empty(rows, half, dtype=dtype, device="cuda")
        return self.firsts[key]

    def run(self, slot, x, w_halves, residual, weight, overlap=True, programs=None, products=None):
        """One split layer: products from ``x @ w_half.T`` (or given [2, T, H] ``products``)."""
        from prefixserve.model.kernels.split_norm import peer_finish_norm, peer_sum

        rows, hidden = residual.shape
        mine, theirs = self.planes(slot, rows, hidden, residual.dtype)
        first = self.first(slot, rows, hidden // 2, residual.dtype)
        meet = (self.s.counts, self.s.peer_counts, self.s.calls, self.s.abort)
        main = torch.cuda.current_stream()
        _write(mine[0], x, w_halves, products, 0)
        if overlap:
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                peer_sum(mine[0], theirs[0], first, *meet, programs=programs)
        else:
            peer_sum(mine[0], theirs[0], first, *meet, programs=programs)
        _write(mine[1], x, w_halves, products, 1)
        if overlap:
            main.wait_stream(self.side)
        return peer_finish_norm(first, mine[1], theirs[1], residual, weight, EPS, *meet)

    def whole(self, slot, x, w, residual, weight):
        from prefixserve.model import fused

        rows, hidden = residual.shape
        pending = self.peer.product_slot(slot, rows, hidden, residual.dtype)
        torch.mm(x, w.t(), out=pending.mine)
        return fused.add_rms_norm(pending, weight, EPS, residual)


def _write(out, x, w_halves, products, part):
    if products is not None:
        out.copy_(products[part])
    else:
        torch.mm(x, w_halves[part].t(), out=out)


def wrong_outputs(split: Split, rows: int, hidden: int, dtype: torch.dtype, rank: int) -> int:
    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + rows)
    common = torch.Generator(device="cuda").manual_seed(rows)
    base = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(rows, hidden, generator=common, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=common, device="cuda")).to(dtype)
    gathered = [torch.empty_like(base) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, base)
    calls = 100
    scales = torch.arange(1, calls + 1, device="cuda", dtype=torch.float32).to(dtype)
    planes = torch.stack(base.split(hidden // 2, 1))  # as the two matmuls would write them
    staged = torch.empty_like(planes)
    results = torch.empty(calls, rows, hidden, device="cuda", dtype=dtype)

    def one(i: int) -> None:
        torch.mul(planes, scales[i], out=staged)
        results[i] = split.run(i % 2, None, None, residual, weight, products=staged)[1]

    for i in range(2):
        one(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            one(i)
    graph.replay()
    torch.cuda.synchronize()
    wrong = 0
    for i in range(calls):
        summed = sum((g * scales[i]).float() for g in gathered)  # rank order, as every rank sums
        wrong += int(not torch.equal(results[i], summed.to(dtype) + residual))
    mine = results[-1].contiguous()
    others = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(others, mine)
    return wrong + int(not all(torch.equal(o, mine) for o in others))


def _time(split: Split, rows: int, hidden: int, k: int) -> dict:
    dtype = torch.bfloat16
    x = torch.randn(rows, k, device="cuda").to(dtype)
    copies = max(1, -(-L2_COLD_BYTES // (hidden * k * 2)))
    ws = [(torch.randn(hidden, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]
    halves = [w.split(hidden // 2) for w in ws]  # the weight's rows: each half contiguous
    residual = torch.randn(rows, hidden, device="cuda").to(dtype)
    weight = torch.ones(hidden, device="cuda", dtype=dtype)
    y = torch.empty(rows, hidden, device="cuda", dtype=dtype)
    out = {
        "matmul": ranks_graph_us(lambda i: torch.mm(x, ws[i % copies].t(), out=y), calls=32),
        "whole": ranks_graph_us(lambda i: split.whole(i % 2, x, ws[i % copies], residual, weight), calls=32),
        "split": ranks_graph_us(
            lambda i: split.run(i % 2, x, halves[i % copies], residual, weight), calls=32
        ),
        "split serial": ranks_graph_us(
            lambda i: split.run(i % 2, x, halves[i % copies], residual, weight, overlap=False), calls=32
        ),
        "split p32": ranks_graph_us(
            lambda i: split.run(i % 2, x, halves[i % copies], residual, weight, programs=32), calls=32
        ),
    }
    return {key: round(us, 2) for key, us in out.items()}


def _worker(rank: int, size: int, init: str, queue, hidden_sizes: list[int], rows: list[int]) -> None:
    join_group(rank, size, init)
    from prefixserve.model.peer_allreduce import PeerAllReduce

    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "probe-split")
    split = Split(peer)
    result = []
    for hidden in hidden_sizes:
        for b in rows:
            wrong = {
                str(dt)[6:]: wrong_outputs(split, b, hidden, dt, rank)
                for dt in (torch.float32, torch.bfloat16)
            }
            for shard, k in SHARDS[hidden].items():
                row = {
                    "hidden": hidden,
                    "rows": b,
                    "shard": shard,
                    "wrong": wrong,
                    **_time(split, b, hidden, k),
                }
                result.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    leave_group(queue, rank, result)


def _report(payload: dict, json_path: Path | None) -> None:
    rows = payload["rows"]
    keys = ["matmul", "whole", "split", "split serial", "split p32"]
    lines = [
        f"# Row-parallel product split in two halves, its first sum overlapped ({payload['device']} x 2)",
        "",
    ]
    lines += [
        f"torch {payload['torch']}, commit {payload.get('commit', 'not recorded')}; us a layer, graphed.",
        "",
    ]
    lines += ["| hidden | B | shard | " + " | ".join(keys) + " | whole / split | wrong |"]
    lines += ["|" + " ---: |" * 3 + " ---: |" * (len(keys) + 2)]
    for r in rows:
        cells = [str(r["hidden"]), str(r["rows"]), r["shard"], *(f"{r[k]:.1f}" for k in keys)]
        cells += [f"{r['whole'] / r['split']:.3f}", str(sum(r["wrong"].values()))]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if json_path:
        json_path.write_text(json.dumps(payload, indent=1))
        json_path.with_suffix(".md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--json", type=Path, help="write the result here, and its table beside it (.md)")
    ap.add_argument("--render", type=Path, help="no measuring: this earlier result's table (.md beside it)")
    args = ap.parse_args()
    if args.render:
        _report(json.loads(args.render.read_text()), args.render)
        return
    result = run_ranks(_worker, (args.hidden, args.rows))[0]
    from benchmarks.harness.info import git_commit

    payload = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": git_commit()}
    _report({**payload, "rows": result}, args.json)


if __name__ == "__main__":
    main()
