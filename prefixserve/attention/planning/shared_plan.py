"""Host planning of the shared-segment kernels: a step's work list (``plan_shared_work``) and the rules
that size it.

A segment (a run of whole KV blocks held by several sequences) is attended by its holders' query rows
stacked; the work list cuts every segment into M-tiles (holder rows x GQA group) and KV splits, one
item per (M-tile, split), M-tile fastest so that tiles reading the same KV chunk run together. Each
item's rows write fp32 partials into their own slots, and the merge combines a row's slots. Tile
shapes are fitted to shared memory per dtype and head size; contiguous segments (consecutive cache
blocks) are marked for TMA tile loads. Both the Triton kernel (``shared_attention.py``) and the Gluon
kernels (``shared_gluon.py``, ``mixed_gluon.py``) run these work lists.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixserve.attention.kernels import shared_gluon
from prefixserve.attention.planning.tiles import (
    SMEM_LIMIT_HOPPER,
    fit_tiles,
    next_power_of_2,
    num_sms,
    smem_limit,
)

# segment, first row, end row, first KV token, end KV token, first output slot, and the cache row
# (in the [blocks x block_size] row view) of the first KV token when the segment is contiguous, else -1
ITEM_FIELDS = 7


@dataclass(slots=True)
class SharedWork:
    """Work list of one step's shared segments and where each (row, KV split) partial lands.

    Slots are laid out segment-major, then split, then row: segment g's split k of its i-th row is
    slot ``slot_base[g] + k * rows[g] + i``. ``slot_row_index[s]`` is the segment row (index into
    seg_rows) that slot s belongs to.
    """

    items: torch.Tensor  # [I, ITEM_FIELDS] int32 on the device
    num_slots: int
    block_m: int
    block_n: int
    num_stages: int
    splits: list[int]  # per segment
    slot_base: list[int]  # per segment
    slot_row_index: torch.Tensor  # [num_slots] int64 on the host
    tma: bool = False  # every segment is contiguous: whole tiles are TMA loads (item field 6)

    @property
    def unsplit(self) -> bool:
        """True when slot s is segment row s (no merge of KV splits needed)."""
        return all(k == 1 for k in self.splits)


def pick_shared_tiles(
    max_rows: int,
    group: int,
    head_dim: int = 128,
    elt: int = 2,
    smem: int | None = None,
    max_tokens: int = 0,
    tma: bool = False,
    mixable: bool = False,
    wide: bool = False,
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages) for the shared kernel, fitted to shared memory.

    Tall M tiles when many rows are stacked (fewer re-reads of the segment), from half the work when
    tall tiles would let the step run as one mixed launch (``mixable``: ``mixed_rule.may_mix``); the
    bf16 choice was measured on the H200 (docs/kernels.md §2.2), and ``fit_tiles`` shrinks it for
    4-byte elements or wider heads so that every dtype / head_dim fits (fp32 128 x 128 at d=128 needed
    256 KiB > 227 KiB). ``wide``: the Gluon kernel runs the tiles (``shared_gluon.eligible_for``) and
    192-row ones pay for the step's segments (``wide_tiles_pay``), so a tall step that will not mix
    takes them.
    """
    m = max_rows * group
    # 128-row tiles (two wgmma warpgroups) once the segment's work is large: at 256 rows the shared
    # kernel alone was 15-27% slower on them than on 64-row tiles for a 4K segment but 18% faster for
    # a 16K one (docs/kernels.md §2.2); a decode step that can then mix its own part in ran 3.7% faster
    # on them at 256 rows over 4K (B=64: 5.695 vs 5.915 ms a step, H200)
    work = TALL_WORK // 2 if mixable else TALL_WORK
    tall = m > 256 or m * max_tokens >= work
    block_m = 128 if tall else (64 if m > 16 else 16)
    block_m = max(block_m, next_power_of_2(group))
    if wide and tma and not mixable and block_m == 128 and elt == 2 and head_dim <= 128:
        return fit_tiles(WIDE_M, *SHARED_WIDE_TMA, head_dim, elt, smem or SMEM_LIMIT_HOPPER)
    table = (SHARED_TALL_TMA, SHARED_SHORT_TMA) if tma else (SHARED_TALL, SHARED_SHORT)
    block_n, stages = table[0] if block_m >= 128 else table[1]
    return fit_tiles(block_m, block_n, stages, head_dim, elt, smem or SMEM_LIMIT_HOPPER)


TALL_WORK = 256 * 8192  # stacked rows x segment tokens from which tiles are 128 rows tall
# 192-row tiles: three consumer warpgroups of the Gluon kernel (``shared_gluon``), so each program
# reads a segment's K and V for 1.5x the rows; they pay where padding the segments' stacked rows to 192
# adds at most WIDE_PAD to the work of padding them to 128 (H200, docs/kernels.md §2.3)
WIDE_M = 192
WIDE_PAD = 1.04


