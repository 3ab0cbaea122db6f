"""A hybrid's prefix snapshots evicted from the device spill to host memory and come back on a hit.

The prefix cache's host tier (``kv/prefix_spill.py``) keeps the full layers' KV blocks that the pool
evicts; a hit on them resumes a linear-attention hybrid only from a snapshot of its linear layers'
states at a boundary within the hit (``kv/state_slots.py``). So the snapshots the device evicts
(least recently used) are copied to host memory too, keyed by the same block digest, and a hit whose
last snapshot is there copies it straight into the sequence's state slot.

Host memory: a ``SlabPool`` of one slot per snapshot (the slot's every linear layer, convolution
inputs then fp32 state, packed as bytes), pinned and allocated at start on CUDA (a pinned allocation
per eviction would stall the step assembling it), grown as snapshots arrive on a CPU; at most
``capacity_bytes`` of them (half the host tier's budget, ``module_host_bytes``: the KV blocks take
the other half), the oldest given up first. Every copy runs on the current stream in the
order the engine issues it: a snapshot's copy out is issued as the step that will overwrite its
device slot is assembled, before that step's forward (and after any step still in flight, launched
ahead); a copy in before the forward of the step that resumes from it. The host never reads the
memory, so no event is waited on.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from prefixserve.kv.slab_pool import SlabPool

ALIGN = 16  # bytes: each layer's tensors start aligned within a slot


class SnapshotSpill:
    """Host copies of evicted snapshots, least recently spilled or used given up first."""

    def __init__(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]], capacity_bytes: int) -> None:
        """``layers``: the state pool's tensors per linear layer, (conv [N, ...], state [N, ...])."""
        self.tensors = [t for pair in layers.values() for t in pair]
        self.places: list[tuple[int, int]] = []  # each tensor's (offset, bytes) in a slot
        at = 0
        for t in self.tensors:
            size = t[0].numel() * t.element_size()
            self.places.append((at, size))
            at += -(-size // ALIGN) * ALIGN
        self.slot_bytes = max(at, ALIGN)
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        capacity = capacity_bytes // self.slot_bytes
        cuda = device.type == "cuda"  # pinned slabs made at start: one per eviction stalls the step
        self.slots = SlabPool((self.slot_bytes,), torch.uint8, capacity, pin=cuda, prealloc=cuda)
        self._held: OrderedDict[bytes, int] = OrderedDict()  # digest -> host slot, oldest first
        self.spilled = self.restored = 0

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def __contains__(self, digest: object) -> bool:
        return digest in self._held

    def _views(self, slot: int) -> list[torch.Tensor]:
        flat = self.slots.view(slot)
        return [
            flat[at : at + size].view(t.dtype).view(t.shape[1:])
            for t, (at, size) in zip(self.tensors, self.places, strict=True)
        ]

    def save(self, digest: bytes, slot: int) -> None:
        """Copy device slot ``slot``'s states to host memory under ``digest`` (no wait)."""
        if self.slots.capacity == 0:
            return
        if digest in self._held:
            self._held.move_to_end(digest)
            return
        if self.slots.available == 0:
            _, oldest = self._held.popitem(last=False)
            self.slots.release([oldest])
        (host,), _ = self.slots.acquire(1)
        for view, t in zip(self._views(host), self.tensors, strict=True):
            view.copy_(t[slot], non_blocking=True)
        self._held[digest] = host
        self.spilled += 1

    def restore(self, digest: bytes, slot: int) -> None:
        """Copy the host snapshot of ``digest`` into device slot ``slot`` (it stays held)."""
        host = self._held[digest]
        self._held.move_to_end(digest)
        for view, t in zip(self._views(host), self.tensors, strict=True):
            t[slot].copy_(view, non_blocking=True)
        self.restored += 1

    def forget(self) -> int:
        """Drop every snapshot held (a prefix-cache reset)."""
        n = len(self._held)
        self.slots.release(list(self._held.values()))
        self._held.clear()
        return n


__all__ = ["SnapshotSpill"]
