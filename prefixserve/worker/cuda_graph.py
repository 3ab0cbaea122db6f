"""Decode steps replayed from CUDA graphs: one graph per (batch bucket, attention key).

An eager decode step of a 32-layer model is hundreds of kernel launches, and at small and middle batch
sizes the host cannot issue them as fast as the GPU runs them. A captured graph issues the whole
forward pass in one call. What changes from step to step enters through fixed device buffers:
  * token ids, positions and KV write slots of the bucket's rows (``inputs``; under the freeing KV
    layout each sliding group's write slots too); padding rows write their K/V to the cache's scratch
    slot and their outputs are ignored;
  * the attention's per-step plan (``GraphAttention.load``: block tables, segment work list, merge CSR);
  * a linear-attention hybrid's state slots and fresh flags (``linear_graph.py``).
Graphs are captured the first time a key is met (a warm-up forward, the capture, a replay), into
one shared memory pool; a step whose key is not captured runs in a captured graph of its bucket
whose capacities hold it where there is one (``_refit``). A key's capacities are the bucket's
(``graph.Ceilings``), not the step's, so a bucket's keys differ only in the kernels' tiles and split
counts. Once a server is ready (``seal``, after its start-up capture plan) nothing more is captured:
a capture stalls every running stream, so a step with a key never met runs eagerly instead, and the
key is logged as a defect of the plan (``misses``). A step whose segments took TMA tile loads (their
blocks consecutive) is captured with its pointer-load twin (``GraphStep.plain``), which serves the
same steps over blocks that a busy pool scattered. Prefill and mixed steps, and batches above the
largest bucket, run eagerly. ``EngineConfig.enforce_eager`` turns all of this off.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from prefixserve.attention.graph import (
    Ceilings,
    GraphAttention,
    GraphStep,
    HeadShape,
    HostStaging,
    Scratch,
    walk_form,
)
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.kv.cache import KVCache
from prefixserve.kv.state_slots import StatePool
from prefixserve.model.config import SLIDING, ModelConfig
from prefixserve.model.gated_delta import LinearStep
from prefixserve.worker import linear_graph
from prefixserve.worker.graph_capture import capture_into

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two and 1.5x powers of two (at most a third of a bucket is padding)."""
    sizes = {1, 2, 3}
    p = 4
    while p < max_batch:
        sizes |= {p, p * 3 // 2}
        p *= 2
    sizes.add(max_batch)
    return sorted(s for s in sizes if s <= max_batch)


HOLD_STEPS = 32  # steps a shrunken batch keeps its larger bucket before its own graph is captured


def graph_refusal(config: ModelConfig) -> str | None:
    """Why this model's decode steps cannot run in a captured graph (None: they can). A graph holds
    one attention shape and, with sliding layers, one window."""
    n = config.num_hidden_layers
    shapes = {config.layer_kv_shape(i) for i in range(n)}
    if shapes != {(config.num_key_value_heads, config.head_dim)}:
        return "its layers' KV heads or head sizes differ"
    windows = {config.layer_spec(i).window for i in range(n) if config.layer_type(i) == SLIDING}
    if len(windows) > 1:
        return "its sliding layers' windows differ"
    if config.attention_sinks:
        return "its attention sinks need the LSE, which the graphs' attention does not return"
    return None


class GraphCaptureError(RuntimeError):
    """A capture failed; the engine then runs every step eagerly (``enforce_eager`` in effect)."""


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    attention: GraphAttention
    hidden: torch.Tensor  # [bucket, hidden] output of the replays


def _footprint(key: tuple[Any, ...]) -> tuple[int, int]:
    """A captured key's (block-table width, work-item capacity) for ``_refit``'s order (0 where a kind
    has none)."""
    width = key[2] if len(key) > 2 and isinstance(key[2], int) else 0
    items = key[5] if key[0] == "shared" and len(key) > 5 and isinstance(key[5], int) else 0
    return width, items


class DecodeGraphs:
    """Captures and replays decode forwards; the model runner calls ``bucket_for`` then ``run``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        max_batch: int,
        states: StatePool | None = None,
        context: int = 0,  # the longest sequence (tokens): the block tables' ceiling
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.model, self.kv = model, kv
        self.device = param.device
        ceilings = Ceilings(-(-max(context, 1) // kv.block_size), kv.num_blocks)
        self.shape = HeadShape(
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            param.dtype,
            self.device,
            kv.slots[0].dtype,
            ceilings,
            Scratch(),
        )
        self.buckets = batch_buckets(max_batch)
        cap = self.buckets[-1]
        # rows: token ids, positions, KV write slots, each sliding group's write slots under the
        # freeing layout, a hybrid's state slots and fresh flags (int64: what embedding and
        # index_copy_ take)
        self.layer_groups = kv.layout.group_of if kv.layout.frees_sliding else ()
        self.sliding_groups = kv.layout.sliding_groups
        rows = 3 + self.sliding_groups + (linear_graph.ROWS if states is not None else 0)
        self.inputs = torch.zeros(rows, cap, dtype=torch.long, device=self.device)
        first = rows - linear_graph.ROWS
        self.linear = None if states is None else linear_graph.LinearGraphRows(states, self.inputs, first)
        self._staging = HostStaging((rows, cap), torch.long)
        self.graphs: dict[tuple[Any, ...], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.capture_s = 0.0  # host seconds spent capturing: every running stream stalls meanwhile
        self.sealed = False  # a server is ready: no more captures (``seal``)
        self.plan_failed = False  # a synthetic part of the start-up plan failed: never sealed
        self.misses = 0  # steps run eagerly after the seal for want of a captured graph
        self.missed: set[tuple[Any, ...]] = set()  # their keys (each logged once)
        self._current: int | None = None  # the bucket of the last decode step
        self._held = 0  # consecutive steps run in a bucket above the batch's own
        # ``_refit``'s choice for a step key (and whether any split count was allowed), kept while the
        # captured keys stay as they were: a search replans the step for each candidate key
        self._fits: dict[tuple[Any, bool], tuple[Any, ...]] = {}
        self._fits_over = 0  # how many graphs ``_fits`` was chosen among

    def release(self) -> None:
        """Free every captured graph now, even where something still holds this object: a graph
        that captured a collective holds NCCL's communicator, and leaving the group waits for it."""
        for entry in self.graphs.values():
            entry.graph.reset()
        self.graphs.clear()

    def bucket_for(self, batch: int) -> int | None:
        """The bucket to run ``batch`` rows in, or None when the batch is too large for graphs.

        Normally the smallest bucket that holds the batch. When a batch shrinks (requests finish),
        the bucket in use is kept while it is at most 4x the batch, for up to ``HOLD_STEPS`` steps:
        a capture costs about a second (kernel compiles, a warm-up forward), far more than a few
        padded steps, and a batch that ends soon never pays it. A batch that stays small gets its
        own graph after that.
        """
        exact = self._exact(batch)
        if exact is None:
            return None
        current = self._current
        held = current is not None and batch <= current < 4 * batch and exact < current
        return current if held and self._held < HOLD_STEPS else exact

    def seal(self) -> None:
        """From now on nothing is captured: ``fit`` sends a step no captured graph serves to eager."""
        self.sealed = True

    def fit(self, step: GraphStep) -> GraphStep | None:
        """``step`` as a captured graph runs it: its own key, or planned into a captured key of its
        bucket that holds it at its own split count (``_refit``); before the seal, else ``step`` as it
        is (``run`` captures it). After the seal, failing those: a captured key of another split count
        (the nearest, at least half the step's), then its pointer-load twin's keys; else None (the step
        runs eagerly), counted and logged as a miss, and a held bucket let go (its own bucket may
        have the graph)."""
        if step.key in self.graphs:
            return step
        if not self.sealed:
            return self._refit(step)[0]
        candidates = [step] if step.plain is None else [step, step.plain()]
        for candidate in candidates:
            if candidate.key in self.graphs:
                return candidate
            fitted, entry = self._refit(candidate, any_split=True)
            if entry is not None:
                return fitted
        self.misses += 1
        self.reset_hold()
        if step.key not in self.missed:
            self.missed.add(step.key)
            log.warning(
                "decode graph key %s first met after the server was ready: run eagerly, not captured "
                "(a capture would stall every stream; the start-up plan missed it)",
                step.key,
            )
        return None

    def serves(self, step: GraphStep) -> bool:
        """Whether a captured graph runs ``step`` at its own split count (its key, or a refit)."""
        return step.key in self.graphs or self._refit(step)[1] is not None

    def hold(self, bucket: int) -> None:
        """Run the next step in ``bucket`` if it holds the batch (as a shrinking batch keeps its bucket):
        the start-up plan's steps of fewer rows than their bucket."""
        self._current, self._held = bucket, 0

    def reset_hold(self) -> None:
        """Forget the bucket in use (after start-up batches: the next batch takes its own)."""
        self._current, self._held = None, 0

    def _exact(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    def _ran(self, rows: int, bucket: int) -> None:
        """Book a replay (planning may ask ``bucket_for`` more than once a step; this counts once)."""
        self._held = self._held + 1 if bucket > (self._exact(rows) or bucket) else 0
        self._current = bucket

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: np.ndarray,
        step: GraphStep,
        feed: Any = None,
        linear: LinearStep | None = None,
    ) -> torch.Tensor:
        """One decode forward for ``len(ids)`` rows through the graph of ``step.key``: the graph's whole
        output buffer [bucket, hidden], whose first ``len(ids)`` rows are the step's (the rest padding).

        ``feed`` (a ``model_runner.PrevTokenFeed``) overwrites rows of ids with tokens still on the
        device; ``linear``: a hybrid's state slots of the step (``AttentionMetadata.linear``)."""
        rows, bucket = len(ids), step.key[1]
        self._ran(rows, bucket)
        pinned = self._staging.next()
        host = pinned.numpy()
        host[0, :rows], host[1, :rows], host[2, :rows] = ids, positions, slots
        groups = slice(3, 3 + self.sliding_groups)
        if step.group_slots is not None:
            host[groups, :rows] = step.group_slots
        host[0, rows:bucket] = host[1, rows:bucket] = 0
        host[2, rows:bucket] = host[groups, rows:bucket] = self.kv.scratch_slot
        if self.linear is not None:
            if linear is None:
                raise ValueError("a linear-attention hybrid's graphed step needs its state slots")
            self.linear.fill(host, linear, bucket)
        self.inputs.copy_(pinned, non_blocking=True)
        if feed is not None:
            feed.apply(self.inputs[0])
        entry = self.graphs.get(step.key)
        if entry is None:
            step, entry = self._refit(step)
        if entry is None:
            if self.sealed:  # ``fit`` sends such steps to eager: a capture here is a defect
                log.error("capturing decode graph %s after the server was ready", step.key)
            if step.plain is not None:  # its pointer-load twin too, for steps over scattered blocks
                plain = step.plain()
                if not self.serves(plain):
                    self._capture(plain, bucket)
            entry = self._capture(step, bucket)
        else:
            entry.attention.load(step.arrays)
        entry.graph.replay()
        if self.linear is not None:
            self.linear.after_replay(linear)
        return entry.hidden

    def _refit(self, step: GraphStep, any_split: bool = False) -> tuple[GraphStep, _Captured | None]:
        """A captured graph of the same kind and bucket whose capacities hold this step, at the step's
        split count and e4m3 walk form (``graph.walk_form``), the narrowest block tables
        first, then the shortest work list, then the newest; the choice for a step key is tried
        first on later steps until a graph is added. ``any_split``:
        at another count too (any count is correct: each row's KV is cut into the graph's splits by
        its length), the nearest first and never below half the step's (fewer programs than that
        would read a long row slower than an eager step)."""
        if step.refit is None:
            return step, None
        if self._fits_over != len(self.graphs):  # a capture (or a release) since: choose afresh
            self._fits.clear()
            self._fits_over = len(self.graphs)
        chosen = self._fits.get((step.key, any_split))
        if chosen is not None:
            fitted = step.refit(chosen)
            if fitted.key == chosen:
                return fitted, self.graphs[chosen]
        same = [key for key in reversed(list(self.graphs)) if key[:2] == step.key[:2]]
        # the narrowest tables first (a step copies its graph's whole buffers), then the shortest work
        # list (a two-kernel graph runs a program per item, padding included), newest among equals
        same.sort(key=_footprint)
        want = step.key[3] if len(step.key) > 3 and isinstance(step.key[3], int) else None
        if want is not None:
            splits = [(key, key[3]) for key in same if isinstance(key[3], int)]
            if any_split:  # any split count and e4m3 walk form serve
                same = [key for key, k in sorted(splits, key=lambda p: abs(p[1] - want)) if 2 * k >= want]
            else:  # the step's own split count and walk form
                form = walk_form(step.key)
                same = [key for key, k in splits if k == want and walk_form(key) == form]
        for key in same:
            fitted = step.refit(key)
            if fitted.key == key:
                self._fits[step.key, any_split] = key
                return fitted, self.graphs[key]
        return step, None

    def _forward(self, bucket: int, attention: GraphAttention) -> torch.Tensor:
        meta = AttentionMetadata(
            block_size=self.kv.block_size,
            query_start_loc=self.inputs[0, :0].int(),
            seq_lens=self.inputs[0, :0].int(),
            block_tables=self.inputs[0, :0].int().view(0, 0),
            slot_mapping=self.inputs[2, :bucket],
            query_lens_host=[1] * bucket,
            seq_lens_host=[],
            block_tables_host=[],
        )
        if self.layer_groups:  # each sliding group's view: its write slots, its index as the plan
            views = (
                replace(meta, slot_mapping=self.inputs[3 + g, :bucket], plan=g)
                for g in range(self.sliding_groups)
            )
            meta.group_metas, meta.layer_groups = tuple(views), self.layer_groups
        if self.linear is not None:
            meta.linear = self.linear.step(bucket)
        return self.model(self.inputs[0, :bucket], self.inputs[1, :bucket], self.kv.layers, meta, attention)

    def _capture(self, step: GraphStep, bucket: int) -> _Captured:
        """Warm up (compiles kernels; computes this step), capture, and replay once more when asked."""
        started = time.perf_counter()
        attention = step.build()
        attention.load(step.arrays)
        # A hybrid's states move in place, so its warm-up runs on the scratch slot; its full layers
        # then write wrong K/V into the step's own rows, which the replay writes again before a read
        if self.linear is not None:
            with self.linear.on_scratch():
                self._forward(bucket, attention)
        else:
            self._forward(bucket, attention)  # eager warm-up: Triton compiles outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with capture_into(graph, self.pool):
                hidden = self._forward(bucket, attention)
        except Exception as exc:
            raise GraphCaptureError(f"capturing the decode graph {step.key[:2]} failed: {exc}") from exc
        self.captures += 1
        took = time.perf_counter() - started
        self.capture_s += took
        log.info("captured decode graph %s in %.0f ms (%d so far)", step.key, took * 1e3, self.captures)
        entry = self.graphs[step.key] = _Captured(graph, attention, hidden)
        return entry


__all__ = ["DecodeGraphs", "GraphCaptureError", "batch_buckets", "graph_refusal"]