def wide_tiles_pay(stacked_rows: Sequence[int], tokens: Sequence[int] | None = None) -> bool:
    """True when the segments' ``stacked_rows`` (holder rows x GQA group each), padded to 192-row
    tiles, make at most ``WIDE_PAD`` times the work (rows x ``tokens``, each segment's) they make
    padded to 128-row tiles."""
    tokens = tokens if tokens is not None else [1] * len(stacked_rows)
    pads = [
        (math.ceil(m / WIDE_M) * WIDE_M * t, math.ceil(m / 128) * 128 * t)
        for m, t in zip(stacked_rows, tokens, strict=True)
    ]
    return sum(w for w, _ in pads) <= WIDE_PAD * sum(n for _, n in pads)


# (BLOCK_N, num_stages), measured on the H200 (docs/kernels.md §2.2): 128-row tiles are compute-bound
# at large B; 16 / 64-row tiles are bandwidth-bound and split along KV
SHARED_TALL = (128, 3)
SHARED_SHORT = (64, 2)
SHARED_TALL_TMA = (128, 3)
SHARED_WIDE_TMA = (128, 2)  # 192 query rows (48 KB, in a 64 KB buffer) leave two 64 KB K + V slots
SHARED_SHORT_TMA = (64, 3)


def tma_capable(device: torch.device, dtype: torch.dtype) -> bool:
    """TMA descriptor loads: 16-bit KV on a Hopper-or-newer GPU, or the CPU interpreter (tests)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # pragma: no cover - older Triton
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return os.environ.get("TRITON_INTERPRET") == "1"


def contiguous_first_rows(seg_blocks: np.ndarray, seg_block_start: list[int], block_size: int) -> np.ndarray:
    """Per segment, the cache row of its first token when its blocks are consecutive ids, else -1."""
    blocks = np.asarray(seg_blocks, dtype=np.int64)
    starts = np.asarray(seg_block_start, dtype=np.int64)
    first = np.full(len(starts) - 1, -1, dtype=np.int64)
    if blocks.size == 0:
        return first
    breaks = np.ones(blocks.size, dtype=np.int64)  # 1 where a block does not follow its predecessor
    breaks[1:] = blocks[1:] != blocks[:-1] + 1
    run = np.cumsum(breaks)
    lo, hi = starts[:-1], starts[1:]
    nonempty = hi > lo
    ok = np.zeros_like(nonempty)
    ok[nonempty] = run[hi[nonempty] - 1] == run[lo[nonempty]]
    first[ok] = blocks[lo[ok]] * block_size
    return first


# A program's fixed cost (q load, pipeline fill, partial store), as a fraction of one whole pass over
# its segment: what one more KV split adds. Only ranks split counts against each other.
SPLIT_COST = 0.02


def wave_splits(base_programs: int, slots: int, kmax: int, cost: float = SPLIT_COST) -> int:
    """KV splits per M-tile that make ``base_programs x k`` programs fill waves of ``slots`` best.

    Tall tiles fill an SM each, so a grid runs in ``ceil(programs / slots)`` waves, each as long as
    one program (1/k of a segment pass, plus ``cost``). B=256, P=16K (64 tiles, 132 SMs) used k=5:
    320 programs in three waves, the last 42% full; k=2 runs in one wave of 128.
    """
    base, slots = max(1, base_programs), max(1, slots)
    return min(range(1, max(1, kmax) + 1), key=lambda k: math.ceil(base * k / slots) * (1 / k + cost))


def _to_int32(values: np.ndarray) -> np.ndarray:
    """``values`` as int32, refusing values out of its range (as ``torch.tensor(..., dtype=int32)`` does)."""
    if values.size and (values.min() < np.iinfo(np.int32).min or values.max() > np.iinfo(np.int32).max):
        raise RuntimeError("a shared work item does not fit in int32")
    return values.astype(np.int32)


def plan_shared_work(
    seg_row_start: list[int],  # [G+1]
    seg_num_tokens: list[int],  # [G]
    kv_heads: int,
    group: int,
    device: torch.device,
    block_m: int | None = None,
    block_n: int | None = None,
    min_chunk: int = 256,
    target_programs: int | None = None,
    *,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    num_stages: int | None = None,
    items_on_host: bool = False,
    seg_blocks: np.ndarray | None = None,
    seg_block_start: list[int] | None = None,
    block_size: int = 0,
    mixable: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> SharedWork:
    """Cut every segment into M-tiles x KV splits so that about two waves of programs fill the SMs.

    Tiles depend on dtype and head_dim (shared memory), so pass the ones the kernel will run with.
    ``items_on_host=True`` leaves the work list on the host, for callers that pack it with other
    per-step tensors into one asynchronous copy (a plain ``.to(device)`` blocks the host).
    With the segments' blocks (``seg_blocks``, ``seg_block_start``, ``block_size``; host values) the
    work list notes contiguous segments, and the TMA path is taken when all of them are. ``mixable``:
    the step may run as one mixed launch on tall tiles (``pick_shared_tiles``). ``kv_dtype``: the
    cache's where it is not ``dtype`` (e4m3: the Gluon kernel widens its tiles, and there 192-row
    tiles lose to 128-row ones, docs/kernels.md §2.13).
    """
    rows = [b - a for a, b in itertools.pairwise(seg_row_start)]
    first_rows = np.full(len(rows), -1, dtype=np.int64)
    # a TMA box spans at most 256 elements per dimension: wider heads stay on pointer loads
    if (
        seg_blocks is not None
        and seg_block_start is not None
        and head_dim <= 256
        and tma_capable(device, dtype)
    ):
        first_rows = contiguous_first_rows(seg_blocks, seg_block_start, block_size)
    tma = bool(len(rows)) and bool((first_rows >= 0).all())
    limit = smem_limit(device)
    elt = torch.empty(0, dtype=dtype).element_size()
    auto_m, auto_n, auto_stages = pick_shared_tiles(
        max(rows, default=1),
        group,
        head_dim,
        elt,
        limit,
        max(seg_num_tokens, default=0),
        tma,
        tma and mixable,
        tma
        and kv_dtype in (None, dtype)
        and shared_gluon.eligible_for(device, dtype, head_dim)
        and wide_tiles_pay([r * group for r in rows], seg_num_tokens),
    )
    block_m, block_n, num_stages = fit_tiles(
        block_m or auto_m, block_n or auto_n, num_stages or auto_stages, head_dim, elt, limit
    )
    rows_per_tile = block_m // group
    base_programs = sum(math.ceil(r / rows_per_tile) for r in rows) * kv_heads
    if target_programs is None and block_m >= 128:
        # tall tiles fill an SM each (3-stage TMA: 229 KB of shared memory), so they run in waves of
        # one program per SM: split so the last wave is full
        kmax = max((math.ceil(t / min_chunk) for t in seg_num_tokens), default=1)
        want = wave_splits(base_programs, num_sms(device), min(kmax, 64))
    else:
        # short tiles aim at one program per SM: fewer, longer splits stream better (B=16, P=16K:
        # 58 -> 46 us; docs/kernels.md §2.2)
        target = target_programs or num_sms(device)
        want = max(1, math.ceil(target / max(1, base_programs)))
    tiles = (block_n, rows_per_tile)
    cut = _cut_segments(seg_row_start, rows, seg_num_tokens, first_rows, want, min_chunk, *tiles)
    items, splits, slot_base, slot_rows, slot = cut
    if not len(items):  # the kernels read at least one item (a zero-work one)
        items = np.array([(0, 0, 0, 0, 0, 0, -1)], dtype=np.int64)
    items_t = torch.from_numpy(_to_int32(items))
    return SharedWork(
        items=items_t if items_on_host else items_t.to(device),
        num_slots=slot,
        block_m=block_m,
        block_n=block_n,
        num_stages=num_stages,
        splits=splits,
        slot_base=slot_base,
        slot_row_index=torch.from_numpy(slot_rows),
        tma=tma,
    )


def _cut_segments(
    seg_row_start: list[int],
    rows: list[int],
    seg_num_tokens: list[int],
    first_rows: np.ndarray,
    want: int,
    min_chunk: int,
    block_n: int,
    rows_per_tile: int,
) -> tuple[np.ndarray, list[int], list[int], np.ndarray, int]:
    """Each segment cut into up to ``want`` KV splits (of ``min_chunk`` tokens or more, whole
    ``block_n`` tiles) x M-tiles: (items [I, ITEM_FIELDS] int64, splits and first slot per segment,
    slot rows, slots).

    The items of a segment are built as arrays: a 16K-token segment of 1,024 rows is ~2,000 items,
    which cost ~3 ms of host time a step as Python tuples.
    """
    items: list[np.ndarray] = []
    splits: list[int] = []
    slot_base: list[int] = []
    slot_rows: list[np.ndarray] = []
    slot = 0
    for g, (r0, n_rows, n_tok) in enumerate(zip(seg_row_start, rows, seg_num_tokens, strict=False)):
        k = max(1, min(want, math.ceil(n_tok / min_chunk)))
        size = math.ceil(math.ceil(max(n_tok, 1) / k) / block_n) * block_n
        k = max(1, math.ceil(n_tok / size))
        splits.append(k)
        slot_base.append(slot)
        first = int(first_rows[g])
        tiles = math.ceil(n_rows / rows_per_tile)
        # M-tile fastest: tiles of one KV chunk run together
        split = np.repeat(np.arange(k, dtype=np.int64), tiles)  # [k * tiles]
        a = r0 + np.tile(np.arange(tiles, dtype=np.int64) * rows_per_tile, k)  # first row of each tile
        lo = split * size  # first KV token of each split
        item = np.empty((k * tiles, ITEM_FIELDS), dtype=np.int64)
        item[:, 0] = g
        item[:, 1] = a
        item[:, 2] = np.minimum(r0 + n_rows, a + rows_per_tile)
        item[:, 3] = lo
        item[:, 4] = np.minimum(n_tok, lo + size)
        item[:, 5] = slot + split * n_rows + (a - r0)
        item[:, 6] = first + lo if first >= 0 else -1
        items.append(item)
        slot_rows.append(np.tile(np.arange(r0, r0 + n_rows, dtype=np.int64), k))
        slot += k * n_rows
    flat = np.concatenate(items) if items else np.zeros((0, ITEM_FIELDS), dtype=np.int64)
    return flat, splits, slot_base, np.concatenate(slot_rows or [np.zeros(0, dtype=np.int64)]), slot


def segment_tokens(plan: Any, block_size: int) -> list[int]:
    """KV rows of each segment: whole blocks, less the holes of a partly filled module block."""
    if getattr(plan, "seg_num_tokens_host", None):
        return list(plan.seg_num_tokens_host)
    return [(b - a) * block_size for a, b in itertools.pairwise(plan.seg_block_start_host)]


def plan_work_for(
    plan: Any,
    seg_blocks: np.ndarray | None,
    block_size: int,
    kv_heads: int,
    group: int,
    device: torch.device,
    head_dim: int,
    dtype: torch.dtype,
    mixable: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> SharedWork:
    """``plan_shared_work`` for a SharedPlan's segments (whole blocks), its work list left on the host.

    ``seg_blocks`` is the plan's block ids on the host (their contiguity picks the TMA path; None:
    pointer loads);
    ``mixable``: ``mixed_rule.may_mix`` for the step; ``kv_dtype``: the cache's, if not ``dtype``.
    """
    bstart = plan.seg_block_start_host
    return plan_shared_work(
        plan.seg_row_start_host,
        segment_tokens(plan, block_size),
        kv_heads,
        group,
        device,
        head_dim=head_dim,
        dtype=dtype,
        items_on_host=True,
        seg_blocks=seg_blocks,
        seg_block_start=bstart,
        block_size=block_size,
        mixable=mixable,
        kv_dtype=kv_dtype,
    )


# The shared kernel's bf16 rate and the own kernel's read bandwidth, measured on the H200
# (docs/kernels.md §2.1, §2.2): only their ratio is used, to tell a step whose own KV reads outlast
# its shared FLOPs.
SHARED_TFLOPS, OWN_TBPS = 490.0, 4.0
OWN_HEAVY = 1.5  # own time / shared time from which a step counts as own-heavy


def own_heavy(plan: Any, block_size: int, kv_heads: int, group: int, head_dim: int, elt: int) -> bool:
    """True when reading the step's own KV takes ``OWN_HEAVY`` x the shared kernel's tensor time.

    Packed own programs (``packed_decode_program``) stream better alone but fill the shared
    kernel's tail worse: measured 5-6% faster at B=256, S=512, P <= 4K and 1-4% slower where the
    shared part dominates (docs/kernels.md §2.1), so they are used only on own-heavy steps.
    """
    flops, own_bytes = step_size(plan, block_size, kv_heads, group, head_dim, elt)
    return own_bytes / (OWN_TBPS * 1e12) >= OWN_HEAVY * flops / (SHARED_TFLOPS * 1e12)


def step_size(
    plan: Any, block_size: int, kv_heads: int, group: int, head_dim: int, elt: int
) -> tuple[float, float]:
    """(shared FLOPs, own KV bytes) of a step's plan: what the shared and own kernels must do."""
    rows = np.diff(np.asarray(plan.seg_row_start_host, dtype=np.int64))
    tokens = np.asarray(segment_tokens(plan, block_size), dtype=np.int64)
    flops = 4 * group * kv_heads * head_dim * float((rows * tokens).sum())
    own_bytes = 2 * elt * kv_heads * head_dim * float(sum(plan.own_seq_lens_host))
    return flops, own_bytes


__all__ = ["ITEM_FIELDS", "SharedWork", "plan_shared_work", "plan_work_for"]
