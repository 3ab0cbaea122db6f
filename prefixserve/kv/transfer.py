"""Copies of packed KV between host memory and the device, on a side stream of their own.

A copy on the stream the steps run on waits for every step queued ahead of it and holds back every
step queued after it. On its own stream it overlaps them: the step that reads the copied KV waits on
an event (``wait_event``: the device waits, the host goes on), never on a device-wide sync.

- ``copy_stream(device)``: the one ``CopyStream`` of a device (None's worth of work on a CPU).
- ``CopyStream.to_device`` / ``to_device_blocks``: host -> device, in as few and as large copies as
  the source allows (a pinned source goes straight; a pageable one through reused pinned slots).
- ``CopyStream.copy_all``: host -> device into memory the caller owns (KV pool blocks, a layer at a
  time: ``kv/landing.py``), one event after the lot; ``follow_current`` orders it after the steps.
- ``CopyStream.to_host``: device -> pinned host, returning the event that says the bytes are there.
- ``CopyStream.copy_out``: device -> host into a buffer the caller owns (a ``SlabPool`` slot run).
- ``Slots``: a few page-aligned (pinned on CUDA) buffers reused for staging, each with the event of
  the last copy out of it, so a slot is never refilled while the device still reads it.
"""

from __future__ import annotations

import functools
import mmap
import queue
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

ALIGN = 4096  # page and O_DIRECT block alignment of staging buffers


class Ready(Protocol):
    """What says a copy has finished: a ``torch.cuda.Event`` (``synchronize`` waits for that copy alone)."""

    def synchronize(self) -> None: ...


