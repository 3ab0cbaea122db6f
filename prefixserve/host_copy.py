"""Host arrays onto the GPU through reused page-locked buffers, without waiting for the GPU.

Every step moves its plan (lengths, block tables, write slots, work lists, sampling rows) to the
device. A pageable copy would wait for the work already queued, which undoes launch-ahead, so these
copies go through page-locked memory; taking it with ``pin_memory()`` on each array cost host time per
call (torch's host allocator, a few calls a step; docs/kernels.md §2.11 has the measurement). A ring
of buffers that grow to the largest array seen is reused instead: a buffer is written again only
after the copy that read it has run (an event recorded behind each copy; the ring is deep enough that
the wait is for copies of steps long finished).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

RING = 32  # buffers per device: a step makes about ten copies, launch-ahead keeps two steps in flight
MIN_BYTES = 1 << 16


class _Ring:
    __slots__ = ("buffers", "events", "lock", "next")

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None] * RING
        self.events: list[torch.cuda.Event | None] = [None] * RING  # made once a slot, recorded again
        self.next = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """``nbytes`` of page-locked memory free to write (the copy that last read it has run), and
        their ring slot (``copied`` records the next copy's event there)."""
        i = self.next
        self.next = (i + 1) % RING
        done = self.events[i]
        if done is not None:
            done.synchronize()
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, MIN_BYTES, 2 * (buf.numel() if buf is not None else 0))
            buf = self.buffers[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes], i

    def copied(self, slot: int, device: torch.device) -> None:
        done = self.events[slot]
        if done is None:
            done = self.events[slot] = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))


_RINGS: dict[int, _Ring] = {}
_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    found = _DTYPES.get(dtype)
    if found is None:
        found = _DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return found


def _bytes_to_device(nbytes: int, fill: Callable[[np.ndarray], None], device: torch.device) -> torch.Tensor:
    """``nbytes`` on ``device`` (uint8), written on the host by ``fill`` (given the bytes as a numpy
    array) straight into the page-locked buffer the copy reads: one host copy, no wait."""
    if torch.cuda.is_current_stream_capturing():  # no event waits inside a capture: a one-off buffer
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        fill(raw.numpy())
        return raw.to(device, non_blocking=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _RINGS.get(index)
    if ring is None:
        ring = _RINGS.setdefault(index, _Ring())
    with ring.lock:
        raw, slot = ring.take(nbytes)
        fill(raw.numpy())
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out.copy_(raw, non_blocking=True)
        ring.copied(slot, device)
    return out


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` on ``device``, asynchronously on CUDA (the host goes on at once); elsewhere a tensor
    over the array itself (no copy)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(array).to(device)

    def fill(raw: np.ndarray) -> None:
        raw.view(array.dtype).reshape(array.shape)[...] = array

    moved = _bytes_to_device(array.nbytes, fill, device)
    return moved.view(_torch_dtype(array.dtype)).view(array.shape)


def to_device_packed(
    arrays: list[np.ndarray], device: torch.device | str, dtype: np.dtype | type | None = None
) -> list[torch.Tensor]:
    """Several host arrays on ``device`` in one copy, each in its own shape and dtype (or all cast to
    ``dtype``, in the same pass). Each starts 16-byte aligned in the copy: Triton specialises pointers
    on that, and a start that moved with the sizes before it would compile a step's kernels again for
    each new alignment."""
    device = torch.device(device)
    types = [np.dtype(dtype) if dtype is not None else a.dtype for a in arrays]
    offsets, end = [], 0
    for a, t in zip(arrays, types, strict=True):
        offsets.append(end)
        end += -(-a.size * t.itemsize // 16) * 16

    def fill(raw: np.ndarray) -> None:
        for a, t, at in zip(arrays, types, offsets, strict=True):
            raw[at : at + a.size * t.itemsize].view(t).reshape(a.shape)[...] = a

    if device.type == "cuda":
        moved = _bytes_to_device(end, fill, device)
    else:
        host = np.zeros(end, dtype=np.uint8)
        fill(host)
        moved = torch.from_numpy(host).to(device)
    return [
        moved[at : at + a.size * t.itemsize].view(_torch_dtype(t)).view(a.shape)
        for a, t, at in zip(arrays, types, offsets, strict=True)
    ]


def list_to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list of numbers as a tensor on ``device`` (``to_device`` of its array on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or t.dtype == torch.bfloat16:  # numpy has no bfloat16
        return t.to(device)
    return to_device(t.numpy(), device)


__all__ = ["list_to_device", "to_device", "to_device_packed"]
