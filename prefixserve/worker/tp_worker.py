"""A tensor-parallel worker: one rank's shard, running each device call rank 0 sends it.

Started by ``TensorParallelRunner`` as ``python -m prefixserve.worker.tp_worker ADDRESS RANK``
(the socket's key on its standard input). It loads its shard, sizes its KV cache with the
other ranks, says "ready", then runs messages in order until told to stop or until rank 0's socket
closes. Any error ends the process after sending its traceback: rank 0 reports it and fails. A
thread ends the process when rank 0's process is gone, wherever the main thread waits (a kernel of
this rank spinning for rank 0's signal would otherwise keep the process and its GPU memory).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist

from prefixserve.config import EngineConfig
from prefixserve.model.loader import ModelSource, load_model
from prefixserve.worker.model_runner import Launch, ModelRunner, PrevTokenFeed, StepBatch, context_length
from prefixserve.worker.tp_runner import init_rank


class StepGaps:
    """This rank's GPU idle between consecutive steps (CUDA events around each forward): rank 0's own
    idle timer cannot see a worker that starts its steps late, which rank 0 then waits for inside
    the step's first collective. Read with the "stats" message (``TensorParallelRunner.worker_stats``)."""

    KEEP = 4096  # steps kept: the newest

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.steps: deque[tuple[torch.cuda.Event, torch.cuda.Event | None]] = deque(maxlen=self.KEEP)

    def started(self, start: torch.cuda.Event | None) -> None:
        if self.on and start is not None:
            self.steps.append((start, None))

    def ended(self) -> None:
        """The step's last device call on this rank (its logits or argmax) is issued."""
        if self.on and self.steps and self.steps[-1][1] is None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self.steps[-1] = (self.steps[-1][0], done)

    def stats(self) -> dict[str, float]:
        """Seconds busy and idle over the kept steps (waits for the device), then forgets them."""
        steps = [(a, b) for a, b in self.steps if b is not None]
        self.steps.clear()
        busy = idle = 0.0
        if steps:
            steps[-1][1].synchronize()
        for i, (start, done) in enumerate(steps):
            busy += start.elapsed_time(done) / 1e3
            if i:
                idle += max(0.0, steps[i - 1][1].elapsed_time(start) / 1e3)
        return {"steps": float(len(steps)), "gpu_busy_s": busy, "gpu_idle_s": idle}


def serve(conn: Connection, rank: int) -> None:
    """Load this rank's shard, then run rank 0's messages until "stop"."""
    first = conn.recv()
    if first == ("stop",):  # rank 0 failed before the start-up message
        return
    config, source, size, init_file = first
    config: EngineConfig
    source: ModelSource
    if config.torch_device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    shard = init_rank(config, rank, size, init_file)
    model, _ = load_model(
        source, config.torch_dtype, config.torch_device, config.seed, False, shard, config.quantization
    )
    runner = ModelRunner(model, config, context_length(config, model))
    conn.send(("ready",))
    launch: Launch | None = None
    gaps = StepGaps(runner.device)
    batches: dict[int, StepBatch | Exception] = {}  # by rank 0's batch id, until a call uses one
    argmax_tokens: torch.Tensor | None = None  # the latest sharded argmax's, the same on every rank
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if op == "prepare_batch":  # one that fails here failed on rank 0 too: only its use would be fatal
            batch_id, batch_args, batch_kwargs = args
            try:
                batches[batch_id] = runner.prepare_batch(*batch_args, **batch_kwargs)
            except Exception as exc:
                batches[batch_id] = exc
        elif op == "forward":
            batch_id, ids, copies, fed = args
            feed = _fed_tokens(runner, fed, argmax_tokens)
            launch = runner.forward(ids, _prepared(batches, batch_id), copies, feed)
            gaps.started(launch.start)
        elif op == "logits":
            assert launch is not None, "logits before any forward"
            runner.logits(launch, *args)
            argmax_tokens = None
            gaps.ended()
        elif op == "argmax":
            assert launch is not None, "argmax before any forward"
            argmax_tokens = runner.argmax(launch, *args)
            gaps.ended()
        elif op == "stats":
            conn.send(("stats", gaps.stats()))
        elif op == "deviation":
            batch_id, ids = args
            runner.kv_deviation(ids, _prepared(batches, batch_id))
        elif op == "kv":
            _kv_call(runner, args[0], args[1:])
        elif op == "stop":
            return
        else:
            raise ValueError(f"unknown message {op!r}")


def _prepared(batches: dict[int, StepBatch | Exception], batch_id: int) -> StepBatch:
    """The batch rank 0 launches, taken out with every older one (rank 0 prepares a step again at times)."""
    for old in [k for k in batches if k < batch_id]:
        del batches[old]
    batch = batches.pop(batch_id)
    if isinstance(batch, Exception):
        raise batch
    return batch


def _fed_tokens(
    runner: ModelRunner,
    fed: tuple[list[int], list[int], int, bool] | None,
    argmax_tokens: torch.Tensor | None,
) -> PrevTokenFeed | None:
    """Rows of a step launched ahead: their tokens are this rank's own from the step before's sharded
    argmax (``everywhere``), else they come from rank 0's broadcast."""
    if fed is None:
        return None
    dst, src, count, everywhere = fed
    if everywhere:
        if argmax_tokens is None or argmax_tokens.shape[0] != count:
            raise RuntimeError(f"rank 0 feeds {count} argmax tokens; this rank holds {argmax_tokens!r}")
        return PrevTokenFeed(dst, src, argmax_tokens)
    tokens = torch.empty(count, dtype=torch.long, device=runner.device)
    dist.broadcast(tokens, src=0, group=runner.shard.group)
    return PrevTokenFeed(dst, src, tokens)


def _kv_call(runner: ModelRunner, name: str, args: tuple[Any, ...]) -> None:
    """Rank 0's KV-block call, on this rank's heads (rows to scatter arrive by broadcast)."""
    if name == "scatter_rows":
        blocks, shape, dtype = args
        runner.kv.scatter_rows(blocks, torch.empty(shape, dtype=dtype, device=runner.device))
    elif name in ("copy_blocks", "gather_rows", "gather_rows_async", "gather_blocks", "gather_blocks_device"):
        getattr(runner.kv, name)(*args)
    else:
        raise ValueError(f"unknown KV call {name!r}")


PARENT_POLL_S = 1.0  # how often the worker looks for rank 0's process


def exit_with_parent(parent: int, poll_s: float = PARENT_POLL_S) -> None:
    """A daemon thread that ends this process (exit code 1) once its parent is no longer ``parent``
    (it died, and the process was handed to another). Rank 0 closing its socket ends the worker's
    loop, but only while that loop waits for a message: one waiting on the GPU, for a kernel that
    waits on rank 0, never reads it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(
            "prefixserve tensor-parallel worker: rank 0's process is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tp-parent").start()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a stuck rank is
    exit_with_parent(os.getppid())
    address, rank = sys.argv[1], int(sys.argv[2])
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send(rank)
    try:
        serve(conn, rank)
    except BaseException:
        text = traceback.format_exc()
        print(f"prefixserve tensor-parallel worker {rank} failed:\n{text}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            conn.send(("error", text))
        os._exit(1)  # no clean-up: a collective may be stuck, and rank 0 fails the engine anyway
    sys.stdout.flush()
    os._exit(0)  # no collective on the way out: rank 0 leaves the group on its own


if __name__ == "__main__":
    main()
