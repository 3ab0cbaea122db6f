"""Which library kernel runs each decode-sized product: cuBLAS's own pick, or a timed cuBLASLt one.

``torch.mm`` runs cuBLAS's heuristic pick. At a decode step's row counts (tens to hundreds of rows)
that pick often leaves SMs idle: a 256-row product with 4,096 output columns is a few dozen tiles,
less than one wave of 132 SMs. cuBLASLt offers the same kernels with other tiles, cluster shapes and
scheduling options (``blaslt.variants``); timed on the real weights, one of them was up to 13%
faster at the 8B's and 70B's shard shapes on an H100 (docs/kernels.md section 7).

The choice is made once per problem (rows, columns, depth, dtype, strides), while a decode graph's
eager warm-up forward runs inside ``tuning()``: the candidates are timed on up to eight same-shaped
weights of the model (``register_weights``: each call reads a different one, so L2 holds none, as in
a step), against ``torch.mm`` timed the same way; a candidate must beat it by ``MARGIN`` and match its
product. Captured graphs then replay the chosen kernel. Outside ``tuning()`` only choices already
made are used; unknown problems (prefill's many sizes) keep ``torch.mm``. Choices persist in the cache
directory per GPU, cuBLASLt library and torch version, so a restart does not time them again.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from prefixserve import config
from prefixserve.model import blaslt

log = logging.getLogger(__name__)

MIN_ROWS, MAX_ROWS = 64, 512  # decode-sized products; below, the skinny kernel or cuBLAS's pick
MARGIN = 0.03  # a candidate must be this much faster than torch.mm to replace it (in-step gains ran
# smaller than timed ones: a 2% win at the 70B's qkv shard ran 4% slower in the step, 2 x H200)
MAX_WEIGHTS = 8  # same-shaped weights a timing cycles through
# tiles tried beside the heuristic's own (cublasLtMatmulTile_t ids): the winners of a full search of
# every tile x custom option x cluster shape at the 8B's and 70B's decode shapes on an H100
# (benchmarks/probes/lt_candidates.py --deep)
TILES = (17, 20, 28, 135, 157, 164, 165, 183)
CUSTOMS = tuple(range(8))

stats = {"problems": 0, "seconds": 0.0}  # products timed in this process, and the host time it took
_choices: dict[blaslt.Problem, blaslt.Algo | None] = {}
_siblings: dict[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, int], list[torch.Tensor]] = {}
_state = threading.local()
_loaded: set[str] = set()


def enabled() -> bool:
    return config.gemm_tuning_enabled()


@contextmanager
def tuning() -> Iterator[None]:
    """Within the block, a decode-sized product not yet decided is timed and decided at its first call
    (outside CUDA graph capture); outside it, undecided products keep ``torch.mm``."""
    before = getattr(_state, "tuning", False)
    _state.tuning = True
    try:
        yield
    finally:
        _state.tuning = before


def register_weights(model: torch.nn.Module) -> None:
    """Remember the model's 2-D CUDA weights by shape, so a timing can cycle through same-shaped ones."""
    if not (enabled() and blaslt.available()):
        return
    devices = set()
    for param in model.parameters():
        if param.dim() == 2 and param.is_cuda:
            group = _siblings.setdefault(_weight_key(param), [])
            if len(group) < MAX_WEIGHTS and not any(p is param for p in group):
                group.append(param)
            devices.add(param.device)
    for device in devices:
        _load(device)  # the choices an earlier run on this GPU and library made


def _weight_key(w: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype, int]:
    return tuple(w.shape), tuple(w.stride()), w.dtype, w.device.index or 0


def product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ weight.T`` (into ``out`` when given) by the chosen cuBLASLt kernel, or None where
    ``torch.mm``'s pick stands (or is still to be decided outside ``tuning()``)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    tuning_now = getattr(_state, "tuning", False)
    if not (MIN_ROWS <= rows <= MAX_ROWS and (tuning_now or _choices) and x.is_cuda and enabled()):
        return None
    if not blaslt.supported(x, weight, out):
        return None
    problem = blaslt.Problem.of(x, weight, out)
    if problem not in _choices:
        if not tuning_now or torch.cuda.is_current_stream_capturing():
            return None
        _choices[problem] = _decide(problem, x, weight)
        _save(x.device)
    algo = _choices[problem]
    if algo is None:
        return None
    if out is None:
        out = torch.empty(rows, weight.shape[0], device=x.device, dtype=x.dtype)
    return blaslt.matmul_into(x, weight, out, algo)


