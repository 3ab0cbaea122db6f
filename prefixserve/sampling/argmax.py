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
from dataclasses import dataclass

import torch

from prefixserve.triton_support.launch import Launch, raw_stream, record, relaunch

BLOCK = 1024  # logits a program loads at once
WARPS = 4
PROGRAMS_PER_SM = 16
MAX_RECORDED = 256  # recorded launch pairs kept (one per logits shape and stream)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NO_INDEX = 2**31 - 1  # "none here" for a chunk's first NaN; vocabularies stay far below it


@functools.cache
def _kernels():
    """(triton, chunk_argmax, pick_rows, flagged_chunk_argmax), imported at the first use (the engine
    imports no Triton kernel until a step needs one)."""
    from prefixserve.sampling import argmax_kernels as k

    return k.triton, k.chunk_argmax, k.pick_rows, k.flagged_chunk_argmax


_RECORDED: dict[tuple, tuple[Launch, Launch]] = {}  # shape key -> the two launches of its first call


@functools.cache
def programs_wanted(device_index: int) -> int:
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
        return kernel_argmax(logits, programs_wanted(logits.device.index))
    return logits.argmax(-1)


@dataclass(slots=True)
class FlaggedMask:
    """A token bitmask that another process writes into pinned host memory, and the flag it sets
    after (``structured/gate.py``): ``kernel_argmax`` waits on the device for the flag to hold
    ``number``, then chooses rows ``< rows`` among the tokens their words allow."""

    words: torch.Tensor  # int32 [>= rows, ceil(vocab / 32)], pinned host, rows contiguous
    rows: int  # rows masked; the rest (speculated rows) are not
    flag: torch.Tensor  # int64 [1], pinned host: the fill's number once its rows are written
    number: int  # below 2**31 (the kernel takes it as a 32-bit integer)
    seen: torch.Tensor  # int64 [1], pinned host: the flag the wait saw
    late: torch.Tensor  # int64 [1], pinned host: set where a program masked without the verdict
    spins: torch.Tensor  # int64 [1], device: how long the wait spun
    go: torch.Tensor  # int64 [1], device: the waiting program's verdict for the others
    limit: int  # the wait's bound: ns of the GPU's clock where ``timed``, else spins
    timed: bool


def kernel_argmax(
    logits: torch.Tensor,
    programs: int,
    block: int = BLOCK,
    warps: int = WARPS,
    flagged: FlaggedMask | None = None,
) -> torch.Tensor:  # [R, V] -> [R] int64
    """``logits.argmax(-1)`` by the two kernels, each row cut so that about ``programs`` run, each
    loading ``block`` logits at a time (on CUDA, or on the CPU under the Triton interpreter).
    ``flagged``: the argmax of the logits its bitmask allows, once its flag is set (one launch where
    a wait, the mask and the argmax were three).

    On CUDA the first call of a shape on a stream records both launches (``triton_support/launch.py``)
    with their chunk buffers; later calls relaunch them with the new logits and output (this runs
    eagerly once a step, beside the decode graphs), in that stream's order, so the buffers are free
    again by then. The records drop the logits and the output after each launch, so they keep no
    step's tensors alive."""
    rows, vocab = logits.shape
    if flagged is None and (rows == 0 or vocab == 0 or vocab >= NO_INDEX):
        return logits.argmax(-1)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    stream = raw_stream(dev.index) if logits.is_cuda else 0
    key = (rows, vocab, logits.stride(0), logits.dtype, dev, stream, programs, block, warps)
    if flagged is not None:
        if block % 32:
            raise ValueError(
                f"a flagged argmax reads 32-token mask words: block {block} is not a multiple of 32"
            )
        key += (flagged.words.stride(0), flagged.rows, flagged.limit, flagged.timed)
    recorded = _RECORDED.get(key)
    if recorded is not None:
        first, second = recorded
        if flagged is not None:
            first.args[_NUMBER] = flagged.number
        relaunch(first, [(0, logits), *_flagged_tensors(flagged)])
        relaunch(second, [(3, out)])
        _forget(recorded)
        return out
    triton, chunk_argmax, pick_rows, flagged_chunk_argmax = _kernels()
    splits = splits_for(rows, vocab, programs, block)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    splits = triton.cdiv(vocab, chunk)  # no empty chunks
    part_max = torch.empty(rows * splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(rows * splits, dtype=torch.int32, device=dev)
    part_nan = torch.empty(rows * splits, dtype=torch.int32, device=dev)
    first = (logits, logits.stride(0), vocab, chunk, part_max, part_idx, part_nan, splits)
    first_kw = {"BLOCK": block, "NONE": NO_INDEX, "num_warps": warps}
    if flagged is not None:
        chunk_argmax = flagged_chunk_argmax
        f = flagged
        first += (f.words, f.words.stride(0), f.rows, f.flag, f.number, f.limit)
        first += (f.seen, f.late, f.spins, f.go)
        first_kw["TIMED"] = f.timed
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


_NUMBER = 12  # the flagged chunk kernel's ``number``: set in its record before each relaunch
_FLAGGED = (8, 11, 14, 15, 16, 17)  # its tensors after the logits: words, flag, seen, late, spins, go


def _flagged_tensors(flagged: FlaggedMask | None) -> list[tuple[int, torch.Tensor]]:
    if flagged is None:
        return []
    f = flagged
    return list(zip(_FLAGGED, (f.words, f.flag, f.seen, f.late, f.spins, f.go), strict=True))


def _forget(recorded: tuple[Launch, Launch]) -> None:
    """Drop a call's tensors from its records (the next call swaps its own in): the logits, the
    output, and a flagged call's host words and flags."""
    first, second = recorded
    first.args[0] = None
    if len(first.args) > _FLAGGED[-1]:  # (a plain record's arguments end before them)
        for i in _FLAGGED:
            first.args[i] = None
    second.args[3] = None


__all__ = ["FlaggedMask", "argmax_rows", "kernel_argmax", "programs_wanted", "splits_for"]
