"""Which shared-kernel tiles suit Prompt Cache decode steps: many mid-sized segments (modules of a few
hundred tokens, each held by tens of sequences) plus tiny ones (question blocks shared by 2-3).

For each shape, times the shared kernel's launch alone (work planned beforehand) with
64-row tiles (Triton) and 128-row tiles (Gluon on Hopper when every segment is contiguous, else
Triton), with and without TMA, against T* (bytes / copy rate, FLOPs / GEMM rate, rates assumed:
4.27 TB/s, 680 TFLOP/s), and checks each variant against the 64-row pointer path.

PYTHONPATH=. python -m benchmarks.probes.module_tiles
"""

from __future__ import annotations

import argparse
import itertools

import torch

from prefixserve.attention.kernels.shared_attention import launch_shared, shared_segment_attention
from prefixserve.attention.planning.shared_plan import plan_shared_work

KV_HEADS, GROUP, DIM, BS = 8, 4, 128, 16
SHAPES = {  # name: list of (segments, tokens, holders)
    "6/8 modules, none": [(8, 512, 48), (20, 32, 3)],
    "6/8 modules, link:64": [(8, 448, 48)],
    "10/12 modules, none": [(12, 512, 53), (20, 32, 3)],
    "1 module x 64": [(1, 4096, 64)],
}


def build(shape: list[tuple[int, int, int]], batch: int = 64, contiguous: bool = True):
    g = torch.Generator().manual_seed(0)
    seg_tokens, seg_rows, blocks = [], [], []
    next_block = 1
    for count, tokens, holders in shape:
        for _ in range(count):
            n = -(-tokens // BS)
            ids = (
                list(range(next_block, next_block + n))
                if contiguous
                else [next_block + 2 * i for i in range(n)]
            )
            next_block += 2 * n
            blocks.append(ids)
            seg_tokens.append(tokens)
            seg_rows.append(sorted(torch.randperm(batch, generator=g)[:holders].tolist()))
    num_blocks = next_block + 1
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET dry runs
    k = torch.randn(num_blocks, BS, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, KV_HEADS * GROUP, DIM, device=dev, dtype=torch.bfloat16)
    i32 = {"dtype": torch.int32, "device": dev}
    bstart = torch.tensor([0, *torch.tensor([len(b) for b in blocks]).cumsum(0).tolist()], **i32)
    rstart = torch.tensor([0, *torch.tensor([len(r) for r in seg_rows]).cumsum(0).tolist()], **i32)
    args = (
        q,
        k,
        v,
        torch.tensor([b for bl in blocks for b in bl], **i32),
        bstart,
        torch.tensor(seg_tokens, **i32),
        torch.tensor([r for rs in seg_rows for r in rs], **i32),
        rstart,
        DIM**-0.5,
    )
    flops = sum(4 * GROUP * KV_HEADS * DIM * t * len(r) for t, r in zip(seg_tokens, seg_rows, strict=True))
    kv_bytes = sum(2 * 2 * KV_HEADS * DIM * t for t in seg_tokens)
    return args, max(kv_bytes / 4.27e12, flops / 680e12) * 1e6


def launcher(args: tuple, block_m: int, tma: bool, **tiles: int):
    """The shared kernel's launch over a work list planned once (no host planning in the timing)."""
    q, k, v, blocks, bstart, tokens, rows, rstart, scale = args
    work = plan_shared_work(
        rstart.tolist(),
        tokens.tolist(),
        KV_HEADS,
        GROUP,
        q.device,
        block_m=block_m,
        head_dim=DIM,
        **tiles,
        dtype=q.dtype,
        seg_blocks=blocks.cpu().numpy() if tma else None,
        seg_block_start=bstart.tolist(),
        block_size=BS,
    )
    o = torch.empty(work.num_slots, q.shape[1], DIM, dtype=torch.float32, device=q.device)
    lse = torch.empty(work.num_slots, q.shape[1], dtype=torch.float32, device=q.device)
    return lambda: launch_shared(q, k, v, blocks, bstart, rows, work, scale, o, lse)


def time_us(fn, reps: int = 20) -> float:
    """GPU time of one launch: ``reps`` launches captured in a CUDA graph, replayed (no host in it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps) * 1000


def main() -> None:
    print("| shape | T* us | 64 ptr | 64 TMA | 128 ptr | 128 TMA (Gluon) | max err vs 64 ptr |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, shape in SHAPES.items():
        args, t_star = build(shape)
        ref = shared_segment_attention(*args, block_m=64, use_tma=False)[0]
        cells, err = [], 0.0
        for block_m, tma in ((64, False), (64, True), (128, False), (128, True)):
            got = shared_segment_attention(*args, block_m=block_m, use_tma=tma)[0]
            err = max(err, float((got - ref).abs().max()))
            cells.append(f"{time_us(launcher(args, block_m, tma)):.1f}")
        print(f"| {name} | {t_star:.1f} | " + " | ".join(cells) + f" | {err:.2e} |")


def sweep() -> None:
    """64-row TMA tiles: KV tile width, stages and programs per SM on the module shapes."""
    print("| shape | BLOCK_N | stages | target programs | us |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in ("6/8 modules, none", "10/12 modules, none"):
        args, _ = build(SHAPES[name])
        for block_n, stages, target in itertools.product((32, 64, 128), (2, 3, 4), (None, 264, 528)):
            try:
                tiles = {"block_n": block_n, "num_stages": stages, "target_programs": target}
                us = time_us(launcher(args, 64, True, **tiles))
            except Exception as e:  # a tile that does not fit: say so and go on
                print(f"| {name} | {block_n} | {stages} | {target} | {type(e).__name__} |")
                continue
            print(f"| {name} | {block_n} | {stages} | {target} | {us:.1f} |")


if __name__ == "__main__":
    raw = argparse.RawDescriptionHelpFormatter
    argparse.ArgumentParser(description=__doc__, formatter_class=raw).parse_args()
    main()
    sweep()