def aligned_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose first byte is ALIGN-aligned (pinned if ``pin``).

    Pinned: the host allocator's blocks are page-aligned in practice; one that is not is allocated
    again ALIGN bytes larger and sliced. Else an anonymous mapping, page-aligned by the kernel."""
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return raw
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = -raw.data_ptr() % ALIGN
        return raw[skip : skip + nbytes]
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]  # the tensor keeps ``buf`` alive


@dataclass(slots=True)
class Slot:
    buf: torch.Tensor  # uint8, ALIGN-aligned
    ready: Ready | None = None  # the last copy out of ``buf``; wait before writing it again


class Slots:
    """``count`` staging buffers of ``nbytes`` each, handed out and back across threads."""

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self._free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(Slot(aligned_bytes(nbytes, pin)))

    def acquire(self) -> Slot:
        """A free slot whose last copy out has finished (blocks until one is)."""
        slot = self._free.get()
        if slot.ready is not None:
            slot.ready.synchronize()
            slot.ready = None
        return slot

    def release(self, slot: Slot, ready: Ready | None = None) -> None:
        slot.ready = ready
        self._free.put(slot)


class CopyStream:
    """The side stream of one device for KV copies; on a CPU every method is a plain copy or none."""

    def __init__(self, device: torch.device, slots: int = 4, slot_bytes: int = 16 << 20) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._slot_args = (slots, slot_bytes)
        self._slots: Slots | None = None  # pinned slots for pageable sources, made on first use

    @property
    def slots(self) -> Slots:
        if self._slots is None:
            count, nbytes = self._slot_args
            self._slots = Slots(count, nbytes, pin=self.cuda)
        return self._slots

    # ---- events -----------------------------------------------------------------------------------
    def record(self) -> Ready | None:
        """An event after everything enqueued on the copy stream so far (None on a CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, ready: Ready | None) -> None:
        """Make the current stream wait for ``ready`` (the device waits; the host does not)."""
        if ready is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(ready)  # type: ignore[arg-type]

    def hand_over(self, tensor: torch.Tensor, ready: Ready | None) -> torch.Tensor:
        """``tensor``, written on the copy stream, made safe to use on the current stream."""
        if self.cuda:
            self.wait(ready)
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor

    # ---- host -> device ---------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A device tensor to copy into, allocated on the copy stream (use ``hand_over`` after)."""
        if self.stream is None:
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        with torch.cuda.stream(self.stream):
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> Ready | None:
        """Enqueue ``dst.copy_(src)`` (host -> device) on the copy stream; the event after it.

        Any thread may call it. ``src`` must stay unchanged until the event (a pinned source is read by
        the device asynchronously); a pageable source is copied before this returns."""
        if self.stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def follow_current(self) -> None:
        """Order the copy stream's later work after everything queued so far on the current stream (a
        copy into memory that work may still read or write). Nothing on a CPU."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy_all(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Ready | None:
        """Enqueue ``dst.copy_(src)`` (pinned host -> device, both contiguous) for each pair on the copy
        stream; the event after the last. On a CPU they are plain copies, done on return (None)."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return self.record()

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` (host, contiguous) on the device, ready for the current stream: one copy if pinned,
        else copies of ``Slots``-sized pieces through reused pinned slots (no pinned allocation)."""
        if src.device == self.device or not self.cuda:
            return src.to(self.device)
        src = src.contiguous()
        dst = self.empty(src.shape, src.dtype)
        if src.is_pinned():
            return self.hand_over(dst, self.copy_in(dst, src))
        self._staged(dst, src)
        return self.hand_over(dst, self.record())

    def to_device_blocks(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Equal-shaped host parts stacked on the device (``[len(parts), *shape]``), ready for the current
        stream. Parts lying back to back in one storage (one spill's blocks) go in one copy."""
        return self.hand_over(*self.to_device_blocks_async(parts))

    def to_device_blocks_async(self, parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Ready | None]:
        """``to_device_blocks`` without the hand-over: the device tensor and the event after its copies
        (one per run of parts back to back in one storage; a CPU makes the same copies, plainly).
        Pass both to ``hand_over`` before the current stream reads the tensor."""
        if not parts:
            raise ValueError("no parts to copy")
        shape, dtype = tuple(parts[0].shape), parts[0].dtype
        dst = self.empty((len(parts), *shape), dtype)
        for start, run in _runs(parts):
            piece = dst[start : start + run.shape[0]]
            if not self.cuda or run.is_pinned():
                self.copy_in(piece, run)
            else:
                self._staged(piece, run.contiguous())
        return dst, self.record()

    def _staged(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` for a pageable ``src`` through the pinned slots, a slot at a time:
        the host fills one slot while the device empties the one before."""
        flat_src, flat_dst = _bytes(src), _bytes(dst)
        step = self.slots.nbytes
        for start in range(0, flat_src.numel(), step):
            piece = flat_src[start : start + step]
            slot = self.slots.acquire()
            staged = slot.buf[: piece.numel()]
            staged.copy_(piece)
            self.slots.release(slot, self.copy_in(flat_dst[start : start + piece.numel()], staged))

    # ---- device -> host ---------------------------------------------------------------------------
    def to_host(self, src: torch.Tensor) -> tuple[torch.Tensor, Ready | None]:
        """``src`` (on the device, written on the current stream) copied to a new pinned host tensor on
        the copy stream, after the work queued so far on the current stream; and the event after the
        copy. The host does not wait: read the tensor on the host only after ``ready.synchronize()``
        (on the device, work on the copy stream is ordered after it anyway)."""
        if not self.cuda:
            return (src if src.device.type == "cpu" else src.cpu()), None
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # src is made there
        with torch.cuda.stream(self.stream):
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)
            ready = self.record()
        src.record_stream(self.stream)  # its memory is not reused before the copy has read it
        return host, ready

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, waits: Sequence[Ready] = ()) -> None:
        """Enqueue ``dst.copy_(src)`` (device -> a host buffer the caller owns, pinned on CUDA) on the copy
        stream, after the work queued so far on the current stream (``src`` is made there) and after
        ``waits`` (the events of the last copies that read ``dst``: the device waits, not the host).
        Call ``record`` after the last of a batch for the event that says the bytes are there."""
        if not self.cuda:
            dst.copy_(src)
            return
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for ready in waits:
            self.stream.wait_event(ready)  # type: ignore[arg-type]
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _runs(parts: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(first index, tensor) of each run of parts that lie back to back in one storage, as one tensor."""
    out: list[tuple[int, torch.Tensor]] = []
    i = 0
    while i < len(parts):
        first = parts[i]
        j = i + 1
        if first.is_contiguous():
            size = first.numel() * first.element_size()
            while (
                j < len(parts)
                and parts[j].is_contiguous()
                and parts[j].untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and parts[j].data_ptr() == first.data_ptr() + (j - i) * size
            ):
                j += 1
        if j - i == 1:
            out.append((i, first.unsqueeze(0)))
        else:
            shape = (j - i, *first.shape)
            stride = (first.numel(), *first.stride())
            out.append((i, first.as_strided(shape, stride, first.storage_offset())))
        i = j
    return out


@functools.cache
def copy_stream(device: torch.device | str) -> CopyStream:
    """The one copy stream of ``device`` (one per process and device: every tier shares it)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return CopyStream(dev)
