"""Shared-segment kernel vs the oracle: stacked holders, rows in several segments, KV splits, GQA."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from _kernel_helpers import DEVICE, rel_err

from prefixserve.attention.kernels.shared_attention import (
    launch_shared,
    shared_segment_attention,
    shared_segment_attention_ref,
)
from prefixserve.attention.planning.shared_plan import own_heavy, plan_shared_work, step_size, wave_splits

KV_HEADS = 2


def _segments(block_size: int, dim: int, dtype: torch.dtype, gen: torch.Generator):
    k = torch.randn(24, block_size, KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(24, block_size, KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
    segs = [[3, 5, 7, 1], [10, 11], [20]]  # blocks, in order
    rows = [[0, 2, 4, 5, 6], [1, 2], [3, 0, 5]]  # rows 0, 2, 5 are in two segments each
    i32 = {"dtype": torch.int32, "device": DEVICE}
    seg_blocks = torch.tensor([b for s in segs for b in s], **i32)
    seg_block_start = torch.tensor([0, *torch.tensor([len(s) for s in segs]).cumsum(0).tolist()], **i32)
    seg_num_tokens = torch.tensor([len(s) * block_size for s in segs], **i32)
    seg_rows = torch.tensor([r for rs in rows for r in rs], **i32)
    seg_row_start = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()], **i32)
    return k, v, (seg_blocks, seg_block_start, seg_num_tokens, seg_rows, seg_row_start)


@pytest.mark.parametrize(
    ("group", "dim", "block_size", "split"),
    [(1, 64, 16, False), (4, 64, 16, True), (8, 128, 32, True), (4, 128, 16, False)],
)
def test_matches_reference(group: int, dim: int, block_size: int, split: bool) -> None:
    gen = torch.Generator().manual_seed(group + dim)
    k, v, seg = _segments(block_size, dim, torch.float32, gen)
    q = torch.randn(7, KV_HEADS * group, dim, generator=gen).to(DEVICE)
    kw = {"min_chunk": 16, "block_n": 16, "target_programs": 10_000} if split else {}
    o, lse = shared_segment_attention(q, k, v, *seg, 0.1, **kw)
    if split:
        assert o.shape[0] == seg[3].numel()  # merged back from several slots per row
    ref_o, ref_lse = shared_segment_attention_ref(q, k, v, *seg, 0.1, torch.float64)
    assert o.shape == (seg[3].numel(), KV_HEADS * group, dim) and o.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-5
    assert float((lse.double() - ref_lse).abs().max()) < 1e-4


def test_every_slot_is_written() -> None:
    """Poison the partial buffers: with splits, every (row, split) slot must be overwritten."""
    gen = torch.Generator().manual_seed(5)
    k, v, (sb, sbs, snt, sr, srs) = _segments(16, 64, torch.float32, gen)
    q = torch.randn(7, KV_HEADS * 4, 64, generator=gen).to(DEVICE)
    work = plan_shared_work(
        srs.tolist(), snt.tolist(), KV_HEADS, 4, q.device, block_n=16, min_chunk=16, target_programs=99
    )
    assert work.num_slots > sr.numel()  # the long segment was split
    o = torch.full((work.num_slots, KV_HEADS * 4, 64), math.nan, device=DEVICE)
    lse = torch.full((work.num_slots, KV_HEADS * 4), math.nan, device=DEVICE)
    launch_shared(q, k, v, sb, sbs, sr, work, 0.1, o, lse)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()


def test_bf16_close_to_fp64() -> None:
    gen = torch.Generator().manual_seed(6)
    k, v, seg = _segments(16, 64, torch.bfloat16, gen)
    q = torch.randn(7, KV_HEADS * 4, 64, generator=gen).to(DEVICE, torch.bfloat16)
    o, _ = shared_segment_attention(q, k, v, *seg, 0.1, block_n=16, min_chunk=16, target_programs=10_000)
    ref_o, _ = shared_segment_attention_ref(q, k, v, *seg, 0.1, torch.float64)
    assert rel_err(o, ref_o) < 1.5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("rows", [4, 16, 1024])
def test_tiles_fit_shared_memory(dtype: torch.dtype, dim: int, rows: int) -> None:
    """Every supported dtype / head_dim gets shared and paged tiles that fit the Hopper limit."""
    from prefixserve.attention.kernels.paged_attention import pick_block_m
    from prefixserve.attention.planning.tiles import SMEM_LIMIT_HOPPER, fit_tiles, tile_smem_bytes

    elt = torch.empty(0, dtype=dtype).element_size()
    work = plan_shared_work([0, rows], [4096], 8, 4, torch.device("cpu"), head_dim=dim, dtype=dtype)
    need = tile_smem_bytes(work.block_m, work.block_n, dim, elt, work.num_stages)
    assert need <= SMEM_LIMIT_HOPPER and work.num_stages >= 1
    if rows * 4 > 64:
        assert work.block_m >= 64  # tall tiles are given up last
    for query_len in (1, 64):
        bm = pick_block_m(query_len * 4, 4)
        bm, bn, stages = fit_tiles(bm, 64, 3, dim, elt, SMEM_LIMIT_HOPPER)
        assert tile_smem_bytes(bm, bn, dim, elt, stages) <= SMEM_LIMIT_HOPPER
    # the case that overflowed on the H200: fp32, 128 x 128, 2 stages, d=128 (256 KiB)
    assert tile_smem_bytes(128, 128, 128, 4, 2) > SMEM_LIMIT_HOPPER


def test_wave_splits_fill_the_last_wave() -> None:
    """Tall tiles run one per SM: 64 tiles on 132 SMs split in 2 (one full wave), not 5 (three waves,
    the last 42% full); 16 tiles split in 8; 256 tiles already make two nearly full waves."""
    assert wave_splits(64, 132, 64) == 2
    assert wave_splits(16, 132, 64) == 8
    assert wave_splits(256, 132, 64) == 1
    assert wave_splits(64, 132, 1) == 1  # a segment too short to split


def test_own_heavy_compares_own_reads_with_shared_flops() -> None:
    """B=1024 decode rows over a 16K prefix: S=128 own tokens are shared-heavy, a 1K prefix is own-heavy."""

    def plan(prefix: int, suffix: int, batch: int = 1024) -> SimpleNamespace:
        return SimpleNamespace(
            seg_row_start_host=[0, batch],
            seg_block_start_host=[0, prefix // 16],
            own_seq_lens_host=[suffix] * batch,
        )

    assert not own_heavy(plan(16384, 128), 16, 8, 4, 128, 2)
    assert not own_heavy(plan(16384, 512), 16, 8, 4, 128, 2)  # about even: the shared kernel's tail wins
    assert own_heavy(plan(1024, 512), 16, 8, 4, 128, 2)
    assert own_heavy(plan(4096, 512, 256), 16, 8, 4, 128, 2)
    flops, own = step_size(plan(4096, 512), 16, 8, 4, 128, 2)
    assert flops == 4 * 4 * 8 * 128 * 1024 * 4096 and own == 2 * 2 * 8 * 128 * 1024 * 512
