"""Host work of a step on the Triton path, shared by the eager backend (``attention/triton_backend.py``)
and the decode graphs (``attention/graph_attention.py``): the shared plan made on the host and moved to
the device in one asynchronous copy, and the per-step rules (own pack, shared / own sizes).

Nothing here reads the device: the engine's metadata carries host copies of the block tables and
lengths, and a blocking copy would wait for the step in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.plan import SharedPlan, make_plan
from prefixserve.attention.planning.shared_plan import segment_tokens
from prefixserve.host_copy import to_device_packed as packed_on_device

if TYPE_CHECKING:  # annotations only: mixed_rule imports the Gluon kernels
    from prefixserve.attention.planning.mixed_rule import MixedTiles


def to_device_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Int host arrays on ``device`` as int32 (what the kernels take) in one asynchronous copy;
    returns 1-d views, in order."""
    return packed_on_device([np.ravel(a) for a in arrays], device, np.int32)


def host_plan(meta: AttentionMetadata) -> Any:
    """``make_plan`` on the host: every tensor of the returned SharedPlan is a CPU tensor.

    The engine's metadata carries a host copy of the block tables (``block_tables_np``), so nothing
    is read back from the device (which would wait for the step in flight); the device read below
    only serves callers without one.
    """
    tables = meta.block_tables
    if tables.device.type != "cpu":  # plan into CPU tensors, from the host copy when there is one
        host = tables.cpu() if meta.block_tables_np is None else torch.from_numpy(meta.block_tables_np)
        meta = dataclasses.replace(meta, block_tables=host, plan=None, stats={}, window_plans={})
    return make_plan(meta)


def plan_to_device(plan: Any, device: torch.device) -> Any:
    """Move a host SharedPlan's tensors to ``device`` with one asynchronous copy (shapes kept)."""
    if device.type == "cpu":
        return plan
    host = [getattr(plan, name) for name in SharedPlan.TENSOR_FIELDS]
    flat = to_device_packed([t.numpy() for t in host], device)
    for name, h, d in zip(SharedPlan.TENSOR_FIELDS, host, flat, strict=True):
        setattr(plan, name, d.view(h.shape))
    return plan


def seg_rows_host(plan: Any, meta: AttentionMetadata) -> np.ndarray:
    """Query rows of every segment's holders, holder-major (what plan.seg_rows holds on the device)."""
    holders = np.fromiter(itertools.chain.from_iterable(plan.seg_holders_host), dtype=np.int64)
    qlens = np.asarray(meta.query_lens_host, dtype=np.int64)
    qsl = np.r_[0, np.cumsum(qlens)]
    counts = qlens[holders]
    offsets = np.r_[0, np.cumsum(counts)[:-1]]
    return np.repeat(qsl[holders] - offsets, counts) + np.arange(int(counts.sum()))


def own_pack_rule(plan: Any, num_seqs: int, shape: tuple[int, int, int, int], block_size: int, device) -> int:
    """Decode sequences per own-kernel program for a shared step; ``shape`` = (Hq, Hkv, D, element size).

    Packed (``decode_pack``) only on own-heavy steps (``own_heavy``) that still give every SM two
    programs: at B=16-64 packing left SMs idle (B=16, P=1K, S=512: 0.033 -> 0.055 ms; docs/kernels.md §2.1).
    """
    from prefixserve.attention.kernels.packed_decode import decode_pack
    from prefixserve.attention.planning import tiles
    from prefixserve.attention.planning.shared_plan import own_heavy

    q_heads, kv_heads, dim, elt = shape
    group = q_heads // kv_heads
    pack = decode_pack(group, 1)
    if pack == 1 or -(-num_seqs // pack) * kv_heads < 2 * tiles.num_sms(device):
        return 1
    return pack if own_heavy(plan, block_size, kv_heads, group, dim, elt) else 1


def step_sizes(plan: Any, block_size: int) -> tuple[int, int]:
    """(holder rows x KV tokens summed over segments, own KV tokens): a step's shared FLOPs and own
    bytes, up to constant factors (``mixed_rule`` weighs one against the other for steps of several
    segments, and picks own tile heights by their ratio)."""
    rows = np.diff(plan.seg_row_start_host)
    seg_tokens = np.asarray(segment_tokens(plan, block_size), dtype=np.int64)
    return int((rows * seg_tokens).sum()), int(sum(plan.own_seq_lens_host))


def plan_step_work(
    plan: Any,
    seg_blocks: np.ndarray,
    block_size: int,
    shape: tuple[int, int, int],  # (Hq, Hkv, D)
    device: torch.device,
    dtype: torch.dtype,
    max_query_len: int,
    num_seqs: int,
    mode: str | None = None,  # PREFIXSERVE_MIXED's values; None: the switch
    memo: dict[tuple[Any, ...], Any] | None = None,
    kv_dtype: torch.dtype | None = None,  # the cache's, where it is not ``dtype`` (e4m3)
    tma: bool = True,  # False: pointer loads even over contiguous segments (a graph's plain twin)
) -> tuple[Any, MixedTiles | None]:
    """A shared step's work list and its mixed launch's tiles (``mixed_rule.MixedTiles``; None: two
    kernels), as the eager backend and the decode graphs both plan them: the mixed rule is asked
    before the work list (a step that may mix prefers tall tiles) and after it (the tiles it got).
    Over a cache of another dtype (e4m3) a step never mixes (the mixed kernel's own tiles take the
    cache's dtype only) and takes no 192-row tiles (``plan_shared_work``).

    ``memo`` keeps the work list, which depends on the segments alone, for later steps of a plan
    carried on (``SharedPlan.derived``); the caller must not change it (the eager path moves its
    items to the device, so it passes none)."""
    from prefixserve.attention.planning import mixed_rule
    from prefixserve.attention.planning.shared_plan import plan_work_for

    q_heads, kv_heads, dim = shape
    shared_row_tokens, own_tokens = step_sizes(plan, block_size)
    sizes = (max_query_len, shared_row_tokens, own_tokens, num_seqs, mode)
    rule = {"block_size": block_size, "segments": plan.num_segments}
    own_dtype = kv_dtype in (None, dtype)
    mixable = own_dtype and mixed_rule.may_mix(device, dtype, shape, *sizes, **rule)
    group = q_heads // kv_heads
    key = ("work", block_size, shape, str(device), dtype, kv_dtype, mixable, tma)
    work = None if memo is None else memo.get(key)
    if work is None:
        blocks = seg_blocks if tma else None  # without the blocks no segment counts as contiguous
        args = (plan, blocks, block_size, kv_heads, group, device, dim, dtype, mixable, kv_dtype)
        work = plan_work_for(*args)
        if memo is not None:
            memo[key] = work
    return work, mixed_rule.mixed_rows(device, dtype, shape, work, *sizes, **rule) if own_dtype else None


__all__ = [
    "host_plan",
    "own_pack_rule",
    "plan_step_work",
    "plan_to_device",
    "seg_rows_host",
    "step_sizes",
    "to_device_packed",
]
