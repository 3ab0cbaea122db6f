"""Tensor parallelism's processes: the engine's process is rank 0 and drives one worker process per
other rank (one GPU each; gloo ranks on a CPU).

Only rank 0 schedules, plans requests and samples. Each runner call that touches the device goes to
the workers first, as one small pickled message over a local socket (the step batch's arguments,
token ids and copy-on-write pairs; the rows to score; a KV-block copy), and every rank then runs the
same call on its own shard: the collectives inside (all-reduces after o_proj, down_proj and the
embedding; the logits' all-gather) meet because every rank makes the same calls in the same order.
The workers are plain ``python -m prefixserve.worker.tp_worker`` processes, so a user's script
is not imported again in them (``multiprocessing``'s spawn would).

A worker that dies fails the engine at once with ``WorkerDiedError``: a thread waits on every
worker's exit, raises the abort flag that rank 0's peer kernels read while they wait for the other
rank (``PeerAbort``) and aborts the process group, so no rank stays blocked in a collective. Shutdown
(``shutdown``, interpreter exit, or rank 0 dying, which closes the workers' sockets) stops them all.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from prefixserve.config import EngineConfig
from prefixserve.kv.cache import KVCache, PackedKV
from prefixserve.kv.transfer import Ready
from prefixserve.model.loader import ModelSource, load_model, model_config
from prefixserve.model.parallel import Shard, WorkerDiedError, check_divisible
from prefixserve.model.peer_allreduce import peer_allreduce_for
from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.rules import LogitsAdjust, LogitsMask
from prefixserve.worker.model_runner import Launch, ModelRunner, PrevTokenFeed, StepBatch, context_length

if TYPE_CHECKING:
    from prefixserve.sampling.token_ban import TokenBan

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large checkpoint's shard, per worker
DEATH_NOTICE_S = 3.0  # after a failed collective, how long to wait to learn whether a worker died


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The engine settings as rank ``rank`` runs them: its own GPU (``cuda:<first + rank>``)."""
    device = config.torch_device
    if device.type != "cuda":
        return config
    # each rank's own config names one device: the rank count was checked against the GPUs already
    return replace(config, device=f"cuda:{(device.index or 0) + rank}", tensor_parallel_size=1)


def init_rank(config: EngineConfig, rank: int, size: int, init_file: str) -> Shard:
    """Join the process group (NCCL on CUDA, gloo on a CPU) as ``rank``; the shard this rank holds."""
    device = config.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device notes)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=START_TIMEOUT_S),
        **kwargs,
    )
    use_peer = backend == "nccl" and config.tp_peer_allreduce
    name = f"prefixserve-{Path(init_file).parent.name}"  # this engine's own (its temporary folder)
    peer = peer_allreduce_for(dist.group.WORLD, device, name) if use_peer else None
    return Shard(rank, size, dist.group.WORLD, peer)


@dataclass(slots=True)
class _Health:
    """What the watcher threads and the runner share: a worker's death, and whether exits are asked for."""

    dead: WorkerDiedError | None = None
    died: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)
    # rank 0's peer kernels' abort (``PeerAbort.set``): once a rank is gone they stop waiting for it
    give_up: Callable[[], None] | None = None

    def give_up_waits(self) -> None:
        if self.give_up is None:
            return
        try:
            self.give_up()
        except Exception:  # the engine is failing already: its error says why
            log.debug("aborting the peer kernels failed", exc_info=True)


def _watch_worker(health: _Health, rank: int, proc: subprocess.Popen[bytes], conn: Connection) -> None:
    """Wait for one worker's exit; one not asked for marks the engine dead and aborts the group."""
    code = proc.wait()
    if health.stopping.is_set():
        return
    detail = ""
    try:
        if conn.poll():
            detail = "\n" + str(conn.recv()[1])
    except (EOFError, OSError):
        pass
    health.dead = WorkerDiedError(
        f"tensor-parallel worker {rank} (pid {proc.pid}) died with exit code {code}; "
        f"the engine cannot go on without it{detail}"
    )
    health.died.set()
    log.error("%s", health.dead)
    health.give_up_waits()  # first: NCCL's abort may wait for the stream the peer kernels hold
    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # gloo: a dead peer's closed sockets already fail the collectives
            log.debug("aborting the process group failed", exc_info=True)


