"""GPU timing: kernels and steps replayed from CUDA graphs (as decode steps run), L2 flushed by
triton's ``do_bench``, and the copy and GEMM rates measured now (the rooflines results are read against)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch


def bench_ms(fn: Callable[[], Any], rep_ms: int = 60, warmup: int = 15) -> float:
    """Median ms; triton's do_bench flushes L2 before every repeat."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median"))


def bench_clean_us(fn: Callable[[], Any], reps: int = 200) -> float:
    """Median us of ``fn`` with L2 flushed before each repeat by a read of 256 MB (clean lines).
    ``bench_ms`` flushes by writing 256 MB: L2 is left full of dirty lines that ``fn``'s first reads
    must write back, about 6 us more for a kernel that streams its bytes once (H200, kernels.md §10);
    a decode step's kernels find L2 holding the layer before's weights, clean."""
    flush = torch.empty(1 << 26, device="cuda", dtype=torch.int32)
    sink = torch.empty((), device="cuda", dtype=torch.int64)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(5):
        fn()
    for start, end in zip(starts, ends, strict=True):
        torch.sum(flush, 0, out=sink)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])
    return 1e3 * float(times.median())


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Capture fn in a CUDA graph (decode steps run under graphs); its replay, or fn if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph.replay
    except Exception:
        traceback.print_exc()
        return fn


def cold_weights(n: int, k: int, scale: float = 1.0, budget: int = 256 << 20) -> list[torch.Tensor]:
    """Random bf16 [n, k] weights (times ``scale``) on the GPU, enough copies (at least 2) to fill
    ``budget`` bytes: cycled through, each copy is out of L2 by the time it comes round again."""
    copies = max(2, -(-budget // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * scale for _ in range(copies)]


def replay_graph(fn: Callable[[int], Any], copies: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``fn(i)`` for i over the weight copies (warmed up on a side stream first),
    replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_ms(
    fn: Callable[[int], Any], copies: int, reps: int = 10, before: Callable[[], Any] | None = None
) -> float:
    """ms per call of ``fn(i)`` for i over the weight copies, replayed from one CUDA graph (L2 holds
    none of a copy's weights by the time it comes round again); ``before`` runs before each of the 5
    timings (their median)."""
    graph = replay_graph(fn, copies)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        if before is not None:
            before()
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * copies))
    return sorted(times)[len(times) // 2]


def ranks_graph_us(fn: Callable[[int], Any], calls: int = 64, reps: int = 20) -> float:
    """Microseconds per ``fn(i)``, ``calls`` of them in one CUDA graph, every rank of the default
    process group replaying together (a barrier before each timing)."""
    import torch.distributed as dist

    return graph_ms(fn, calls, reps, before=dist.barrier) * 1e3


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(copy TB/s counting read + write, bf16 GEMM TFLOP/s on random data), measured now."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), 200)
    copy_tbps = 2 * src.numel() / (ms * 1e-3) / 1e12
    src.resize_(0)
    dst.resize_(0)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, 300)
    return copy_tbps, 2 * n**3 / (ms * 1e-3) / 1e12


# which part of the call a recorded launch is, by its kernel's name
PART_OF = {
    "shared_gluon_kernel": "shared",
    "shared_fp8mma_kernel": "shared",
    "mixed_gluon_kernel": "mixed",
    "_shared_kernel": "shared",
    "_paged_kernel": "own",
    "_packed_decode_kernel": "own",
    "_merge_kernel": "merge",
}


def time_launches(launches: list, tensors: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Each recorded launch of a step (TritonBackend layout) replayed alone, graphed: ms per part."""
    from prefixserve.attention.step_launch import relaunch_layer

    parts: dict[str, float] = {}
    for launch, pos, _ in launches:
        name = getattr(launch.kernel, "__name__", "?")
        part = PART_OF.get(name, name)
        ms = bench_ms(graphed(lambda la=launch, po=pos: relaunch_layer(la, po, tensors)))
        parts[part] = round(parts.get(part, 0.0) + ms, 4)
    return parts
