"""Does pushing a row-parallel product from its matmul's epilogue beat reading it after a barrier?

Two GPUs, one process each (NCCL group, peer memory as the engine sets it up: ``PeerAllReduce``).
For Llama-3.1-8B's row-parallel shards at TP=2 (o: K=2048, down: K=7168; N=4096) and rows B, per
call, graphed (64 calls a graph, the two product slots alternating):

- ``pull``: the product into its slot (the skinny kernel at <= 64 rows, cuBLAS above), then the fused
  norm reading the peer's product over NVLink after its barrier (``PREFIXSERVE_PEER_PUSH=0``);
- ``norm push``: the same product, the norm pushing it before its barrier (``=norm``);
- ``producer push``: the skinny kernel or ``push_matmul`` writing it here and into the peer's memory
  and signalling, the norm waiting on a local count (``=auto``);
- the matmuls alone (cuBLAS, skinny, push_matmul without its push cost being hidden), for scale.

Correctness: 200 graphed producer-push calls with fresh inputs each (a scale of a base), every
output checked against the torch reference of the two ranks' products afterwards.

    PYTHONPATH=. python -m benchmarks.probes.producer_push [--rows 16 64 128 256 512] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.probes.peer_norm import _graph_us

EPS = 1e-5
SHAPES = {"o": 2048, "down": 7168}  # K of each shard at TP=2; N = 4096
HIDDEN = 4096


def _reduced(peer, x, w, residual, norm_w, slot: int):
    """What the model's ``RowParallelLinear.reduced`` then ``add_rms_norm`` do for one call."""
    from prefixserve.model import fused

    pending = peer.product_slot(slot, x.shape[0], HIDDEN, x.dtype)
    if fused.linear_pushed(x, w, pending.mine, pending.push_target()):
        import dataclasses

        pending = dataclasses.replace(pending, pushed=True)
    else:
        fused.linear_into(x, w, pending.mine)
    return fused.add_rms_norm(pending, norm_w, EPS, residual)


def _check(peer, rows: int, k: int, rank: int) -> int:
    """Producer push, 200 graphed calls, fresh scaled inputs: how many outputs are wrong."""
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(1000 * rank + rows)
    common = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(HIDDEN, k, generator=gen, device="cuda") / 32).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=common, device="cuda").to(dtype)
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=dtype)
    calls = 200
    scales = torch.arange(1, calls + 1, device="cuda", dtype=torch.float32) / calls
    results = torch.empty(calls, rows, HIDDEN, device="cuda", dtype=dtype)
    xs = torch.empty_like(x)

    def call(i: int) -> None:
        torch.mul(x, scales[i].to(dtype), out=xs)
        results[i] = _reduced(peer, xs, w, residual, norm_w, i % 2)[1]

    for i in range(2):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    wrong = 0
    for i in range(calls):  # each rank's product gathered, summed as the kernel does
        mine = (x * scales[i].to(dtype)).float() @ w.float().t()
        both = [torch.empty(rows, HIDDEN, device="cuda") for _ in range(2)]
        dist.all_gather(both, mine)
        want = (both[0] + both[1]).to(dtype).float() + residual.float()
        wrong += int(not torch.allclose(results[i].float(), want, atol=0.1, rtol=0.05))
    return wrong


