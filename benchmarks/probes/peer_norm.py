"""Is the fused two-rank all-reduce + residual add + RMSNorm right, and faster than two-shot then the norm?

Two GPUs, one process each (NCCL group, peer memory as the engine sets it up: ``PeerAllReduce``).
Per hidden size and rows B:

- correctness: both ranks' products summed with the residual and normalised by the fused kernel
  (``kernels/peer_norm.py``) against the torch reference of the gathered products; the two ranks'
  outputs compared bit for bit; then 200 calls in one CUDA graph alternating the product slots, each
  call's product fresh (a scale of a base written into the slot just before), every output checked
  afterwards (a missed barrier shows as a stale or half-written product);
- timing (bf16): per call, graphed (64 calls a graph, alternating slots): the fused kernel, reading
  the peer's product over NVLink (pull, ``PREFIXSERVE_PEER_PUSH=0``) and with each rank's product
  pushed into the peer's memory before the barrier (push, ``=1``; checked the same way); the
  engine's other path (two-shot all-reduce in peer memory, then ``add_rms_norm``); ``add_rms_norm``
  alone (the floor a fused kernel cannot beat); bytes / 450 GB/s (NVLink 4 one way) for scale.

    PYTHONPATH=. python -m benchmarks.probes.peer_norm [--hidden 4096 8192] [--rows 1 64 256] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.harness.timing import ranks_graph_us
from benchmarks.probes.peer_signal import Meeting, wrong_outputs

NVLINK_GBPS = 450.0
EPS = 1e-5


def _check(peer, rows: int, hidden: int, dtype: torch.dtype, rank: int) -> dict:
    from prefixserve.model import fused
    from prefixserve.model.kernels.peer_norm import peer_add_rms_norm_ref

    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + rows)
    common = torch.Generator(device="cuda").manual_seed(rows)
    mine = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(rows, hidden, generator=common, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=common, device="cuda")).to(dtype)
    pending = peer.product_slot(0, rows, hidden, dtype)
    pending.mine.copy_(mine)
    out, summed = fused.add_rms_norm(pending, weight, EPS, residual)
    products = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(products, mine)
    ref, ref_summed = peer_add_rms_norm_ref(products[0], products[1], residual, weight, EPS)
    err = max(
        float((out.float() - ref.float()).abs().max()),
        float((summed.float() - ref_summed.float()).abs().max()),
    )
    outs = [torch.empty_like(out) for _ in range(2)]
    dist.all_gather(outs, out)
    ranks_equal = bool(torch.equal(outs[0], outs[1]))

    # 200 graphed calls through the engine's call site, slots alternating, each product fresh
    wrong = wrong_outputs(Meeting(peer), {"engine": True}, rows, hidden, dtype, rank)
    return {"max_err": err, "ranks_bitwise_equal": ranks_equal, "graphed_calls_wrong": wrong}


def _time(peer, rows: int, hidden: int, full: bool = True) -> dict:
    from prefixserve.model import fused

    dtype = torch.bfloat16
    residual = torch.randn(rows, hidden, device="cuda").to(dtype)
    weight = torch.ones(hidden, device="cuda", dtype=dtype)
    slots = [peer.product_slot(s, rows, hidden, dtype) for s in (0, 1)]
    for s in slots:
        s.mine.normal_()
    staged = peer.staged(rows, hidden, dtype)
    staged.normal_()
    local = torch.randn(rows, hidden, device="cuda").to(dtype)
    out: dict = {"bytes": rows * hidden * 2}
    out["fused_us"] = ranks_graph_us(lambda i: fused.add_rms_norm(slots[i % 2], weight, EPS, residual))
    if not full:
        return out
    if peer.fits(staged):
        out["two_shot_norm_us"] = ranks_graph_us(
            lambda i: fused.add_rms_norm(peer.reduce_staged(staged), weight, EPS, residual)
        )
        out["two_shot_us"] = ranks_graph_us(lambda i: peer.reduce_staged(staged))
    out["norm_alone_us"] = ranks_graph_us(lambda i: fused.add_rms_norm(local, weight, EPS, residual))
    out["nvlink_bound_us"] = out["bytes"] / (NVLINK_GBPS * 1e3)
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
            for mode in ("push", "pull"):  # pull last: the other columns time the default
                os.environ["PREFIXSERVE_PEER_PUSH"] = "1" if mode == "push" else "0"  # "auto" left
                for dtype in (torch.float32, torch.bfloat16):
                    if b * hidden * dtype.itemsize <= 8 << 20:
                        name = str(dtype).removeprefix("torch.") + ("_push" if mode == "push" else "")
                        row[name] = _check(peer, b, hidden, dtype, rank)
                timed = _time(peer, b, hidden, full=mode == "pull")
                row.update(timed if mode == "pull" else {"fused_push_us": timed["fused_us"]})
            result.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    leave_group(queue, rank, result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = run_ranks(_worker, (args.hidden, args.rows), timeout=400)[0]
    device = torch.cuda.get_device_name(0)
    if args.json:
        args.json.write_text(
            json.dumps({"device": device, "torch": torch.__version__, "rows": result}, indent=1)
        )
    print(f"{device} x 2; microseconds per call, graphed")
    head = ("hidden", "B", "MB", "fused", "fused push", "two-shot + norm", "two-shot", "norm alone")
    head += ("NVLink bound", "fused / (two-shot + norm)", "wrong bf16 / fp32 (push)", "max err bf16 (push)")
    print("| " + " | ".join(head) + " |")
    print("|" + " ---: |" * len(head))
    nan = float("nan")
    for r in result:
        two = r.get("two_shot_norm_us")
        keys = ("bfloat16", "float32", "bfloat16_push", "float32_push")
        wrong = [r.get(k, {}).get("graphed_calls_wrong", "-") for k in keys]
        cells = (r["hidden"], r["rows"], f"{r['bytes'] / 1e6:.2f}", f"{r['fused_us']:.1f}")
        cells += (f"{r.get('fused_push_us', nan):.1f}",)
        cells += (f"{two or nan:.1f}", f"{r.get('two_shot_us', nan):.1f}", f"{r['norm_alone_us']:.1f}")
        cells += (f"{r['nvlink_bound_us']:.1f}", f"{r['fused_us'] / two if two else nan:.2f}")
        cells += (f"{wrong[0]} / {wrong[1]} ({wrong[2]} / {wrong[3]})",)
        errs = [r.get(k, {}).get("max_err", nan) for k in ("bfloat16", "bfloat16_push")]
        cells += (f"{errs[0]:.3g} ({errs[1]:.3g})",)
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
