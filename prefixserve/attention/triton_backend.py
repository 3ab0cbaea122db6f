"""Triton attention backends: "triton" (shared segments + own parts + LSE merge) and "triton_paged".

"triton" runs a step as the one idea (docs/architecture.md): ``prepare`` plans the shared segments
once per step (``make_plan``); each layer's ``forward`` then launches the shared-segment kernel (holders' rows
stacked, segment KV read once per M-tile) and the paged kernel over each sequence's own part, both
writing fp32 partials into one buffer, and one merge kernel combines every row's partials. With no
segment in the batch it runs the plain paged kernel alone (one launch, plus a split merge for long KV).

"triton_paged" is the same paged kernel over whole block tables, no sharing: the baseline to beat.

Host cost matters as much as kernel time in an eager decode step (32 layers, each a few launches;
docs/kernels.md §2.7), so the per-step work is done once and the per-layer
work is kept to launches:
  * ``prepare`` plans on the host and moves every plan tensor to the device in one asynchronous copy
    from pinned memory (``make_plan`` alone would do seven blocking copies);
  * the first layer of a step builds the layout (work list, merge CSR, partial buffers: again one
    asynchronous copy, no device read) and launches through Triton's normal path, recording each
    launch; every later layer ``relaunch``es the recorded launches with its own q / K / V / output,
    which skips Triton's per-call argument binding (``triton_support/launch.py``);
  * the shared and own kernels run on one stream unless the shared work is large enough for a
    second stream's fork/join (two event waits per layer) to pay (``overlap_min_rows``).

The host planning shared with the decode graphs is ``planning/step_plan.py``'s, the launch paths and their
replay ``step_launch.py``'s. This module imports without Triton so that the backends register; the
kernels load on first use and raise ImportError with the fix when Triton is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixserve.attention import dense_prefill
from prefixserve.attention.backend import AttentionBackend, register_backend
from prefixserve.attention.dense_prefill import DenseSequence
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.context_segments import ContextRule, with_context_segments
from prefixserve.attention.planning.decode_plans import DecodePlans
from prefixserve.attention.planning.step_plan import (
    host_plan,
    own_pack_rule,
    plan_step_work,
    plan_to_device,
    seg_rows_host,
    to_device_packed,
)
from prefixserve.attention.step_launch import (
    MERGE,
    PAGED_MERGED,
    PAGED_OUT,
    PAGED_PART,
    csr_merge,
    launch_mixed_path,
    launch_split_path,
    relaunch_layer,
    replay_launches,
)

if TYPE_CHECKING:  # annotations only: mixed_rule imports the Gluon kernels
    from prefixserve.attention.planning.mixed_rule import MixedTiles


@dataclass(slots=True)
class _Layout:
    """Per (q_heads, kv_heads, head_dim) launch layout of one step; shared by all layers."""

    own_splits: int
    own_split_size: int
    own_pack: int = 1  # decode sequences per own-kernel program
    mixed: MixedTiles | None = None  # the tiles of one launch of shared and own tiles (mixed_gluon.py)
    work: Any = None  # SharedWork, when the step has segments
    num_slots: int = 0  # shared slots + own slots
    row_ptr: torch.Tensor | None = None  # [T+1] int32: CSR over the merged partials
    part_idx: torch.Tensor | None = None  # [nnz] int32
    o_part: torch.Tensor | None = None  # [num_slots, Hq, D] fp32, reused by every layer
    lse_part: torch.Tensor | None = None  # [num_slots, Hq] fp32
    out_lse: torch.Tensor | None = None  # [T, Hq] fp32: each row's LSE, kept for attention sinks
    # recorded on the step's first layer: (launch, its per-layer argument positions, on side stream)
    launches: list[tuple[Any, tuple[int, int, int, int], bool]] = field(default_factory=list)
    signature: tuple[Any, ...] = ()  # shapes / strides the recorded launches were specialised on


@dataclass(slots=True)
class TritonStep:
    """What ``prepare`` leaves in ``meta.plan``: the shared plan (or None) and lazily-built layouts."""

    shared: Any  # SharedPlan | None
    max_query_len: int
    layouts: dict[tuple[int, int, int, str, str], _Layout] = field(default_factory=dict)
    max_seq_len: int = 0
    seg_rows_host: np.ndarray | None = None  # [R] query row of each segment row (no device read)
    seg_blocks_host: np.ndarray | None = None  # the segments' block ids (contiguity: the TMA path)
    dense: tuple[DenseSequence, ...] | None = None  # a few long prefills: SDPA (``dense_prefill.py``)


def _seg_rows_on_host(plan: Any, meta: AttentionMetadata) -> np.ndarray:
    """The query row of each segment row, int64: a host plan's ``seg_rows`` as they are (no rebuild
    from the holder lists), else recomputed without reading the device."""
    if plan.seg_rows.device.type == "cpu":
        return plan.seg_rows.numpy().astype(np.int64)
    return seg_rows_host(plan, meta)


def _kernels() -> tuple[Any, Any, Any]:
    """The kernel modules (Triton: imported on first use), (paged, shared, mixed rule)."""
    from prefixserve.attention.kernels import paged_attention, shared_attention
    from prefixserve.attention.planning import mixed_rule

    return paged_attention, shared_attention, mixed_rule


def _refuse_modules(meta: AttentionMetadata, name: str) -> None:
    """The plain paged kernel reads whole blocks: a module's partly filled block would be read whole."""
    if meta.has_module_blocks():
        raise ValueError(
            f"attention={name!r} cannot read Prompt Cache module blocks (a module's partly filled last "
            "block needs the shared-segment path); use attention='auto' or 'triton'"
        )