class _BroadcastKV:
    """Rank 0's KV cache: every call that changes or reads blocks goes to the workers first."""

    def __init__(self, kv: KVCache, runner: TensorParallelRunner) -> None:
        self._kv, self._runner = kv, runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._runner.call("kv", "copy_blocks", pairs)
            self._kv.copy_blocks(pairs)

    def gather_rows(self, blocks: list[int], rows: int) -> PackedKV:
        self._runner.call("kv", "gather_rows", blocks, rows)
        return self._runner.guard(self._kv.gather_rows, blocks, rows)

    def gather_rows_async(self, blocks: list[int], rows: int) -> tuple[PackedKV, Ready | None]:
        self._runner.call("kv", "gather_rows_async", blocks, rows)
        return self._runner.guard(self._kv.gather_rows_async, blocks, rows)

    def gather_blocks(self, blocks: list[int]) -> tuple[torch.Tensor, Ready | None]:
        self._runner.call("kv", "gather_blocks", blocks)
        return self._runner.guard(self._kv.gather_blocks, blocks)

    def gather_blocks_device(self, blocks: list[int]) -> torch.Tensor:
        self._runner.call("kv", "gather_blocks_device", blocks)
        return self._runner.guard(self._kv.gather_blocks_device, blocks)

    def scatter_rows(self, blocks: list[int], packed: PackedKV) -> None:
        self._kv._slots(blocks, packed.shape[2])  # bad blocks fail here, before any worker is told
        self._runner.call("kv", "scatter_rows", blocks, tuple(packed.shape), packed.dtype)
        self._runner.guard(self._kv.scatter_rows, blocks, packed)

    def scatter_rows_layered(self, blocks: list[int], packed: PackedKV) -> None:
        """``scatter_rows``: rank 0's rows reach the others by broadcast, not layer by layer."""
        self.scatter_rows(blocks, packed)


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: its own shard, plus the workers it sends each device call to."""

    def __init__(self, config: EngineConfig, source: ModelSource, progress: bool = True) -> None:
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError(
                "tensor_parallel_size > 1 starts its own torch.distributed process group, but this "
                "process already has one; run the engine in a process without it"
            )
        # a GGUF is converted here, once, before the workers look for it; a model whose heads do
        # not split over the ranks is refused before any process starts
        check_divisible(model_config(source, progress), size)
        config = _peer_once_per_process(config)
        self._batch_id = 0
        self._argmax_tokens: torch.Tensor | None = None  # the sharded argmax's latest (every rank's)
        self.health = _Health()
        self._tmp = tempfile.TemporaryDirectory(prefix="prefixserve-tp-")
        init_file = str(Path(self._tmp.name) / "init")
        authkey = secrets.token_bytes(16)
        listener = Listener(str(Path(self._tmp.name) / "socket"), family="AF_UNIX", authkey=authkey)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        # runs once: at shutdown, when the runner is collected, or when the interpreter exits
        self._release = weakref.finalize(self, _release, self.procs, self.conns, self.health)
        atexit.register(self.health.stopping.set)  # runs first at exit: workers ending then are expected
        self._threads_before = torch.get_num_threads()
        try:
            for rank in range(1, size):
                env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=_import_path())
                cmd = [sys.executable, "-m", "prefixserve.worker.tp_worker", listener.address, str(rank)]
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE)
                assert proc.stdin is not None
                proc.stdin.write(authkey.hex().encode() + b"\n")  # the socket's key, never in argv
                proc.stdin.close()
                self.procs.append(proc)
            for _ in range(1, size):
                self.conns.append(self._accept(listener))
            listener.close()
            ranks = [conn.recv() for conn in self.conns]  # each says its rank first
            self.conns = [c for _, c in sorted(zip(ranks, self.conns, strict=True), key=lambda rc: rc[0])]
            for rank, conn in enumerate(self.conns, start=1):
                conn.send((rank_config(config, rank), source, size, init_file))
            self._watch()
            if config.torch_device.type == "cpu":  # the ranks share the cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            shard = self.guard(init_rank, rank_config(config, 0), 0, size, init_file)
            if shard.peer is not None:
                self.health.give_up = shard.peer.abort.set
                if self.health.dead is not None:  # a worker died before this was in place
                    self.health.give_up_waits()
            model, self.tokenizer_dir = load_model(
                source,
                config.torch_dtype,
                rank_config(config, 0).torch_device,
                config.seed,
                progress,
                shard,
                config.quantization,
            )
            self.guard(super().__init__, model, rank_config(config, 0), context_length(config, model))
            for rank, conn in enumerate(self.conns, start=1):
                self._expect(conn, rank, "ready")
        except BaseException:
            with contextlib.suppress(OSError):
                listener.close()
            self.shutdown()
            raise
        self.kv = _BroadcastKV(self.kv, self)  # type: ignore[assignment]

    def _accept(self, listener: Listener) -> Connection:
        """The next worker's connection; fails if a worker exits before connecting."""
        listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return listener.accept()
            except TimeoutError:
                for rank, proc in enumerate(self.procs, start=1):
                    if proc.poll() is not None:
                        raise WorkerDiedError(
                            f"tensor-parallel worker {rank} exited with code {proc.returncode} at start-up"
                        ) from None
                if time.monotonic() > deadline:
                    raise

    def _expect(self, conn: Connection, rank: int, word: str) -> Any:
        while not conn.poll(0.5):
            self.check()
        reply = conn.recv()
        if reply[0] != word:
            raise WorkerDiedError(f"tensor-parallel worker {rank} failed at start-up:\n{reply[1]}")
        return reply[1:]

    # ---- failure ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A thread per worker waits on its exit; an exit not asked for marks the engine dead and
        aborts the process group (a rank blocked in a collective is released with an error). The
        threads hold the shared ``_Health``, not the runner, so the runner can still be collected."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            args = (self.health, rank, proc, conn)
            threading.Thread(target=_watch_worker, args=args, daemon=True, name=f"tp-{rank}").start()

    def check(self) -> None:
        """Raise ``WorkerDiedError`` if a worker has died."""
        if self.health.dead is not None:
            raise self.health.dead

    def guard(self, fn: Any, *args: Any) -> Any:
        """Run a call that meets the workers in collectives; a failure caused by a dead worker is
        reported as that worker's death (the watcher may notice it a moment after the collective)."""
        self.check()
        try:
            return fn(*args)
        except Exception as exc:
            # a failed collective nearly always means a rank has gone: give its watcher a moment
            # (polling the process here would race the watcher's own wait for it)
            if not self.health.stopping.is_set():
                self.health.died.wait(DEATH_NOTICE_S)
            if self.health.dead is not None:
                raise self.health.dead from exc
            raise

    def call(self, *message: Any) -> None:
        """Send one message to every worker (they run it in order)."""
        self.check()
        try:
            for conn in self.conns:
                conn.send(message)
        except OSError as exc:  # a closed socket: the watcher says which worker
            self.guard(_reraise, exc)

    def worker_stats(self) -> list[dict[str, float]]:
        """Each worker's GPU busy and idle seconds between its steps since the last call (``StepGaps``);
        waits for the workers' devices. For probes: rank 0's idle timer sees only rank 0."""
        self.call("stats")
        return [self._expect(conn, rank, "stats")[0] for rank, conn in enumerate(self.conns, start=1)]

    # ---- the runner's device calls ----------------------------------------------------------------
    def prepare_batch(self, *args: Any, **kwargs: Any) -> StepBatch:
        """The workers get the batch's arguments first and prepare it while this rank does: by the time
        the forward reaches them their batch is ready, and their launch is not late to the first
        all-reduce by its host time."""
        self._batch_id += 1
        self.call("prepare_batch", self._batch_id, args, kwargs)
        batch = super().prepare_batch(*args, **kwargs)
        batch.batch_id = self._batch_id
        return batch

    def forward(
        self,
        ids: list[int],
        batch: StepBatch,
        copies: list[tuple[int, int]],
        feed: PrevTokenFeed | None = None,
    ) -> Launch:
        """The workers get the step's host ids; rows fed from the step ahead (launch-ahead) take
        their tokens on the device, so no rank waits for them on the host: where the step ahead chose
        them by the sharded argmax, every rank computed the same tokens and each reads its own (the
        latest it chose); otherwise from a broadcast of rank 0's, issued behind that step's sampling."""
        everywhere = feed is not None and feed.tokens is self._argmax_tokens
        fed = None if feed is None else (feed.dst, feed.src, len(feed.tokens), everywhere)
        self.call("forward", batch.batch_id, ids, copies, fed)
        return self.guard(self._forward_local, ids, batch, copies, feed, everywhere)

    def _forward_local(
        self,
        ids: list[int],
        batch: StepBatch,
        copies: list[tuple[int, int]],
        feed: PrevTokenFeed | None,
        everywhere: bool,
    ) -> Launch:
        self._kv.copy_blocks(copies)
        if feed is not None and not everywhere:
            dist.broadcast(feed.tokens, src=0, group=self.shard.group)
        return ModelRunner.forward(self, ids, batch, [], feed)

    @property
    def _kv(self) -> KVCache:
        return self.kv._kv if isinstance(self.kv, _BroadcastKV) else self.kv

    def sample(
        self,
        launch: Launch,
        rows: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        mask: LogitsMask | None = None,
        ban: TokenBan | None = None,
        adjust: LogitsAdjust | None = None,
    ) -> None:
        """Only rank 0 samples; the workers compute their vocabulary columns for the logits' gather (or,
        greedy alone, their best column for the sharded argmax: ``_before_sampling``)."""
        self.guard(super().sample, launch, rows, params, generators, mask, ban, adjust)

    def _before_sampling(self, rows: list[int], sharded: bool, fp32: bool) -> None:
        self._argmax_tokens = None  # set once the sharded argmax's tokens are issued (``_argmax``)
        if sharded:
            self.call("argmax", rows)
        elif rows:
            self.call("logits", rows, fp32)

    def logits(self, launch: Launch, rows: list[int], fp32: bool = True) -> torch.Tensor:
        self.call("logits", rows, fp32)
        return self.guard(super().logits, launch, rows, fp32)

    def argmax(self, launch: Launch, rows: list[int]) -> torch.Tensor:
        self.call("argmax", rows)
        return self.guard(super().argmax, launch, rows)

    def _argmax(self, launch: Launch, rows: list[int]) -> torch.Tensor:
        """The sharded argmax's tokens, which every rank now holds: a step fed from them needs no
        broadcast while no later sampling has replaced them (``forward``)."""
        self._argmax_tokens = super()._argmax(launch, rows)
        return self._argmax_tokens

    def kv_deviation(self, ids: list[int], batch: StepBatch) -> np.ndarray:
        self.call("deviation", batch.batch_id, ids)
        return self.guard(super().kv_deviation, ids, batch)

    def wait(self, launch: Launch) -> Any:
        """Wait for the launch while watching the workers: a rank that died leaves this rank's peer
        kernels waiting on its signals until the watcher raises their abort flag (``PeerAbort``), and
        PyTorch's two-shot all-reduce has no such flag, so a plain event sync could block; this
        raises ``WorkerDiedError`` as soon as a worker is gone."""
        for event in (launch.future.event if launch.future is not None else None, launch.done):
            if event is not None:
                self._wait_event(event)
        return self.guard(super().wait, launch)

    def _wait_event(self, event: torch.cuda.Event) -> None:
        polls = 0
        while not event.query():
            self.check()
            polls += 1
            time.sleep(0 if polls < 2000 else 1e-4)  # yield first: most waits end within a step

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self.health.stopping.is_set():
            return
        # a graph that captured an NCCL collective keeps the communicator in use: free every graph
        # before leaving, including ones a caller still holds (with a test's reference to the argmax
        # graphs, each leave had run to its 15 s bound; with the graphs reset first, none does)
        for holder in (self.graphs, self.pieces, self.argmax_graphs):
            if holder is not None:
                holder.release()
        self.graphs = self.pieces = self.argmax_graphs = None
        gc.collect()
        self._release()
        torch.set_num_threads(self._threads_before)
        self._tmp.cleanup()


