"""Does the fused all-reduce + norm's meeting of the two ranks hold, and what does the call cost?

Two GPUs, one process each (NCCL group, the engine's symmetric product slots: ``PeerAllReduce``).
The fused kernel (``kernels/peer_norm.py``) meets the peer's program of the same index once a call,
by call count: each program counts its calls in local memory and writes the count into the peer's
int64 flag with an exchange whose answer nothing waits for, then reads its own flag until the peer's
count reaches it (acquiring atomics). It won against compare-and-swap flags and against pushing each
product into the peer's memory at every size, which are gone (their variants here last at 5e4f618;
``docs/kernels.md`` §3).

Per shape (and kernel width): 200 graphed calls with fresh products, every output checked (a wrong count is
a broken meeting), then microseconds a call, graphed, alone (64 calls back to back) and after the
row-parallel matmul that feeds it in the engine (o_proj and down_proj shards at TP=2), whose time
alone is subtracted: what the all-reduce + norm adds to a decode layer.

    PYTHONPATH=. python -m benchmarks.probes.peer_signal [--hidden 4096 8192] [--rows 1 64 256] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.harness.timing import ranks_graph_us

EPS = 1e-5
# row-parallel shards at TP=2, K per hidden size: o_proj (heads x dim / 2), down_proj (intermediate / 2)
SHARDS = {4096: {"o": 2048, "down": 7168}, 8192: {"o": 4096, "down": 14336}}
VARIANTS = {"count": {}}  # the engine's meeting (the kernel's only one); {"engine": True}: its call site


class Meeting:
    """The engine's product slots and flags (``PeerAllReduce``), and one fused call of a variant."""

    def __init__(self, peer) -> None:
        self.peer = peer
        self.slots = peer.fused

    def mine(self, slot: int, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        return self.slots.mine(slot, rows, hidden, dtype)

    def engine_sum(self, shape: tuple) -> object:
        """What the engine's norm is given for the product in ``shape``'s slot: the fused path's
        ``PeerSum``, or past the fused kernel's rows (``RANKS_MAX_ROWS``, more than two ranks) the
        product summed by the two-shot all-reduce (copied into its buffer, where the engine's matmul
        writes it)."""
        pending = self.peer.product_slot(*shape)
        if pending is not None:
            return pending
        staged = self.peer.staged(*shape[1:])
        staged.copy_(self.mine(*shape))
        return self.peer.reduce_staged(staged)

    def call(self, variant: dict, slot: int, residual, weight, warps: int | None = None):
        from prefixserve.model import fused
        from prefixserve.model.kernels.peer_norm import peer_add_rms_norm

        shape = (slot, *residual.shape, residual.dtype)
        if variant.get("engine"):  # the engine's call site, as the switches say
            return fused.add_rms_norm(self.engine_sum(shape), weight, EPS, residual)
        if variant.get("ranks"):  # kernels/ranks_norm.py at every size (the engine: a few rows)
            return self.slots.ranks_norm(slot, self.mine(*shape), residual, weight, EPS, num_warps=warps)
        mine, peer = self.slots.views(*shape)
        slots = self.slots
        return peer_add_rms_norm(
            mine,
            peer,
            residual,
            weight,
            EPS,
            slots.counts,
            slots.peer_counts,
            slots.calls,
            num_warps=warps,
            abort=slots.abort,
        )


def wrong_outputs(meet: Meeting, variant: dict, rows: int, hidden: int, dtype: torch.dtype, rank: int) -> int:
    """Graphed calls with fresh products, slots alternating: how many outputs were wrong."""
    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + rows)
    common = torch.Generator(device="cuda").manual_seed(rows)
    base = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(rows, hidden, generator=common, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=common, device="cuda")).to(dtype)
    products = [torch.empty_like(base) for _ in range(dist.get_world_size())]
    dist.all_gather(products, base)
    calls = 200
    scales = torch.arange(1, calls + 1, device="cuda", dtype=torch.float32)
    results = torch.empty(calls, rows, hidden, device="cuda", dtype=dtype)

    def one(i: int) -> None:
        torch.mul(base, scales[i].to(dtype), out=meet.mine(i % 2, rows, hidden, dtype))
        results[i] = meet.call(variant, i % 2, residual, weight)[1]

    for i in range(2):
        one(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            one(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    wrong = 0
    for i in range(calls):
        s = scales[i].to(dtype)
        summed = torch.zeros(rows, hidden, device="cuda")
        for product in products:  # in rank order, as every rank sums
            summed += (product * s).float()
        want = summed.to(dtype) + residual
        wrong += int(not torch.equal(results[i], want))
    return wrong


def _time(meet: Meeting, variant: dict, rows: int, hidden: int, warps: int | None = None) -> dict:
    dtype = torch.bfloat16
    residual = torch.randn(rows, hidden, device="cuda").to(dtype)
    weight = torch.ones(hidden, device="cuda", dtype=dtype)
    for s in (0, 1):
        meet.mine(s, rows, hidden, dtype).normal_()
    out = {"alone_us": ranks_graph_us(lambda i: meet.call(variant, i % 2, residual, weight, warps))}
    for name, k in SHARDS[hidden].items():
        x = torch.randn(rows, k, device="cuda").to(dtype)
        w = (torch.randn(hidden, k, device="cuda") / k**0.5).to(dtype)

        def layer(i: int, x=x, w=w) -> None:
            torch.mm(x, w.t(), out=meet.mine(i % 2, rows, hidden, dtype))
            meet.call(variant, i % 2, residual, weight, warps)

        out[f"{name}_with_us"] = ranks_graph_us(layer, calls=32)
    return out


def _matmul_us(rows: int, hidden: int) -> dict:
    dtype = torch.bfloat16
    out = {}
    for name, k in SHARDS[hidden].items():
        x = torch.randn(rows, k, device="cuda").to(dtype)
        w = torch.randn(hidden, k, device="cuda").to(dtype)
        y = torch.empty(rows, hidden, device="cuda", dtype=dtype)
        timed = lambda i, x=x, w=w, y=y: torch.mm(x, w.t(), out=y)  # noqa: E731
        out[f"{name}_matmul_us"] = ranks_graph_us(timed, calls=32)
    return out


def _worker(
    rank: int, size: int, init: str, queue, hidden_sizes: list[int], rows: list[int], warps: list[int]
) -> None:
    join_group(rank, size, init)
    from prefixserve.model.peer_allreduce import PeerAllReduce

    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "probe-peer-signal")
    meet = Meeting(peer)
    result = []
    for hidden in hidden_sizes:
        for b in rows:
            row: dict = {"hidden": hidden, "rows": b, **_matmul_us(b, hidden)}
            for name, variant in VARIANTS.items():
                wrong = {
                    str(dt).removeprefix("torch."): wrong_outputs(meet, variant, b, hidden, dt, rank)
                    for dt in (torch.float32, torch.bfloat16)
                    if b * hidden * dt.itemsize <= 8 << 20
                }
                row[name] = {"wrong": wrong, **_time(meet, variant, b, hidden)}
            for w in warps:  # the pull kernel's width, counted meeting
                row[f"count w{w}"] = _time(meet, VARIANTS["count"], b, hidden, warps=w)
            result.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    leave_group(queue, rank, result)


def _table(result: list[dict]) -> list[str]:
    names = [k for k in result[0] if isinstance(result[0][k], dict)]
    lines = []
    for shard in ("alone", "o", "down"):
        head = ["hidden", "B", "matmul"] if shard != "alone" else ["hidden", "B"]
        lines.append(f"\n{shard}: us a call" + (" over the matmul alone" if shard != "alone" else ""))
        lines.append("| " + " | ".join(head + names) + " |")
        lines.append("|" + " ---: |" * (len(head) + len(names)))
        for r in result:
            cells = [str(r["hidden"]), str(r["rows"])]
            key = "alone_us" if shard == "alone" else f"{shard}_with_us"
            base = 0.0 if shard == "alone" else r[f"{shard}_matmul_us"]
            if shard != "alone":
                cells.append(f"{base:.1f}")
            cells += [f"{r[n][key] - base:.1f}" for n in names]
            lines.append("| " + " | ".join(cells) + " |")
    wrong = {n: sum(sum(r[n].get("wrong", {}).values()) for r in result) for n in names}
    lines.append(f"\nwrong outputs of graphed calls: {wrong}")
    return lines


def _report(payload: dict, json_path: Path | None) -> None:
    """Print the tables; with ``json_path``, write the result there and the tables beside it (.md)."""
    lines = [f"# Fused all-reduce + norm: how the ranks meet ({payload['device']} x 2)", ""]
    commit = payload.get("commit", "not recorded")
    lines += [f"torch {payload['torch']}, commit {commit}; microseconds, graphed."]
    lines += _table(payload["rows"])
    text = "\n".join(lines) + "\n"
    print(text)
    if json_path:
        json_path.write_text(json.dumps(payload, indent=1))
        json_path.with_suffix(".md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128, 256, 512])
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--json", type=Path, help="write the result here, and its tables beside it (.md)")
    ap.add_argument("--render", type=Path, help="no measuring: this earlier result's tables (.md beside it)")
    args = ap.parse_args()
    if args.render:
        _report(json.loads(args.render.read_text()), args.render)
        return
    result = run_ranks(_worker, (args.hidden, args.rows, args.warps))[0]
    from benchmarks.harness.info import git_commit

    payload = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": git_commit()}
    _report({**payload, "rows": result}, args.json)


if __name__ == "__main__":
    main()