def _graph_us(fn: Callable[[int], Any], calls: int, replays: int) -> float:
    """Microseconds a call of ``fn(i)``, i over ``calls``, replayed from one CUDA graph, each call
    after a one-element kernel: in a step a product follows another kernel, and what a candidate
    adds between them (a memset of its workspace, a slower cluster launch) counts against it."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        before = torch.zeros(1, device=side.device)
        fn(0)
        with torch.cuda.graph(graph, stream=side):
            for i in range(calls):
                before.add_(1)
                fn(i)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        for _ in range(replays):
            graph.replay()
        end.record(side)
    end.synchronize()
    torch.cuda.current_stream().wait_stream(side)
    return start.elapsed_time(end) * 1e3 / (replays * calls)


@torch.no_grad()
def _decide(problem: blaslt.Problem, x: torch.Tensor, weight: torch.Tensor) -> blaslt.Algo | None:
    """Time torch.mm and cuBLASLt's candidates on this product; the fastest candidate if it wins by
    MARGIN and its product matches torch.mm's, else None."""
    torch.cuda.synchronize(x.device)
    started = time.perf_counter()
    weights = _siblings.get(_weight_key(weight)) or [weight]
    if not any(w is weight for w in weights):
        weights = [weight, *weights[: MAX_WEIGHTS - 1]]
    out = torch.empty(problem.m, problem.n, device=x.device, dtype=x.dtype)
    if out.stride(0) != problem.out_stride:
        return None
    try:
        # no workspace: a kernel that needs one has cuBLASLt zero it first, a memset node whose gap
        # before the kernel cost more in the step than the kernel gained (the 70B's gate-up, 2 x H200)
        seeds = blaslt.candidates(problem, x.device, max_workspace=0)
        base = blaslt.candidates(problem, x.device)[:1]  # the heuristic's first, workspace or not
        wider = blaslt.variants(
            problem, x.device, base, split_ks=(1,), tiles=TILES, customs=CUSTOMS, max_workspace=0
        )
        pool = seeds + wider
    except blaslt.BlasLtError as exc:
        log.warning("cuBLASLt candidates for %s: %s; keeping torch.mm", problem, exc)
        return None
    calls = len(weights)
    reference = torch.mm(x, weight.t())
    mm_us = _graph_us(lambda i: torch.mm(x, weights[i].t(), out=out), calls, 3)
    screened = []
    for algo in pool:
        try:
            screened.append(
                (_graph_us(lambda i, a=algo: blaslt.matmul_into(x, weights[i], out, a), calls, 2), algo)
            )
        except (blaslt.BlasLtError, RuntimeError):
            continue
    screened.sort(key=lambda t: t[0])
    best, best_us = None, _graph_us(lambda i: torch.mm(x, weights[i].t(), out=out), calls, 10)
    mm_us = min(mm_us, best_us)
    for _, algo in screened[:3]:
        us = _graph_us(lambda i, a=algo: blaslt.matmul_into(x, weights[i], out, a), calls, 10)
        if us < best_us * (1 - MARGIN) or (best is not None and us < best_us):
            blaslt.matmul_into(x, weight, out, algo)
            torch.cuda.synchronize(x.device)
            if _matches(out, reference):
                best, best_us = algo, us
    took = time.perf_counter() - started
    stats["problems"] += 1
    stats["seconds"] += took
    log.info(
        "gemm tuning %dx%dx%d in %.2f s (%d candidates): torch.mm %.1f us, %s",
        problem.m, problem.n, problem.k, took, len(screened), mm_us,
        f"cuBLASLt {blaslt.describe(best)} {best_us:.1f} us" if best is not None else "kept",
    )  # fmt: skip
    return best


def _matches(out: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether a candidate's product equals torch.mm's up to accumulation order (a few bf16 ulps)."""
    scale = float(reference.abs().max()) + 1e-6
    return (
        bool(torch.isfinite(out).all())
        and float((out.float() - reference.float()).abs().max()) <= 0.02 * scale
    )


# ---- choices kept across restarts --------------------------------------------------------------------
def _identity(device: torch.device) -> str:
    """What a choice holds for: the GPU's name, the cuBLASLt library file, the torch version, and
    the search that made it (a changed search times its products again)."""
    search = (TILES, CUSTOMS, MARGIN, MIN_ROWS, MAX_ROWS, "no-workspace")
    return f"{torch.cuda.get_device_name(device)}|{blaslt.library_path()}|{torch.__version__}|{search}"


def _cache_file(device: torch.device) -> Path:
    digest = hashlib.sha1(_identity(device).encode()).hexdigest()[:16]
    return config.cache_dir() / "gemm_tuning" / f"{digest}.json"


def _problem_key(p: blaslt.Problem) -> str:
    dtype = str(p.dtype).removeprefix("torch.")
    return f"{p.m},{p.n},{p.k},{dtype},{p.x_stride},{p.weight_stride},{p.out_stride}"


def _load(device: torch.device) -> None:
    path = _cache_file(device)
    if str(path) in _loaded:
        return
    _loaded.add(str(path))
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for key, blob in saved.items():
        m, n, k, dtype, xs, ws, os_ = key.split(",")
        problem = blaslt.Problem(int(m), int(n), int(k), getattr(torch, dtype), int(xs), int(ws), int(os_))
        _choices.setdefault(problem, None if blob is None else _algo_from_hex(blob))


def _save(device: torch.device) -> None:
    path = _cache_file(device)
    saved = {_problem_key(p): None if a is None else bytes(a).hex() for p, a in _choices.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError, ValueError):  # another rank's process may have kept its own
            saved = {**json.loads(path.read_text()), **saved}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=0))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not keep the gemm tuning choices in %s: %s", path, exc)


def _algo_from_hex(blob: str) -> blaslt.Algo:
    algo = blaslt.Algo()
    raw = bytes.fromhex(blob)
    ctypes.memmove(ctypes.byref(algo), raw, min(len(raw), ctypes.sizeof(algo)))
    return algo


def forget() -> None:
    """Drop every choice and weight group held in memory (tests; a model unloaded)."""
    _choices.clear()
    _siblings.clear()
    _loaded.clear()
