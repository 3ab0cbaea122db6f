"""Host-tier KV landing in pool blocks a layer at a time, so the prefill that reads it overlaps the copy.

A Prompt Cache module restored from host memory used to go to the device in one copy of all its
layers, then one scatter into its blocks, and the prefill that reads it waited for both: copy, then
compute (issue 54: 5K module tokens of an 8B model, 671 MB, took 12.2 ms to copy at the machine's
pinned rate, on top of the 12.4 ms first token with the modules already on the GPU). Here the rows
go straight into their blocks on the copy stream, a layer at a time, with one event per layer, and
the forward waits for a layer's event just before that layer touches the cache (``before_layer``:
the device waits, the host does not). Layer L's copy overlaps the compute of the layers before it,
so the prefill ends about a layer's compute after the last copy instead of a whole prefill after it.

- ``KVCache.scatter_rows_layered`` queues an entry (``queue``); ``issue`` enqueues every queued
  copy layer-major (layer 0 of all of them, then layer 1, ...). A request's modules are restored
  one at a time: copied one module after another, layer 0 of the last one would land only with the
  whole copy. ``PromptModules`` issues once a prompt's pieces are placed, at admission: the host's
  time issuing the copies passes while the copy engine works through the first ones and before the
  step is planned. Anything still queued is issued by the next forward (``hook``) or ``settle``.
- One copy per layer, K or V, and run of rows that follow one another both in host memory and in
  the pool. Pool rows are ``[layers, 2, slots, ...]`` and packed rows ``[layers, 2, rows, ...]``, so
  one layer's K (or V) rows of a run of blocks are one contiguous range on both sides. A strided
  view (several layers, or K and V, at once) is no single DMA: PyTorch copies a non-contiguous
  host-to-device pair through a contiguous device temporary and a copy kernel (ATen's
  ``copy_requires_temporaries``), which costs device memory and puts a kernel on the copy stream.
- Several entries in one copy. One copy per entry made the 8B model's 5K module tokens (10 modules
  of 512) 640 copies of ~1 MiB: 46.6 GB/s, 84% of the pinned rate that one large copy reaches, and
  a few microseconds of host time each before the copy engine may start it. ``PromptModules``
  moves pieces to the host together into one allocation, each from a block boundary
  (``_demote``), and brings a prompt's pieces back into one run of blocks (``_bring_up``): an
  entry whose first run continues the copy queued last (same host allocation and strides, its rows
  and its slots each after the last ones with the same gap, shorter than a block) joins it
  (``_joined``), so a schema's modules restored in schema order land in 2 x layers copies. The gap
  is the hole rows of the earlier entry's last block, which the joined copy fills with the host's
  padding rows (the pool's own rows at the demotion; no table reads a hole). Anything else keeps
  a copy of its own.
- A copy costs the host some microseconds to issue, so entries whose copies would be small (a few
  scattered blocks, not joining the copy before them) keep ``scatter_rows``' one copy and one
  scatter (``worth_layering``).
- Events are per layer, not per group of layers: the copies are per layer anyway, an event costs
  microseconds, and the smaller the last unit, the shorter the prefill's tail after the copy.

Ordering. ``issue`` first makes the copy stream wait for the current stream (``follow_current``):
fresh blocks may have been freed by a sequence whose last step is still in flight (so the copy
starts after the steps already queued, where the whole copy into a temporary overlapped them). A
forward calls ``before_layer(l)`` before layer ``l`` writes or reads the cache
(``LlamaForCausalLM.forward``; ``PiecewiseGraphs.run`` before piece l, which also holds layer l-1's
MLP: a layer's dense work more in the tail, for one rule with no exception). Everything else that
touches the pool on the current stream calls ``settle`` first (``KVCache``'s gathers, scatters and
block copies, if their blocks are pending; a decode step replayed from one CUDA graph; the
KV-deviation probe), which issues what is queued and waits for every layer. With nothing pending
``hook`` returns None, and a forward checks one None per layer.

On a CPU ``issue`` makes plain copies, done on return: nothing is left pending.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixserve.kv.transfer import Ready

# On CUDA, an entry lands layer by layer only if its copies average at least this many bytes: below
# it the host's time to issue a copy (some microseconds) outruns the copy itself.
MIN_COPY_BYTES = 256 << 10

Run = tuple[int, int, int]  # (first row, end row, first slot) of a run of consecutive blocks


def block_runs(blocks: Sequence[int], rows: int, block_size: int) -> list[Run]:
    """The runs of consecutive block ids in ``blocks`` (which hold ``rows`` rows, in order)."""
    runs: list[Run] = []
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        runs.append((i * block_size, min(j * block_size, rows), blocks[i] * block_size))
        i = j
    return runs


def worth_layering(runs: Sequence[Run], row_bytes: int, cuda: bool, joins: bool = False) -> bool:
    """Copy layer by layer? On CUDA when the copies average ``MIN_COPY_BYTES`` (``row_bytes``: one
    row of one layer's K); on a CPU always (plain copies, no issue cost to amortise). ``joins``: the
    first run extends the copy queued before it (``Landing.joins``), so it costs no copy of its own."""
    if not runs:
        return False
    copies = len(runs) - joins
    if not cuda or copies == 0:
        return True
    rows = runs[-1][1]
    return rows * row_bytes >= MIN_COPY_BYTES * copies


def rows_contiguous(packed: torch.Tensor) -> bool:
    """Is each layer's K (and V) of ``packed`` ``[layers, 2, rows, kv_heads, head_dim]`` one contiguous
    range (a whole tensor, or a row range of a larger one: the host tier's entries packed together)?"""
    _, _, _, heads, dim = packed.shape
    return packed.stride()[2:] == (heads * dim, dim, 1)


class Copier(Protocol):
    """What ``Landing`` needs of the copy stream (``kv.transfer.CopyStream``)."""

    def follow_current(self) -> None: ...
    def copy_all(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Ready | None: ...
    def wait(self, ready: Ready | None) -> None: ...


@dataclass(slots=True)
class _Copy:
    """One copy per layer and K or V: rows ``first:end`` of ``src`` into the pool from ``slot`` on."""

    src: torch.Tensor  # [layers, 2, >= end, kv_heads, head_dim] on the host (pinned on CUDA)
    first: int
    end: int
    slot: int


class Landing:
    """Copies into the pool queued, issued, and still landing, and each layer's events."""

    def __init__(self, pool: torch.Tensor, copier: Copier, block_size: int) -> None:
        self.pool = pool  # [layers, 2, slots, kv_heads, head_dim]: the cache's rows (a view)
        self.copier = copier
        self.block_size = block_size
        self.layers = pool.shape[0]
        self._queued: list[_Copy] = []
        self._events: list[list[Ready]] = [[] for _ in range(self.layers)]  # issued, not waited for
        self._blocks: set[int] = set()  # blocks with copies queued or not yet waited for
        self.copies = 0  # copies issued (tests and probes)

    @property
    def pending(self) -> bool:
        """Are copies queued, or issued and not yet waited for by the current stream?"""
        return bool(self._blocks)

    def joins(self, src: torch.Tensor, runs: Sequence[Run]) -> bool:
        """Would ``src``'s first run extend the copy queued last (``queue`` merges them)?"""
        return bool(runs and self._queued and self._joined(self._queued[-1], _Copy(src, *runs[0])))

    def queue(self, blocks: Sequence[int], src: torch.Tensor, runs: Sequence[Run]) -> None:
        """Copy ``src``'s rows into ``blocks`` (``runs`` of them) at the next ``issue``; a first run that
        continues the copy queued last, on the host and in the pool, is merged into it."""
        copies = [_Copy(src, *run) for run in runs]
        if copies and self._queued:
            joined = self._joined(self._queued[-1], copies[0])
            if joined is not None:
                self._queued[-1] = joined
                copies = copies[1:]
        self._queued += copies
        self._blocks.update(blocks)

    def _joined(self, a: _Copy, b: _Copy) -> _Copy | None:
        """``a`` and ``b`` as one copy, or None. They join when ``b``'s rows follow ``a``'s in one host
        allocation with the same strides (so in every layer, K and V alike) and ``b``'s slots follow
        ``a``'s in the pool, with the same gap on both sides, shorter than a block: the hole rows of
        ``a``'s last block, whose slots the joined copy also writes (no table reads them)."""
        sa, sb = a.src, b.src
        if sa.stride() != sb.stride() or sa.untyped_storage().data_ptr() != sb.untyped_storage().data_ptr():
            return None
        step = sa.stride(2)
        gap, rem = divmod(sb.storage_offset() + b.first * step - sa.storage_offset() - a.end * step, step)
        if rem or not 0 <= gap < self.block_size or b.slot != a.slot + a.end - a.first + gap:
            return None
        end = a.end + gap + b.end - b.first
        wide = sa.as_strided((*sa.shape[:2], end, *sa.shape[3:]), sa.stride(), sa.storage_offset())
        return _Copy(wide, a.first, end, a.slot)

    def issue(self) -> None:
        """Enqueue the queued copies on the copy stream, after the current stream's work: layer by
        layer across all of them, one event per layer."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        self.copier.follow_current()
        spans = [(c.src, c.first, c.end, c.slot, c.slot + c.end - c.first) for c in queued]
        for layer in range(self.layers):
            rows = self.pool[layer]
            pairs = [
                (rows[kv, s0:s1], src[layer, kv, first:end])
                for src, first, end, s0, s1 in spans
                for kv in (0, 1)
            ]
            ready = self.copier.copy_all(pairs)
            if ready is not None:
                self._events[layer].append(ready)
            self.copies += len(pairs)
        self._forget_if_landed()

    def hook(self) -> Callable[[int], None] | None:
        """For a forward about to be issued: ``before_layer`` if anything is pending (queued copies are
        issued now), else None."""
        self.issue()
        return self.before_layer if self._blocks else None

    def before_layer(self, layer: int) -> None:
        """Make the current stream wait for layer ``layer``'s copies (the device waits, the host goes
        on). A forward calls it for every layer in order, before the layer touches the cache."""
        events = self._events[layer]
        if events:
            for ready in events:
                self.copier.wait(ready)
            events.clear()
        if layer == self.layers - 1:
            self._forget_if_landed()

    def settle(self, blocks: Iterable[int] | None = None) -> None:
        """Make the current stream wait for every copy (issuing what is queued); with ``blocks``, only
        if some of them are pending."""
        if not self._blocks or (blocks is not None and self._blocks.isdisjoint(blocks)):
            return
        self.issue()
        for layer in range(self.layers):
            self.before_layer(layer)

    def _forget_if_landed(self) -> None:
        if not self._queued and not any(self._events):
            self._blocks.clear()


__all__ = ["MIN_COPY_BYTES", "Copier", "Landing", "block_runs", "rows_contiguous", "worth_layering"]