def _time(peer, rows: int, k: int) -> dict:
    from prefixserve.model import fused
    from prefixserve.model.kernels import push_matmul, skinny_matmul

    dtype = torch.bfloat16
    copies = max(2, int(200e6 // (HIDDEN * k * 2)))  # weights past L2, as a model's layers are
    weights = [(torch.randn(HIDDEN, k, device="cuda") / 32).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda").to(dtype)
    residual = torch.randn(rows, HIDDEN, device="cuda").to(dtype)
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=dtype)
    out: dict = {}
    for mode, env in (("pull", "0"), ("norm_push", "norm"), ("producer_push", "auto")):
        os.environ["PREFIXSERVE_PEER_PUSH"] = env
        out[f"{mode}_us"] = _graph_us(
            lambda i: _reduced(peer, x, weights[i % copies], residual, norm_w, i % 2)
        )
    slot = peer.product_slot(0, rows, HIDDEN, dtype)
    out["cublas_us"] = _graph_us(lambda i: torch.mm(x, weights[i % copies].t(), out=slot.mine))
    if fused.skinny_wins(x, weights[0]):
        out["skinny_us"] = _graph_us(
            lambda i: skinny_matmul.linear_if_faster(x, weights[i % copies], None, out=slot.mine)
        )
    if push_matmul.supported(x, weights[0], slot.mine):
        target = slot.push_target()
        out["push_matmul_us"] = _graph_us(
            lambda i: push_matmul.push_linear(x, weights[i % copies], slot.mine, target)
        )
    return out


CONFIGS = [  # push_matmul tiles tried by --sweep: (BLOCK_M, BLOCK_N, STAGES, num_warps)
    (64, 128, 3, 4), (64, 128, 4, 4), (64, 128, 3, 8), (64, 64, 4, 4), (64, 64, 6, 4), (64, 256, 3, 8),
    (128, 64, 4, 4), (128, 128, 3, 8), (128, 128, 4, 8), (128, 256, 3, 8), (32, 128, 4, 4),
]  # fmt: skip


def _sweep(peer, rows: int, k: int) -> list[dict]:
    """The producer push per call (matmul + norm) and push_matmul alone for each tile config."""
    from prefixserve.model.kernels import push_matmul

    dtype = torch.bfloat16
    copies = max(2, int(200e6 // (HIDDEN * k * 2)))
    weights = [(torch.randn(HIDDEN, k, device="cuda") / 32).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda").to(dtype)
    residual = torch.randn(rows, HIDDEN, device="cuda").to(dtype)
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=dtype)
    slot = peer.product_slot(0, rows, HIDDEN, dtype)
    target = slot.push_target()
    os.environ["PREFIXSERVE_PEER_PUSH"] = "auto"
    found, default = [], push_matmul.CONFIG
    for config in CONFIGS:
        push_matmul.CONFIG = config
        row = {"shape_K": k, "rows": rows, "config": list(config)}
        row["producer_push_us"] = _graph_us(
            lambda i: _reduced(peer, x, weights[i % copies], residual, norm_w, i % 2)
        )
        row["push_matmul_us"] = _graph_us(
            lambda i: push_matmul.push_linear(x, weights[i % copies], slot.mine, target)
        )
        found.append(row)
    push_matmul.CONFIG = default
    return found


def _worker(rank: int, init: str, rows: list[int], queue, sweep: list[int]) -> None:
    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(
        "nccl", init_method=f"file://{init}", rank=rank, world_size=2, device_id=torch.device("cuda", rank)
    )
    from prefixserve.model.peer_allreduce import PeerAllReduce

    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "probe-producer-push")
    result = []
    for name, k in SHAPES.items():
        for b in rows:
            os.environ["PREFIXSERVE_PEER_PUSH"] = "auto"
            row = {"shape": name, "K": k, "rows": b, "producer_push_wrong": _check(peer, b, k, rank)}
            row.update(_time(peer, b, k))
            result.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    swept = []
    for k in SHAPES.values():
        for b in sweep:
            swept += _sweep(peer, b, k)
    if rank == 0:
        queue.put((result, swept))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sweep", type=int, nargs="*", default=[], help="rows to try push_matmul's tiles at")
    args = ap.parse_args()
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "init")
        procs = [ctx.Process(target=_worker, args=(r, init, args.rows, queue, args.sweep)) for r in range(2)]
        for p in procs:
            p.start()
        result, swept = queue.get(timeout=550)
        for p in procs:
            p.join(60)
    device = torch.cuda.get_device_name(0)
    if args.json:
        found = {"device": device, "torch": torch.__version__, "rows": result, "sweep": swept}
        args.json.write_text(json.dumps(found, indent=1))
    print(f"{device} x 2; microseconds per call (matmul + all-reduce + residual add + norm), graphed")
    head = ("shape", "B", "pull", "norm push", "producer push", "cuBLAS", "skinny", "push_matmul", "wrong")
    print("| " + " | ".join(head) + " |")
    print("|" + " ---: |" * len(head))
    nan = float("nan")
    for r in result:
        cells = [r["shape"], r["rows"]]
        cells += [f"{r.get(k, nan):.1f}" for k in ("pull_us", "norm_push_us", "producer_push_us")]
        cells += [f"{r.get(k, nan):.1f}" for k in ("cublas_us", "skinny_us", "push_matmul_us")]
        cells.append(r["producer_push_wrong"])
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if swept:
        print("push_matmul tiles: K, B, (BLOCK_M, BLOCK_N, STAGES, warps): producer push / push_matmul us")
        for r in swept:
            us = f"{r['producer_push_us']:.1f} / {r['push_matmul_us']:.1f}"
            print(r["shape_K"], r["rows"], tuple(r["config"]), us)


if __name__ == "__main__":
    main()
