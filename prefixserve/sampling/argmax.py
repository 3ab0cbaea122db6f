"""Greedy decoding's argmax over a step's logits, with every SM streaming them.

``torch.argmax`` over [B, 128,256] bf16 logits runs one block per row: at B = 64 that leaves half an
H200's SMs idle, and at B = 256 and 1,024 it read the logits at 1.2-1.5 TB/s (53 and 177 us a
step in kernel profiles). Here each row is cut into chunks so that the grid has several programs
per SM whatever B is: a first kernel writes each chunk's (max, first index of it, first NaN), a
second picks each row's winner. The result is exactly ``torch.argmax``'s: the first index of the
maximum, and the first NaN where a row has one (torch takes NaN as the largest value).
"""

from __future__ import annotations

import functools

import torch

from prefixserve.triton_support.launch import Launch, record, relaunch

BLOCK = 1024  # logits a program loads at once
WARPS = 4
PROGRAMS_PER_SM = 16
MAX_RECORDED = 256  # recorded launch pairs kept (one per logits shape and stream)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NO_INDEX = 2**31 - 1  # "none here" for a chunk's first NaN; vocabularies stay far below it


@functools.cache
def _kernels():
    from prefixserve.triton_support import require_triton

    triton, tl = require_triton()

    @triton.jit
    def chunk_argmax(
        x_ptr,
        stride_x,
        vocab,
        chunk,
        max_ptr,
        idx_ptr,
        nan_ptr,
        splits,
        BLOCK: tl.constexpr,
        NONE: tl.constexpr,
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
        lo = part * chunk
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], NONE, tl.int32)
        first_nan = tl.full([BLOCK], NONE, tl.int32)
        base = x_ptr + row.to(tl.int64) * stride_x
        for start in range(lo, tl.minimum(lo + chunk, vocab), BLOCK):
            idx = start + tl.arange(0, BLOCK)
            v = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            nan = v != v
            first_nan = tl.where(nan & (first_nan == NONE), idx, first_nan)
            better = v > best  # strict: each lane keeps the first index of its maximum
            best_i = tl.where(better | ((best_i == NONE) & (idx < vocab)), idx, best_i)
            best = tl.where(better, v, best)
        top = tl.max(best, 0)
        top_i = tl.min(tl.where(best == top, best_i, NONE), 0)
        out = row * splits + part
        tl.store(max_ptr + out, top)
        tl.store(idx_ptr + out, top_i)
        tl.store(nan_ptr + out, tl.min(first_nan, 0))

    @triton.jit
    def pick_rows(max_ptr, idx_ptr, nan_ptr, out_ptr, splits, SPLITS: tl.constexpr, NONE: tl.constexpr):
        row = tl.program_id(0)
        parts = tl.arange(0, SPLITS)
        ok = parts < splits
        m = tl.load(max_ptr + row * splits + parts, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + row * splits + parts, mask=ok, other=NONE)
        n = tl.min(tl.load(nan_ptr + row * splits + parts, mask=ok, other=NONE), 0)
        top = tl.max(m, 0)
        winner = tl.min(tl.where(m == top, i, NONE), 0)
        tl.store(out_ptr + row, tl.where(n < NONE, n, winner).to(tl.int64))

    return triton, chunk_argmax, pick_rows


_RECORDED: dict[tuple, tuple[Launch, Launch]] = {}  # shape key -> the two launches of its first call


@functools.cache
def _programs_wanted(device_index: int) -> int:
    """Programs that keep every SM streaming."""
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def splits_for(rows: int, vocab: int, programs: int, block: int = BLOCK) -> int:
    """Chunks a row is cut into: enough for ``programs`` in all, none shorter than a block."""
    return max(1, min(-(-programs // max(rows, 1)), -(-vocab // block)))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """``logits.argmax(-1)``; through ``kernel_argmax`` for 16- and 32-bit float logits on the current
    CUDA device (with Triton), else torch (fp64 would lose exactness in the kernels' fp32)."""
    from prefixserve.triton_support import triton_available

    if (
        logits.is_cuda
        and logits.dim() == 2
        and logits.dtype in KERNEL_DTYPES
        and triton_available()
        and logits.device.index == torch.cuda.current_device()  # where the launches go
    ):
        return kernel_argmax(logits, _programs_wanted(logits.device.index))
    return logits.argmax(-1)


def kernel_argmax(
    logits: torch.Tensor, programs: int, block: int = BLOCK, warps: int = WARPS
) -> torch.Tensor:  # [R, V] -> [R] int64
    """``logits.argmax(-1)`` by the two kernels, each row cut so that about ``programs`` run, each
    loading ``block`` logits at a time (on CUDA, or on the CPU under the Triton interpreter).

    On CUDA the first call of a shape on a stream records both launches (``triton_support/launch.py``)
    with their chunk buffers; later calls relaunch them with the new logits and output (this runs
    eagerly once a step, beside the decode graphs), in that stream's order, so the buffers are free
    again by then. The records drop the logits and the output after each launch, so they keep no
    step's tensors alive."""
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0 or vocab >= NO_INDEX:
        return logits.argmax(-1)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream if logits.is_cuda else 0
    key = (rows, vocab, logits.stride(0), logits.dtype, dev, stream, programs, block, warps)
    recorded = _RECORDED.get(key)
    if recorded is not None:
        relaunch(recorded[0], [(0, logits)])
        relaunch(recorded[1], [(3, out)])
        _forget(recorded)
        return out
    triton, chunk_argmax, pick_rows = _kernels()
    splits = splits_for(rows, vocab, programs, block)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    splits = triton.cdiv(vocab, chunk)  # no empty chunks
    part_max = torch.empty(rows * splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(rows * splits, dtype=torch.int32, device=dev)
    part_nan = torch.empty(rows * splits, dtype=torch.int32, device=dev)
    first = (logits, logits.stride(0), vocab, chunk, part_max, part_idx, part_nan, splits)
    first_kw = {"BLOCK": block, "NONE": NO_INDEX, "num_warps": warps}
    second = (part_max, part_idx, part_nan, out, splits)
    second_kw = {"SPLITS": triton.next_power_of_2(splits), "NONE": NO_INDEX, "num_warps": 1}
    first_ck = chunk_argmax[(rows, splits)](*first, **first_kw)
    second_ck = pick_rows[(rows,)](*second, **second_kw)
    if len(_RECORDED) >= MAX_RECORDED:  # batch sizes come and go; keep the table small
        _RECORDED.clear()
    recorded = (
        record(chunk_argmax, (rows, splits), first, first_kw, first_ck),
        record(pick_rows, (rows,), second, second_kw, second_ck),
    )
    _forget(recorded)
    _RECORDED[key] = recorded  # under the interpreter too: its relaunches take Triton's own path
    return out


def _forget(recorded: tuple[Launch, Launch]) -> None:
    """Drop a call's logits and output from its records (the next call swaps its own in)."""
    recorded[0].args[0] = None
    recorded[1].args[3] = None


__all__ = ["argmax_rows", "kernel_argmax", "splits_for"]
