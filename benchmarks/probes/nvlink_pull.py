"""How fast can a kernel read the peer's product over NVLink, and does the fused all-reduce read it that fast?

Two GPUs, one process each, the engine's symmetric product slots (``PeerAllReduce``). Both ranks copy
the peer's [rows, hidden] bf16 product slot into local memory at the same time (as the fused
all-reduce + norm reads it, ``kernels/peer_norm.py``), no meeting, graphed 64 calls back to back:

- ``row``: one program a row, spread over its threads (the fused kernel's pattern);
- ``row x4``: four rows a program, their loads issued before any store;
- ``tma``: each program copies [16, 256]-element boxes (one 4,096-wide row) with TMA from the
  peer's memory into shared memory, then to local memory;
- ``copy_``: ``torch.Tensor.copy_`` (a device-to-device copy through the copy engine);
- ``local``: the ``row`` kernel reading this rank's own slot (HBM / L2), for scale;
- ``push row`` / ``push tma`` / ``push copy_``: the other direction: each rank writes its own rows into
  the peer's slot at the same time (plain stores, TMA stores through a descriptor over the peer's
  memory, the copy engine), whether NVLink carries writes faster than reads.

Prints us a call and GB/s a direction (bytes read from or written to the peer over the time),
against NVLink 4's 450 GB/s a direction.

    PYTHONPATH=. python -m benchmarks.probes.nvlink_pull [--shapes 256x4096 256x8192] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.harness.timing import ranks_graph_us
from prefixserve.triton_support import require_triton

triton, tl = require_triton()


@triton.jit
def _rows_copy(src_ptr, dst_ptr, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    for r0 in range(pid * ROWS, n_rows, tl.num_programs(0) * ROWS):
        if ROWS == 1:
            tl.store(dst_ptr + r0 * n_cols + cols, tl.load(src_ptr + r0 * n_cols + cols))
        else:
            rows = r0 + tl.arange(0, ROWS)
            at = rows[:, None] * n_cols + cols[None, :]
            m = rows[:, None] < n_rows
            tl.store(dst_ptr + at, tl.load(src_ptr + at, mask=m), mask=m)


@triton.jit
def _tma_copy(src_desc, dst_ptr, n_boxes, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, n_boxes, tl.num_programs(0)):
        v = src_desc.load([b * BM, 0])
        at = (b * BM + tl.arange(0, BM))[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(dst_ptr + at, v)


def _row_copy(src: torch.Tensor, dst: torch.Tensor, rows_a_program: int = 1) -> None:
    rows, cols = src.shape
    warps = max(1, min(16, cols // 512))
    grid = (rows // rows_a_program,)
    _rows_copy[grid](src, dst, rows, cols, ROWS=rows_a_program, BLOCK=cols, num_warps=warps)


@triton.jit
def _tma_push(src_ptr, dst_desc, n_boxes, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    for b in range(pid, n_boxes, tl.num_programs(0)):
        at = (b * BM + tl.arange(0, BM))[:, None] * BN + tl.arange(0, BN)[None, :]
        dst_desc.store([b * BM, 0], tl.load(src_ptr + at))


def _pushers(src: torch.Tensor, dst: torch.Tensor) -> dict:
    """Each rank writes ``src`` (its own) into ``dst`` (the peer's slot)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm = 16
    desc = TensorDescriptor.from_tensor(dst.view(-1, 256), block_shape=[bm, 256])
    n_boxes = dst.numel() // 256 // bm
    return {
        "push row": lambda: _row_copy(src, dst),
        "push tma": lambda: _tma_push[(n_boxes,)](src, desc, n_boxes, BM=bm, BN=256, num_warps=4),
        "push copy_": lambda: dst.copy_(src),
    }


def _copiers(src: torch.Tensor, dst: torch.Tensor) -> dict:
    from triton.tools.tensor_descriptor import TensorDescriptor

    boxes = src.view(-1, 256)
    bm = 16
    desc = TensorDescriptor.from_tensor(boxes, block_shape=[bm, 256])
    n_boxes = boxes.shape[0] // bm
    return {
        "row": lambda: _row_copy(src, dst),
        "row x4": lambda: _row_copy(src, dst, 4),
        "tma": lambda: _tma_copy[(n_boxes,)](desc, dst, n_boxes, BM=bm, BN=256, num_warps=4),
        "copy_": lambda: dst.copy_(src),
    }


def _checked_us(fn, got: torch.Tensor, want: torch.Tensor) -> dict:
    """One copy form on both ranks at once: ``got`` cleared, one call, checked against ``want``, then
    timed graphed. A form that does not run here is reported, not fatal."""
    try:
        got.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        ok = bool(torch.equal(got, want))
        out = {"us": ranks_graph_us(lambda i: fn()), "right": ok}
    except Exception as exc:
        out = {"error": repr(exc)[:200]}
    dist.barrier()
    return out


def _worker(rank: int, size: int, init: str, queue, shapes: list[tuple[int, int]]) -> None:
    join_group(rank, size, init)
    from prefixserve.model.peer_allreduce import PeerAllReduce

    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "probe-nvlink-pull")
    result = []
    for rows, hidden in shapes:
        mine, theirs = peer.fused.views(0, rows, hidden, torch.bfloat16)
        mine.normal_()
        dist.barrier()
        dst = torch.empty_like(mine)
        row = {"rows": rows, "hidden": hidden, "mb": mine.numel() * 2 / 2**20}
        for name, fn in _copiers(theirs, dst).items():
            row[name] = _checked_us(fn, dst, theirs)
        row["local"] = {"us": ranks_graph_us(lambda i, mine=mine, dst=dst: _row_copy(mine, dst))}
        gen = torch.Generator(device=mine.device)
        own, want = torch.empty_like(mine), torch.empty_like(mine)
        own.normal_(generator=gen.manual_seed(rank))
        want.normal_(generator=gen.manual_seed(1 - rank))  # what the peer writes here
        for name, fn in _pushers(own, theirs).items():
            row[name] = _checked_us(fn, mine, want)
        result.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    leave_group(queue, rank, result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", nargs="+", default=["64x4096", "256x4096", "512x4096", "256x8192", "512x8192"]
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    result = run_ranks(_worker, (shapes,))[0]
    forms = ("row", "row x4", "tma", "copy_", "local", "push row", "push tma", "push copy_")
    lines = ["| rows x hidden | MB | " + " | ".join(forms) + " |"]
    lines.append("| --- | ---: |" + " ---: |" * len(forms))
    for r in result:
        cells = []
        for name in forms:
            c = r[name]
            if "us" in c:
                gbs = r["mb"] * 2**20 / (c["us"] * 1e-6) / 1e9
                cells.append(f"{c['us']:.1f} us {gbs:.0f} GB/s" + ("" if c.get("right", True) else " WRONG"))
            else:
                cells.append("error")
        lines.append(f"| {r['rows']}x{r['hidden']} | {r['mb']:.1f} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.json:
        from benchmarks.harness.info import git_commit

        info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": git_commit()}
        args.json.write_text(json.dumps({**info, "rows": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
