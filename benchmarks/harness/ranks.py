"""Runs of one process per GPU of this host (the probes and GPU tests of the two-rank all-reduce):
spawn them, join a process group through a file, and bring every rank's answer back."""

from __future__ import annotations

import os
import queue as queue_module
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXIT_GRACE_S = 5.0


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
    ``leave_group``. Returns the answers by rank. A rank that exits without answering (an exception:
    its traceback is on stderr) fails the run at once, naming the rank, where the others would wait
    for it in a collective until ``timeout``. The processes are daemons: ranks still waiting die
    with the caller."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "init")
        procs = [
            ctx.Process(target=target, args=(r, size, init, queue, *args), daemon=True) for r in range(size)
        ]
        for p in procs:
            p.start()
        answers = _answers(queue, procs, timeout)
        for p in procs:
            p.join(60)
    return [answers[r] for r in range(size)]


def _answers(queue: Any, procs: list[Any], timeout: float) -> dict[int, Any]:
    """Every rank's answer by rank, read as they come; raises once a rank has exited without one,
    or at ``timeout``."""
    deadline = time.monotonic() + timeout
    answers: dict[int, Any] = {}
    while len(answers) < len(procs):
        try:
            rank, answer = queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            answers[rank] = answer
            continue
        except queue_module.Empty:
            pass
        exited = [r for r, p in enumerate(procs) if r not in answers and p.exitcode not in (None, 0)]
        if exited:  # a rank may have answered and then failed: its answer is in the queue by now
            _settle(procs, EXIT_GRACE_S)
            exited = [r for r, p in enumerate(procs) if r not in answers and p.exitcode not in (None, 0)]
            answers.update(_drain(queue))
        dead = [r for r in exited if r not in answers]
        if dead:
            codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in dead)
            raise RuntimeError(f"ranks exited without answering ({codes}); their errors are on stderr")
        if time.monotonic() >= deadline:
            missing = sorted(set(range(len(procs))) - set(answers))
            raise TimeoutError(f"ranks {missing} gave no answer in {timeout:.0f} s")
    return answers


def _settle(procs: list[Any], grace: float) -> None:
    """Wait up to ``grace`` for every rank to exit: when one rank dies, a peer in a collective with it
    often aborts too, and may be seen exiting first; the report must name the rank that failed."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.05)


def _drain(queue: Any) -> dict[int, Any]:
    """The answers already in ``queue``."""
    got: dict[int, Any] = {}
    while True:
        try:
            rank, answer = queue.get(timeout=0.5)
        except queue_module.Empty:
            return got
        got[rank] = answer


__all__ = ["join_group", "leave_group", "run_ranks"]
