"""The fused two-rank all-reduce + norm over NVLink at real widths: two GPUs, one process each.

Each meeting protocol (call counts, pulled and pushed; compare-and-swap) runs 200 graphed calls with
fresh products in alternating slots, at decode sizes and with every program several warps wide (the
8B's hidden size: a count that the warps of one program disagree on deadlocks or reads a stale
product). Every output must equal the sum computed apart. Needs 2 CUDA GPUs (skipped elsewhere)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

ROWS = (1, 64, 256, 512)
HIDDEN = 4096


def _worker(rank: int, init: str, queue) -> None:
    import torch.distributed as dist

    from benchmarks.probes.peer_signal import VARIANTS, Meeting, wrong_outputs
    from prefixserve.model.peer_allreduce import PeerAllReduce

    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(
        "nccl", init_method=f"file://{init}", rank=rank, world_size=2, device_id=torch.device("cuda", rank)
    )
    meet = Meeting(PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "test-peer-norm"))
    wrong = {}
    for name, variant in {**VARIANTS, "engine": {"engine": True}}.items():
        for rows in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                if rows * HIDDEN * dtype.itemsize <= 8 << 20:
                    wrong[f"{name} {rows} {dtype}"] = wrong_outputs(meet, variant, rows, HIDDEN, dtype, rank)
    queue.put((rank, wrong))
    dist.barrier()
    dist.destroy_process_group()


def test_every_meeting_protocol_sums_fresh_products() -> None:
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "init")
        procs = [ctx.Process(target=_worker, args=(r, init, queue), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=240) for _ in procs)
        for p in procs:
            p.join(60)
    for rank, wrong in results.items():
        assert not any(wrong.values()), f"rank {rank}: {wrong}"
    assert len(results[0]) == len(results[1]) > 0
