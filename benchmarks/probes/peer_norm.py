"""Is the fused all-reduce + residual add + RMSNorm right, and faster than two-shot then the norm?

N GPUs (``--ranks``, default 2), one process each (NCCL group, peer memory as the engine sets it up:
``PeerAllReduce``). Per hidden size and rows B:

- correctness: every rank's product summed with the residual and normalised by the engine's fused
  call (``kernels/peer_norm.py`` at two ranks, ``kernels/ranks_norm.py`` past two) against the torch
  reference of the gathered products; the ranks' outputs compared bit for bit; then 200 calls in one
  CUDA graph alternating the product slots, each call's product fresh (a scale of a base written into
  the slot just before), every output checked afterwards (a missed barrier shows as a stale or
  half-written product);
- timing (bf16): per call, graphed (64 calls a graph, alternating slots): the fused kernel as the
  engine calls it; past two ``ranks_norm``
  forced at every size (one-shot; checked the same way); the engine's unfused path
  (PyTorch's two-shot all-reduce in peer memory, then ``add_rms_norm``); ``add_rms_norm`` alone (the
  floor a fused kernel cannot beat); a two-shot all-reduce's bytes into a rank (2 (N - 1) / N
  products) at 450 GB/s (NVLink 4 one way) for scale.

    PYTHONPATH=. python -m benchmarks.probes.peer_norm [--ranks 4] [--hidden 4096] [--rows 1 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import run_info
from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.harness.timing import ranks_graph_us
from benchmarks.probes.peer_signal import Meeting, wrong_outputs

NVLINK_GBPS = 450.0
EPS = 1e-5


def _check(peer, rows: int, hidden: int, dtype: torch.dtype, rank: int) -> dict:
    from prefixserve.model import fused
    from prefixserve.model.kernels.ranks_norm import ranks_add_rms_norm_ref

    size = dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + rows)
    common = torch.Generator(device="cuda").manual_seed(rows)
    mine = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(rows, hidden, generator=common, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=common, device="cuda")).to(dtype)
    meet = Meeting(peer)
    meet.mine(0, rows, hidden, dtype).copy_(mine)
    out, summed = fused.add_rms_norm(meet.engine_sum((0, rows, hidden, dtype)), weight, EPS, residual)
    products = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(products, mine)
    ref, ref_summed = ranks_add_rms_norm_ref(products, residual, weight, EPS)
    err = max(
        float((out.float() - ref.float()).abs().max()),
        float((summed.float() - ref_summed.float()).abs().max()),
    )
    outs = [torch.empty_like(out) for _ in range(size)]
    dist.all_gather(outs, out)
    ranks_equal = all(torch.equal(outs[0], o) for o in outs[1:])

    # 200 graphed calls through the engine's call site, slots alternating, each product fresh; past
    # the fused rows the engine's sum is PyTorch's two-shot, which adds in the model dtype: not checked
    # against the fp32 sum bit for bit
    fused_path = peer.product_slot(0, rows, hidden, dtype) is not None
    wrong = wrong_outputs(meet, {"engine": True}, rows, hidden, dtype, rank) if fused_path else None
    return {"max_err": err, "ranks_bitwise_equal": ranks_equal, "graphed_calls_wrong": wrong}


def _time(peer, rows: int, hidden: int, full: bool = True) -> dict:
    from prefixserve.model import fused

    dtype = torch.bfloat16
    residual = torch.randn(rows, hidden, device="cuda").to(dtype)
    weight = torch.ones(hidden, device="cuda", dtype=dtype)
    meet = Meeting(peer)
    for s in (0, 1):
        meet.mine(s, rows, hidden, dtype).normal_()
    staged = peer.staged(rows, hidden, dtype)
    staged.normal_()
    local = torch.randn(rows, hidden, device="cuda").to(dtype)
    out: dict = {"bytes": rows * hidden * 2}
    slots = [peer.product_slot(s, rows, hidden, dtype) for s in (0, 1)]
    if slots[0] is not None:  # the engine's fused call
        out["fused_us"] = ranks_graph_us(lambda i: fused.add_rms_norm(slots[i % 2], weight, EPS, residual))
    if not full:
        return out
    if peer.fits(staged):
        out["two_shot_norm_us"] = ranks_graph_us(
            lambda i: fused.add_rms_norm(peer.reduce_staged(staged), weight, EPS, residual)
        )
        out.setdefault("fused_us", out["two_shot_norm_us"])  # past the fused rows: the engine's path
        out["two_shot_us"] = ranks_graph_us(lambda i: peer.reduce_staged(staged))
    out["norm_alone_us"] = ranks_graph_us(lambda i: fused.add_rms_norm(local, weight, EPS, residual))
    size = dist.get_world_size()  # a two-shot all-reduce's bytes into each rank: 2 (N - 1) / N products
    out["nvlink_bound_us"] = 2 * (size - 1) / size * out["bytes"] / (NVLINK_GBPS * 1e3)
    if size > 2:  # kernels/ranks_norm.py at every size (the engine takes it up to RANKS_MAX_ROWS)
        out["one_shot_us"] = ranks_graph_us(lambda i: meet.call({"ranks": True}, i % 2, residual, weight))
    return out


def _worker(rank: int, size: int, init: str, queue, hidden_sizes: list[int], rows: list[int]) -> None:
    join_group(rank, size, init)
    from prefixserve.model.peer_allreduce import PeerAllReduce

    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "probe-peer-norm")
    assert peer.fused is not None
    result = []
    for hidden in hidden_sizes:
        for b in rows:
            row = {"hidden": hidden, "rows": b}
            # the engine's choice; past two ranks also each of ranks_norm's two ways checked apart
            modes = ("pull",) if size == 2 else ("pull", "one_shot")
            for mode in modes:
                for dtype in (torch.float32, torch.bfloat16):
                    if b * hidden * dtype.itemsize <= 8 << 20:
                        name = str(dtype).removeprefix("torch.") + ("" if mode == "pull" else f"_{mode}")
                        if mode == "pull":
                            row[name] = _check(peer, b, hidden, dtype, rank)
                        else:  # ranks_norm at every size
                            wrong = wrong_outputs(Meeting(peer), {"ranks": True}, b, hidden, dtype, rank)
                            row[name] = {"graphed_calls_wrong": wrong}
                if mode == "pull":
                    row.update(_time(peer, b, hidden))
            result.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    leave_group(queue, rank, result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    ap.add_argument("--ranks", type=int, default=2, help="GPUs (2: peer_norm.py; 3-8: ranks_norm.py)")
    ap.add_argument("--json", type=Path, help="also write this JSON, and the table beside it (.md)")
    args = ap.parse_args()
    result = run_ranks(_worker, (args.hidden, args.rows), size=args.ranks, timeout=400)[0]
    info = {**run_info(), "ranks": args.ranks}
    lines = _table(result, args.ranks, info)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({**info, "rows": result}, indent=1))
        args.json.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _table(result: list[dict], ranks: int, info: dict) -> list[str]:
    lines = [
        f"# Fused all-reduce + norm at {ranks} ranks",
        "",
        f"{info['device']} x {ranks}, torch {info['torch']}, commit {info['commit']}, {info['date']}; "
        "microseconds a call, graphed (64 calls a graph). Written by `benchmarks/probes/peer_norm.py`.",
        "",
    ]
    nan = float("nan")
    if ranks == 2:
        head = ("hidden", "B", "MB", "fused", "two-shot + norm", "two-shot", "norm alone")
        head += ("NVLink bound", "fused / (two-shot + norm)", "wrong bf16 / fp32", "max err bf16")
    else:
        head = ("hidden", "B", "MB", "engine", "one-shot", "two-shot + norm", "two-shot")
        head += ("norm alone", "NVLink bound", "engine / (two-shot + norm)", "wrong bf16 / fp32 (one-shot)")
        head += ("max err bf16", "ranks equal")
    lines += ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for r in result:
        two = r.get("two_shot_norm_us")
        cells = (r["hidden"], r["rows"], f"{r['bytes'] / 1e6:.2f}", f"{r['fused_us']:.1f}")
        if ranks == 2:
            keys = ("bfloat16", "float32")
        else:
            keys = ("bfloat16", "float32", "bfloat16_one_shot", "float32_one_shot")
            cells += (f"{r.get('one_shot_us', nan):.1f}",)
        wrong = [r.get(k, {}).get("graphed_calls_wrong") for k in keys]
        wrong = ["-" if w is None else w for w in wrong]  # not run, or the two-shot's (not bitwise)
        cells += (f"{two or nan:.1f}", f"{r.get('two_shot_us', nan):.1f}", f"{r['norm_alone_us']:.1f}")
        cells += (f"{r['nvlink_bound_us']:.1f}", f"{r['fused_us'] / two if two else nan:.2f}")
        if ranks == 2:
            cells += (f"{wrong[0]} / {wrong[1]}",)
            cells += (f"{r.get('bfloat16', {}).get('max_err', nan):.3g}",)
        else:
            cells += (f"{wrong[0]} / {wrong[1]} ({wrong[2]} / {wrong[3]})",)
            bf16 = r.get("bfloat16", {})
            cells += (f"{bf16.get('max_err', nan):.3g}", str(bf16.get("ranks_bitwise_equal", "-")))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


if __name__ == "__main__":
    main()
