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

import numpy as np
import torch

RING = 32  # buffers per device: a step makes about ten copies, launch-ahead keeps two steps in flight
MIN_BYTES = 1 << 16


class _Ring:
    __slots__ = ("buffers", "events", "lock", "next")

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None] * RING
        self.events: list[torch.cuda.Event | None] = [None] * RING
        self.next = 0
        self.lock = threading.Lock()

    def stage(self, array: np.ndarray) -> tuple[torch.Tensor, int]:
        """A page-locked tensor holding ``array``'s values, and its ring slot (for its copy's event)."""
        i = self.next
        self.next = (i + 1) % RING
        done = self.events[i]
        if done is not None:
            done.synchronize()
        buf = self.buffers[i]
        if buf is None or buf.numel() < array.nbytes:
            size = max(array.nbytes, MIN_BYTES, 2 * (buf.numel() if buf is not None else 0))
            buf = self.buffers[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host = buf[: array.nbytes].view(_torch_dtype(array.dtype)).view(array.shape)
        np.copyto(host.numpy(), array, casting="no")
        return host, i


_RINGS: dict[int, _Ring] = {}
_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    found = _DTYPES.get(dtype)
    if found is None:
        found = _DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return found


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` on ``device``, asynchronously on CUDA (the host goes on at once); elsewhere a tensor
    over the array itself (no copy)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(array).to(device)
    array = np.ascontiguousarray(array)
    if torch.cuda.is_current_stream_capturing():  # no event waits inside a capture: a one-off buffer
        return torch.from_numpy(array).pin_memory().to(device, non_blocking=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _RINGS.get(index)
    if ring is None:
        ring = _RINGS.setdefault(index, _Ring())
    with ring.lock:
        host, slot = ring.stage(array)
        out = torch.empty(array.shape, dtype=host.dtype, device=device)
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        ring.events[slot] = done
    return out


def to_device_packed(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Several host arrays on ``device`` in one copy, each in its own dtype and shape. Each starts
    16-byte aligned in the copy: Triton specialises pointers on that, and a start that moved with the
    sizes before it would compile a step's kernels again for each new alignment."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // 16) * 16
    flat = np.zeros(end, dtype=np.uint8)
    for a, at in zip(arrays, offsets, strict=True):
        flat[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    moved = to_device(flat, device)
    return [
        moved[at : at + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
        for a, at in zip(arrays, offsets, strict=True)
    ]


def list_to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list of numbers as a tensor on ``device`` (``to_device`` of its array on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or t.dtype == torch.bfloat16:  # numpy has no bfloat16
        return t.to(device)
    return to_device(t.numpy(), device)


__all__ = ["list_to_device", "to_device", "to_device_packed"]