@register_backend
class TritonPagedBackend(AttentionBackend):
    """The paged kernel over every sequence's whole KV (no sharing): GQA-packed, split-KV."""

    name = "triton_paged"
    takes_sinks = True

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        _refuse_modules(meta, self.name)
        meta.plan = self._paged_step(meta)

    @staticmethod
    def _paged_step(meta: AttentionMetadata) -> TritonStep:
        return TritonStep(
            shared=None,
            max_query_len=max(meta.query_lens_host, default=1),
            max_seq_len=max(meta.seq_lens_host, default=0),
            dense=dense_prefill.plan(meta),
        )

    def graph_step(self, meta: AttentionMetadata, shape: Any, bucket: int) -> Any:
        """A decode step for a captured graph: the plain paged kernel (``graph_attention.py``)."""
        from prefixserve.attention.graph_attention import paged_graph_step

        _refuse_modules(meta, self.name)
        step = paged_graph_step(meta, shape, bucket)
        meta.stats.update(step.stats)
        return step

    def _step(self, meta: AttentionMetadata) -> TritonStep:
        if not isinstance(meta.plan, TritonStep):
            self.prepare(meta)
        return meta.plan

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._paged(q, k_cache, v_cache, meta, scale, False)[0]

    def forward_with_lse(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """``forward`` and each row's LSE (attention sinks): the final merge writes it too, or with one
        split the kernel's own LSE. The buffer is the step's: read it before the next layer runs."""
        return self._paged(q, k_cache, v_cache, meta, scale, True)

    def _paged(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, with_lse: bool):
        step = self._step(meta)
        if step.dense is not None and not with_lse:
            out = dense_prefill.run(q, k_cache, v_cache, meta, step.dense, scale)
            if out is not None:
                return out, None
        out = torch.empty_like(q)
        key = (q.shape[1], k_cache.shape[2], q.shape[2], "paged", str(q.dtype), with_lse)
        lay = step.layouts.get(key)
        sig = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), q.device, scale)
        if lay is not None and lay.signature == sig:
            for launch, pos, _ in lay.launches:
                relaunch_layer(launch, pos, (q, k_cache, v_cache, out))
            return out, lay.out_lse
        lay = step.layouts[key] = self._paged_first(
            q, k_cache, v_cache, meta, step, scale, out, sig, with_lse
        )
        return out, lay.out_lse

    def _paged_first(
        self, q, k_cache, v_cache, meta, step: TritonStep, scale: float, out, sig, with_lse: bool = False
    ) -> _Layout:
        """Launch the plain paged path through Triton's normal path and record it for later layers."""
        from prefixserve.attention.kernels import merge

        paged, _, _ = _kernels()
        tokens, q_heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        group = q_heads // kv_heads
        block_n = 64
        block_m = paged.pick_block_m(step.max_query_len * group, group)
        base = meta.num_seqs * -(-step.max_query_len // (block_m // group)) * kv_heads
        splits, size = paged.choose_split(
            step.max_seq_len, base, q.device, block_n, prefill=step.max_query_len > 1, kv_dtype=k_cache.dtype
        )
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
        lay = _Layout(own_splits=splits, own_split_size=size, signature=sig)
        lse = torch.empty(splits * tokens, q_heads, dtype=torch.float32, device=q.device)
        if splits == 1:
            launch = paged.launch_paged(*args, step.max_query_len, 1, size, out, lse, 0, 0, block_n)
            lay.launches = [(launch, PAGED_OUT, False)] if launch is not None else []
            lay.out_lse = lse if with_lse else None  # the kernel's own, the final one with one split
            return lay
        o_part = torch.empty(splits * tokens, q_heads, dim, dtype=torch.float32, device=q.device)
        lay.out_lse = torch.empty(tokens, q_heads, dtype=torch.float32, device=q.device) if with_lse else None
        lay.o_part, lay.lse_part = o_part, lse  # held: the recorded launches point at them
        parts = (splits, size, o_part, lse, o_part.stride(0) * tokens, q_heads * tokens)
        counts = paged.merge_counts(q.device, meta.num_seqs * kv_heads) if step.max_query_len == 1 else None
        if counts is not None:  # a decode step: its splits merged by the kernel's last program
            merged = (out, lay.out_lse, counts)
            launch = paged.launch_paged(*args, 1, *parts, merged=merged)
            lay.launches = [(launch, PAGED_MERGED, False)] if launch is not None else []
            return lay
        launch = paged.launch_paged(*args, step.max_query_len, *parts)
        rec: list[Any] = []
        merge.merge_partials(
            o_part, lse, tokens, num_parts=splits, part_stride=tokens, out=out, out_lse=lay.out_lse,
            want_lse=with_lse, launches=rec,
        )  # fmt: skip
        if launch is not None:
            lay.launches = [(launch, PAGED_PART, False)] + [(m, MERGE, False) for m in rec]
        return lay


@register_backend
class TritonBackend(TritonPagedBackend):
    """Shared-segment attention: segments once with stacked holders, own parts paged, LSE merge."""

    name = "triton"
    # Run the shared kernel on a side stream (concurrent with the own kernel) only when the stacked
    # rows are this many or more: below, the shared kernel is a few microseconds and the fork/join
    # (two stream waits per layer) costs more host time than the overlap saves.
    overlap_min_rows: int = 512
    # a decode step's shared and own tiles in one Gluon launch (mixed_gluon.py); None = its rule
    mixed: bool | None = None

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.decode_plans = DecodePlans()  # graphed decode steps: the plan carried on while it holds

    def _side_stream(self, device: torch.device, rows: int) -> torch.cuda.Stream | None:
        if device.type != "cuda" or rows < self.overlap_min_rows:
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # prefills whose cached context goes to the shared kernels as a one-holder segment
    # (``planning/context_segments.py``); None: every own part on the paged kernel
    context_rule: ContextRule | None = ContextRule()

    def prepare(self, meta: AttentionMetadata) -> None:
        plan = host_plan(meta)
        self.install(meta, self.with_context(plan, meta) if self.takes_context(meta) else plan)

    def takes_context(self, meta: AttentionMetadata) -> bool:
        """Does some prefill of this step attend its cached context as a one-holder segment? Not a
        step of long prefills that SDPA takes (``dense_prefill.plan``), nor a decode step."""
        rule = self.context_rule
        if rule is None or meta.is_decode_only or not rule.sequences(meta).any():
            return False
        return dense_prefill.plan(meta) is None

    def with_context(self, plan: Any, meta: AttentionMetadata) -> Any:
        """A host plan with the qualifying prefills' own context blocks as one-holder segments (call
        where ``takes_context``)."""
        return with_context_segments(plan, meta, self.context_rule)

    def install(self, meta: AttentionMetadata, plan: Any) -> None:
        """Make ``plan`` (a host SharedPlan from ``host_plan``) this step's plan, and report its stats."""
        meta.stats["kv_tokens_read"] = float(plan.kv_tokens_read)
        meta.stats["kv_tokens_logical"] = float(meta.logical_kv_tokens())
        meta.stats["shared_segments"] = float(plan.num_segments)
        meta.stats["context_segments"] = float(plan.context_segments)
        meta.stats["cascade"] = 1.0 if plan.num_segments else 0.0
        step = self._paged_step(meta)
        if plan.num_segments > 0:
            step.seg_rows_host = _seg_rows_on_host(plan, meta)
            step.seg_blocks_host = plan.seg_blocks.numpy()
            step.shared = plan_to_device(plan, meta.block_tables.device)
        meta.plan = step

    def graph_step(self, meta: AttentionMetadata, shape: Any, bucket: int) -> Any:
        """A decode step for a captured graph: shared segments when the batch has any, else paged."""
        from prefixserve.attention.graph_attention import shared_graph_step

        plan = self.decode_plans.plan(meta, host_plan)
        meta.plan = plan  # the host plan: sliding layers' window plans follow it (window_graph.py)
        if plan.num_segments == 0:
            return super().graph_step(meta, shape, bucket)
        step = shared_graph_step(meta, plan, shape, bucket)
        meta.stats.update(step.stats)
        return step

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._shared(q, k_cache, v_cache, meta, scale, False)[0]

    def forward_with_lse(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return self._shared(q, k_cache, v_cache, meta, scale, True)

    def _shared(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, with_lse: bool):
        step = self._step(meta)
        if step.shared is None:
            return self._paged(q, k_cache, v_cache, meta, scale, with_lse)
        tokens, q_heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        key = (q_heads, kv_heads, dim, str(q.device), str(q.dtype), with_lse)
        side = self._side_stream(q.device, int(step.seg_rows_host.shape[0]) * (q_heads // kv_heads))
        lay = step.layouts.get(key)
        if lay is None:
            pack = self._pack(q_heads, kv_heads, meta, step, q)
            shape = (q_heads, kv_heads, dim, q.device, q.dtype)
            lay = build_layout(meta, step, *shape, pack, self.mixed, k_cache.dtype)
            if with_lse:
                lay.out_lse = torch.empty(tokens, q_heads, dtype=torch.float32, device=q.device)
            step.layouts[key] = lay
        out = torch.empty_like(q)
        sig = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), q.device, scale)
        if lay.signature == sig and lay.launches:
            replay_launches(lay.launches, (q, k_cache, v_cache, out), side)
            return out, lay.out_lse
        lay.launches = self._shared_first(q, k_cache, v_cache, meta, step, lay, scale, out, side)
        lay.signature = sig
        return out, lay.out_lse

    def _pack(self, q_heads: int, kv_heads: int, meta: AttentionMetadata, step: TritonStep, q) -> int:
        """Decode sequences per own program (``packed_decode_program``): ``own_pack_rule``'s."""
        if step.max_query_len != 1:
            return 1
        shape = (q_heads, kv_heads, q.shape[2], q.element_size())
        return own_pack_rule(step.shared, meta.num_seqs, shape, meta.block_size, q.device)

    def _shared_first(self, q, k_cache, v_cache, meta, step: TritonStep, lay: _Layout, scale, out, side):
        """Launch shared + own + merge through Triton's normal path; return the recorded launches."""
        paged, shared_mod, mixed_rule = _kernels()
        plan = step.shared
        tokens, q_heads, dim = q.shape
        ns = lay.work.num_slots
        shared_args = (q, k_cache, v_cache, plan.seg_blocks, plan.seg_block_start, plan.seg_rows, lay.work)
        own_args = (
            q,
            k_cache,
            v_cache,
            plan.own_block_tables,
            plan.own_seq_lens,
            meta.query_start_loc,
            scale,
        )

        merge_into = csr_merge(lay.o_part, lay.lse_part, tokens, lay.row_ptr, lay.part_idx, out, lay.out_lse)
        if lay.mixed and mixed_rule.eligible(q, k_cache, v_cache, lay.work.block_m, lay.work.block_n):
            step_lists = (plan.seg_rows, lay.work.items, plan.own_block_tables, plan.own_seq_lens)
            parts = (lay.o_part, lay.lse_part, ns)
            return launch_mixed_path(q, k_cache, v_cache, scale, step_lists, parts, merge_into, lay.mixed)
        own_args += (
            step.max_query_len,
            lay.own_splits,
            lay.own_split_size,
            lay.o_part[ns:],
            lay.lse_part[ns:],
        )
        return launch_split_path(
            lambda: shared_mod.launch_shared(*shared_args, scale, lay.o_part, lay.lse_part),
            lambda: paged.launch_paged(
                *own_args, tokens * q_heads * dim, tokens * q_heads, pack=lay.own_pack
            ),
            merge_into,
            side,
        )


def build_layout(
    meta: AttentionMetadata,
    step: TritonStep,
    q_heads: int,
    kv_heads: int,
    dim: int,
    device: torch.device,
    dtype: torch.dtype,
    pack: int = 1,
    mixed: bool | None = None,
    kv_dtype: torch.dtype | None = None,
) -> _Layout:
    """Host work, once per step, head shape and dtype: shared work list, own splits, merge CSR, buffers.

    Everything is computed from host lists (no device read), and the work list and merge CSR reach
    the device in one asynchronous copy. The dtype is part of the layout because the shared tiles are
    fitted to shared memory by element size (fp32 needs narrower tiles than bf16). ``pack``: decode
    sequences per own-kernel program; ``mixed``: one mixed launch where eligible (None: ``use_mixed``'s rule);
    ``kv_dtype``: the cache's (an e4m3 one never mixes, ``plan_step_work``).
    """
    from prefixserve.attention.kernels import merge as merge_mod

    paged = _kernels()[0]
    plan = step.shared
    group = q_heads // kv_heads
    tokens = sum(meta.query_lens_host)
    block_n = 64
    block_m = paged.pick_block_m(step.max_query_len * group, group)
    q_tiles = -(-step.max_query_len // (block_m // group))
    own_programs = -(-meta.num_seqs // pack) * kv_heads if pack > 1 else meta.num_seqs * q_tiles * kv_heads
    own_splits, own_split_size = paged.choose_split(
        max(plan.own_seq_lens_host, default=0), own_programs, device, block_n, kv_dtype=kv_dtype
    )
    seg_blocks = step.seg_blocks_host
    if seg_blocks is None:  # a step planned elsewhere (e.g. benchmarks): read the blocks back once
        seg_blocks = plan.seg_blocks.cpu().numpy()
    mode = None if mixed is None else ("1" if mixed else "0")
    shape, step_rows = (q_heads, kv_heads, dim), (step.max_query_len, meta.num_seqs, mode)
    # mixed: the mixed launch's tiles (mixed_rule.MixedTiles), None: two kernels
    work, mixed = plan_step_work(
        plan, seg_blocks, meta.block_size, shape, device, dtype, *step_rows, kv_dtype=kv_dtype
    )
    ns = work.num_slots
    if mixed:  # the mixed kernel writes one own partial per row: one split (the paged kernel's too,
        # should a layer's caches not take the mixed kernel)
        own_splits = 1
        own_split_size = max(1, -(-max(plan.own_seq_lens_host, default=0) // block_n)) * block_n
    # merge CSR over the step's T rows: each row's own splits, then its slots in every segment
    seg_rows = step.seg_rows_host
    if seg_rows is None:  # a step planned elsewhere (e.g. benchmarks): read the rows back once
        seg_rows = plan.seg_rows.cpu().numpy().astype(np.int64)
    slot_rows = seg_rows[work.slot_row_index.numpy()]  # [ns] query row of each shared slot
    own_rows = np.tile(np.arange(tokens, dtype=np.int64), own_splits)  # [own_splits * T]
    row_ptr, order = merge_mod.csr_by_row(np.concatenate([slot_rows, own_rows]), tokens)
    num_slots = ns + own_splits * tokens
    items, row_ptr_d, part_idx_d = to_device_packed([work.items.numpy(), row_ptr, order], device)
    work.items = items.view(work.items.shape)
    return _Layout(
        own_splits=own_splits,
        own_split_size=own_split_size,
        own_pack=pack,
        mixed=mixed,
        work=work,
        num_slots=num_slots,
        row_ptr=row_ptr_d,
        part_idx=part_idx_d,
        o_part=torch.empty(num_slots, q_heads, dim, dtype=torch.float32, device=device),
        lse_part=torch.empty(num_slots, q_heads, dtype=torch.float32, device=device),
    )


__all__ = ["TritonBackend", "TritonPagedBackend", "TritonStep", "host_plan", "plan_to_device"]
