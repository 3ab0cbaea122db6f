"""Attention inside a captured CUDA graph: fixed-capacity device buffers that each step refills.

A CUDA graph replays the kernels it captured with the same grids and the same pointers. Decode steps
change every time (sequences grow, join, leave; the sharing structure moves), so a graph-safe attention
keeps every per-step value in device buffers of fixed capacity and sizes its grids by that capacity:
padding rows and work items do nothing. A step is then: plan on the host, write the plan into a pinned
mirror, one asynchronous copy to the device buffers, replay.

The pieces:
  * ``HeadShape``: what a plan needs of the model (heads, head dim, dtype, device);
  * ``GraphStep``: a host-planned decode step: which graph serves it (``key``), the int32 arrays its
    buffers take this step, and how to build that graph's attention the first time the key is seen;
  * ``GraphAttention``: a backend bound to one key's buffers; the model calls its ``forward`` while the
    graph is captured, and ``load`` refills the buffers before each replay.
``NoAttentionGraph`` (the benchmark-only ceiling) lives here; the Triton ones live in
``graph_attention.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.metadata import AttentionMetadata


class Scratch:
    """fp32 partial buffers that every decode graph of one engine takes views of.

    Graphs replay one at a time on one stream and merge their partials within their own replay, so
    one buffer serves them all; with capacities fixed per bucket (``Ceilings``) a graph's partials
    would otherwise be hundreds of MB each. A need larger than the buffer allocates a larger one (at
    least twice): graphs captured on the old one keep it alive through their views.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def take(self, rows: int, tail: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A [rows, *tail] fp32 view of the shared buffer of that row shape."""
        key = (tail, str(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < rows:
            size = max(rows, 2 * buffer.shape[0] if buffer is not None else rows)
            buffer = self._buffers[key] = torch.empty((size, *tail), dtype=torch.float32, device=device)
        return buffer[:rows]


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Capacities of a decode graph's buffers fixed by the engine's limits, not by any step's sharing
    structure: every step of a bucket then plans into the same capacities, so its graph keys do not
    grow as sequences lengthen or the structure moves (a key first met while serving means a
    capture, which stalls every running stream). A step past a ceiling keeps its own, larger key."""

    table_width: int  # block-table columns of the longest sequence (max_model_len / block_size)
    pool_blocks: int  # blocks in the KV pool: the most a step's segments can hold

    # Every step copies its graph's whole buffers to the device: block tables past 1 MB (at 256
    # rows, 1,024 columns: 16K tokens at 16 a block; a bucket of 64 rows or fewer holds 64K tokens or
    # more) or segments of more than 2,048 blocks are left to grow with the steps that need them
    TABLE_BYTES = 1 << 20
    MAX_BLOCKS = 2048
    ROWS_PER_HOLDER = 4  # segment rows a bucket's row is counted for (nesting depth)
    SLOTS_PER_ROW = 16  # shared partial slots a row is given (KV splits of its segments)
    ITEMS_PER_ROW = 8  # shared work items a row is given

    def width(self, bucket: int, minimum: int) -> int:
        """Block-table columns of ``bucket`` rows."""
        return capacity(min(self.table_width, self.TABLE_BYTES // (4 * bucket)), minimum)

    def shared(self, bucket: int) -> tuple[int, int, int, int, int]:
        """(items, segments, segment blocks, segment rows, slots) for ``bucket`` rows."""
        blocks = min(self.pool_blocks, bucket * self.table_width, self.MAX_BLOCKS)
        return (
            capacity(max(64, self.ITEMS_PER_ROW * bucket)),
            capacity(bucket, 4),
            capacity(blocks, 16),
            capacity(self.ROWS_PER_HOLDER * bucket, 16),
            capacity(max(64, self.SLOTS_PER_ROW * bucket)),
        )


@dataclass(frozen=True, slots=True)
class HeadShape:
    """The attention shape of a model, which graph plans depend on (tiles, work list, buffers), and
    what the engine's graphs share: the capacities they are planned to and their partials' buffers."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # q's
    device: torch.device
    kv_dtype: torch.dtype | None = None  # the cache's, where it is not q's (e4m3: an FP8 KV cache)
    ceilings: Ceilings | None = None  # None: capacities follow each step (tests, probes)
    scratch: Scratch | None = field(default=None, compare=False, hash=False)  # None: each graph its own

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def partials(self, rows: int, tail: tuple[int, ...]) -> torch.Tensor:
        """A graph's fp32 partials [rows, *tail]: a view of the shared scratch, or its own buffer."""
        if self.scratch is None:
            return torch.empty((rows, *tail), dtype=torch.float32, device=self.device)
        return self.scratch.take(rows, tail, self.device)


@dataclass(slots=True)
class GraphStep:
    """One decode step planned for a graph: ``key`` names the graph, ``arrays`` fill its buffers."""

    key: tuple[Any, ...]
    arrays: dict[str, np.ndarray]
    build: Callable[[], GraphAttention]  # makes the key's attention (buffers sized by the key)
    stats: dict[str, float] = field(default_factory=dict)
    # the same step planned into the capacities of an already captured key, when they can hold it
    # (the returned step's key then equals that key): saves a capture when a batch shrinks a little
    refit: Callable[[tuple[Any, ...]], GraphStep] | None = None
    # the freeing KV layout: each sliding group's KV write slots of the step's rows ([R, rows] int64)
    group_slots: np.ndarray | None = None
    # its attention runs the sliding layers too (``window_forward``): no window work to add to it
    windowed: bool = False
    # the same step planned without TMA tile loads, where its segments took them: a graph that any
    # step of its tiles can run, contiguous segments or not (None: the step has no such twin)
    plain: Callable[[], GraphStep] | None = None


def capacity(n: int, minimum: int = 1) -> int:
    """Power-of-two capacity for ``n`` items: growth re-captures a graph O(log n) times, not per step."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def walk_form(key: tuple[Any, ...]) -> int | None:
    """A paged or shared key's e4m3 walk form of its paged launch: any serves a step (only its speed
    moves), so a refit before the seal keeps the step's own, and after it takes any
    (``DecodeGraphs._refit``). None for other kinds."""
    if key[0] == "paged":
        return key[4]
    if key[0] == "shared":
        return key[4][6]
    return None


def floor_key(key: tuple[Any, ...], floor: tuple[Any, ...] | None, fixed: tuple[int, ...]) -> tuple[Any, ...]:
    """``key`` with each capacity raised to ``floor``'s, if the two agree on the ``fixed`` fields."""
    if floor is None or len(floor) != len(key) or any(key[i] != floor[i] for i in fixed):
        return key
    return tuple(k if i in fixed else max(k, f) for i, (k, f) in enumerate(zip(key, floor, strict=True)))


class HostStaging:
    """Host buffers that asynchronous host-to-device copies read, used in turn.

    A step's inputs are written into one while the copy of the step before may still be pending
    (the engine launches a step before it waits for the one ahead of it); by the time a buffer comes
    round again, the engine has waited for the step that read it. Pinned on CUDA.
    """

    DEPTH = 2  # steps in flight at once (the launch-ahead engine's bound)

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        pin = device is None or device.type == "cuda"
        self.buffers = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(self.DEPTH)]
        self._turn = 0

    def next(self) -> torch.Tensor:
        """The buffer to fill for this step."""
        self._turn = (self._turn + 1) % self.DEPTH
        return self.buffers[self._turn]


class GraphAttention(AttentionBackend):
    """Attention bound to one captured graph's buffers: ``load`` a step, then the model runs/replays.

    ``fields`` lists the int32 buffers: name -> (shape, clear), where ``clear`` says the part past this
    step's data must be zeroed (work lists, whose zero items are no-ops); other buffers keep stale
    entries that no kernel reads (lengths bound every read). All fields live in one device tensor and
    one pinned host mirror, so loading a step is one copy.
    """

    name = "graph"

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], bool]], device: torch.device) -> None:
        self.fields = fields
        self.spans: dict[str, tuple[int, int]] = {}  # each field's (start, end) in the flat buffer
        total = 0
        for name, (shape, _clear) in fields.items():
            self.spans[name] = (total, total + int(np.prod(shape, dtype=np.int64)))
            total = self.spans[name][1]
            total += -total % 4  # 16-byte aligned starts (Triton specialises pointers on alignment)
        self.device = device
        self.ints = torch.zeros(max(total, 1), dtype=torch.int32, device=device)
        self.staging = HostStaging((max(total, 1),), torch.int32, device)

    def buffer(self, name: str) -> torch.Tensor:
        """The device view of field ``name`` (what the captured kernels read)."""
        start, end = self.spans[name]
        return self.ints[start:end].view(self.fields[name][0])

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Write a step's arrays into a host mirror (2-d ones into the top-left corner) and copy it over.

        The copy is asynchronous; mirrors are used in turn (``HostStaging``), each rewritten only
        after the engine waited for the step whose copy read it. A mirror holds the arrays of the
        step that last used it: every field in ``arrays`` is rewritten (that step may have had another
        plan); a field a step does not give keeps what the mirror held (zeros in a new graph).
        """
        host = self.staging.next()
        host_np = host.numpy()
        spans, fields = self.spans, self.fields
        for name, arr in arrays.items():
            start, end = spans[name]
            flat = host_np[start:end]
            if arr.ndim == 2:
                shape, clear = fields[name]
                view = flat.reshape(shape)
                view[: arr.shape[0], : arr.shape[1]] = arr
                if clear:
                    view[arr.shape[0] :] = 0
            else:
                flat[: arr.size] = arr.ravel()
                if fields[name][1]:
                    flat[arr.size :] = 0
        self.ints.copy_(host, non_blocking=True)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class WindowedGraphAttention(GraphAttention):
    """A graph attention that also runs sliding-window layers (``window.attend_layer`` sends them to
    ``window_forward``). In a graph's forward a sliding group's view of the step carries the group's
    index as its ``plan`` (``worker/cuda_graph.py``)."""

    def window_forward(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int
    ) -> torch.Tensor:
        raise NotImplementedError


class NoAttentionGraph(WindowedGraphAttention):
    """The benchmark-only ceiling (attention skipped, the sliding layers' too) under a graph: nothing
    to load."""

    def __init__(self, device: torch.device) -> None:
        super().__init__({}, device)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return q

    def window_forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int):
        return q


__all__ = [
    "Ceilings",
    "GraphAttention",
    "GraphStep",
    "HeadShape",
    "NoAttentionGraph",
    "Scratch",
    "WindowedGraphAttention",
    "capacity",
    "floor_key",
    "walk_form",
]
