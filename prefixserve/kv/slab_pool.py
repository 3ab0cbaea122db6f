"""Pinned host slots for evicted prefix-cache blocks, in slabs allocated once and reused, never freed.

A pinned allocation (``cudaHostAlloc``) costs milliseconds per 100 MB and takes the driver's locks; a
new pinned buffer per eviction (an 8B model's 2K-token document is 256 MiB) made spilling slower than
recomputing on an H100. Here a block's host copy lives in a slot: one block-sized piece of a slab
(a page-aligned buffer of ``slab_slots`` blocks, pinned on CUDA). Slabs are made up to ``capacity``
slots (all at once with ``prealloc``, else as slots run out) and kept for the pool's lifetime.

Slots go back in a FIFO ring with the event of the last copy that read them (``release``), and
``acquire`` hands out the oldest first, so consecutive slots released together come back together:
a spill's blocks land in runs of consecutive slots, each run one copy. A slot whose reading copy may
still run comes with that event, which the writer waits on on the device (``CopyStream.copy_out``):
no host wait, and no write overtakes the read.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch

from prefixserve.kv.transfer import Ready, aligned_bytes

SLAB_BYTES = 64 << 20  # one pinned allocation: large enough that slabs are few, small enough to grow by


class SlabPool:
    """``capacity`` host slots of ``shape`` / ``dtype`` in slabs of ``slab_slots``; slot ids are
    ``slab * slab_slots + index``, so consecutive ids in one slab are one contiguous run of memory."""

    def __init__(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        capacity: int,
        pin: bool,
        slab_slots: int | None = None,
        prealloc: bool = False,
    ) -> None:
        self.shape, self.dtype, self.pin = tuple(shape), dtype, pin
        self.capacity = max(0, int(capacity))
        self.slot_bytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        per_slab = slab_slots or max(1, SLAB_BYTES // max(1, self.slot_bytes))
        self.slab_slots = max(1, min(per_slab, self.capacity or 1))
        self.slabs: list[torch.Tensor] = []  # each [slab_slots, *shape]
        self._free: deque[tuple[int, Ready | None]] = deque()  # (slot, last reader's event), oldest first
        self._in_use = 0
        if prealloc:
            while self._grow():
                pass

    @property
    def allocations(self) -> int:
        """Pinned (or page-aligned) buffers allocated so far: one per slab, never more."""
        return len(self.slabs)

    @property
    def available(self) -> int:
        """Slots ``acquire`` can hand out now (free ones and ones not yet allocated)."""
        return self.capacity - self._in_use

    def _grow(self) -> bool:
        made = len(self.slabs) * self.slab_slots
        count = min(self.slab_slots, self.capacity - made)
        if count <= 0:
            return False
        raw = aligned_bytes(self.slab_slots * self.slot_bytes, self.pin)
        self.slabs.append(raw.view(self.dtype).view(self.slab_slots, *self.shape))
        self._free.extend((made + i, None) for i in range(count))
        return True

    def acquire(self, count: int) -> tuple[list[int], list[Ready]]:
        """``count`` slots, oldest released first, and the distinct events of their last reads (wait
        on them before writing). Raises if fewer than ``count`` are available."""
        if count > self.available:
            raise RuntimeError(f"asked for {count} host slots, {self.available} available")
        while len(self._free) < count and self._grow():
            pass
        slots, waits, seen = [], [], set()
        for _ in range(count):
            slot, ready = self._free.popleft()
            slots.append(slot)
            if ready is not None and id(ready) not in seen:
                seen.add(id(ready))
                waits.append(ready)
        self._in_use += count
        return slots, waits

    def release(self, slots: Sequence[int], ready: Ready | None = None) -> None:
        """Slots back to the ring; ``ready``: the event after the last copy that reads them."""
        self._free.extend((slot, ready) for slot in slots)
        self._in_use -= len(slots)

    def view(self, slot: int) -> torch.Tensor:
        """The slot's memory as a ``shape`` tensor (a view: writes reach the slab)."""
        slab, index = divmod(slot, self.slab_slots)
        return self.slabs[slab][index]

    def runs(self, slots: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """(first position in ``slots``, ``[n, *shape]`` view) of each run of consecutive ids in one slab."""
        out: list[tuple[int, torch.Tensor]] = []
        i = 0
        while i < len(slots):
            slab, index = divmod(slots[i], self.slab_slots)
            j = i + 1
            while j < len(slots) and slots[j] == slots[i] + (j - i) and index + (j - i) < self.slab_slots:
                j += 1
            out.append((i, self.slabs[slab][index : index + (j - i)]))
            i = j
        return out