_peer_used = False  # whether a tensor-parallel engine of this process set up the peer all-reduce


def _peer_once_per_process(config: EngineConfig) -> EngineConfig:
    """The peer all-reduce for the first tensor-parallel engine of a process only; later ones use
    NCCL. Measured on 2 x H100 (torch 2.11): a second engine's symmetric-memory rendezvous in the
    same process never returned, whatever the group's name."""
    global _peer_used
    if not (config.tp_peer_allreduce and config.torch_device.type == "cuda"):
        return config
    if _peer_used:
        log.warning(
            "an earlier tensor-parallel engine of this process had the peer all-reduce: this one uses NCCL"
        )
        return replace(config, tp_peer_allreduce=False)
    _peer_used = True
    return config


def peer_used_in_process() -> bool:
    """Whether an engine of this process took the peer all-reduce (later ones use NCCL)."""
    return _peer_used


def _import_path() -> str:
    """PYTHONPATH for a worker: this process's prefixserve first, so both import the same code."""
    here = str(Path(__file__).resolve().parents[2])  # the folder holding prefixserve/
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)


def leave_group(timeout_s: float = 15.0) -> None:
    """Leave the process group without waiting for the other ranks (NCCL: an abort, not a destroy,
    which waits for every rank). Bounded: should it still block, the process goes on without it
    (the group's resources stay until exit) rather than hang its caller."""
    if not dist.is_initialized():
        return

    def leave() -> None:
        try:
            if dist.get_backend() == "nccl":
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception:
            log.debug("leaving the process group failed", exc_info=True)

    thread = threading.Thread(target=leave, daemon=True, name="tp-leave")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("leaving the tensor-parallel process group took over %.0f s; going on without", timeout_s)


def _reraise(exc: BaseException) -> None:
    raise exc


def _release(procs: list[subprocess.Popen[bytes]], conns: list[Connection], health: _Health) -> None:
    """Tell every worker to stop (they exit without a collective), leave the process group at once,
    then end any worker still running after a few seconds."""
    health.stopping.set()
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("stop",))
            conn.close()
    leave_group()
    deadline = time.monotonic() + 10.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


__all__ = [
    "TensorParallelRunner",
    "WorkerDiedError",
    "init_rank",
    "leave_group",
    "peer_used_in_process",
    "rank_config",
]
