"""Runs of one process per GPU of this host (the probes and GPU tests of the two-rank all-reduce):
spawn them, join a process group through a file, and bring every rank's answer back."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def join_group(rank: int, size: int, init: str, backend: str = "nccl") -> None:
    """This process joins the group as ``rank`` (NCCL: on ``cuda:rank``, NVLink multicast off)."""
    device = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", rank)
    dist.init_process_group(
        backend, init_method=f"file://{init}", rank=rank, world_size=size, device_id=device
    )


def leave_group(queue: Any, rank: int, result: Any) -> None:
    """Hand this rank's answer back, then leave together."""
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(
    target: Callable[..., None], args: tuple = (), size: int = 2, timeout: float = 540
) -> list[Any]:
    """``target(rank, size, init, queue, *args)`` in one spawned process per rank; each ends with
    ``leave_group``. Returns the answers by rank. The processes are daemons: a rank that hangs in a
    collective dies with the caller once ``timeout`` has raised."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "init")
        procs = [
            ctx.Process(target=target, args=(r, size, init, queue, *args), daemon=True) for r in range(size)
        ]
        for p in procs:
            p.start()
        answers = dict(queue.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(60)
    return [answers[r] for r in range(size)]


__all__ = ["join_group", "leave_group", "run_ranks"]
