"""e4m3 walks of ``attend.attend_range_fetched`` no other CPU test reaches: a decode step's splits with
their block ids read ahead (PAGES > 0) and runs starting inside blocks, at fp32 tolerance; and the
window kernel's walk (WINDOWED), which ``attend_layer`` never launches on the CPU."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE, e4m3_cache, rel_err
from test_fp8_kv_kernels import reference

from prefixserve.attention.metadata import build_metadata


@pytest.mark.parametrize("ahead", [None, 0])
@pytest.mark.parametrize(
    ("bs", "block_n", "dim", "split_size", "splits"),
    [
        (16, 64, 64, 64, 3),  # whole blocks, whole tiles
        (32, 16, 32, 0, 5),  # per-sequence splits (a graph's), 16-key tiles: runs start inside blocks
        (16, 16, 128, 48, 3),  # runs of three blocks, 16-key tiles
        (16, 32, 256, 0, 4),  # 256-wide heads
    ],
)
def test_fp8_decode_splits_match_fp64(bs, block_n, dim, split_size, splits, ahead) -> None:
    """A decode step's merged splits over an e4m3 cache, each split's words fetched a tile ahead
    (``attend.attend_range_fetched``), with its block ids read before the walk (``ahead`` None:
    ``attend_range_ahead``, PAGES > 0) or a tile at a time (0): fp32 q against fp64 attention over
    the same codes, to fp32 rounding; sequences of one key and shorter than a tile, splits past a
    sequence's end (empty runs), runs ending inside a block."""
    from prefixserve.attention.kernels import paged_attention as pa

    gen = torch.Generator().manual_seed(dim + bs)
    lens, hkv, group = [1, 9, 37, 130], 2, 4
    k, v, tables, bt = e4m3_cache(lens, bs, hkv, dim, gen)
    n, hq = len(lens), hkv * group
    q = torch.randn(n, hq, dim, generator=gen).to(DEVICE)
    scale = dim**-0.5
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(n + 1, dtype=torch.int32, device=DEVICE)
    if split_size:
        assert splits * split_size >= max(lens)
    limit = pa.PAGES_AHEAD if ahead is None else ahead
    assert (pa.walk_pages(split_size, splits, bt.shape[1], bs, block_n, limit) > 0) == (ahead is None)
    out = torch.empty(n, hq, dim, device=DEVICE)
    lse = torch.empty(n, hq, device=DEVICE)
    o_part = torch.empty(splits * n, hq, dim, device=DEVICE)
    l_part = torch.empty(splits * n, hq, device=DEVICE)
    counts = torch.zeros(n * hkv, dtype=torch.int32, device=DEVICE)
    pa.launch_paged(
        q, k, v, bt, sl, qsl, scale, 1, splits, split_size, o_part, l_part, o_part.stride(0) * n, hq * n,
        block_n, merged=(out, lse, counts), pages_ahead=ahead,
    )  # fmt: skip
    ref, parts = reference(q.cpu(), k.cpu().float(), v.cpu().float(), tables, lens, [1] * n, scale)
    assert rel_err(out.cpu(), ref) < 1e-5
    assert (lse.cpu().double() - torch.cat([p[-1] for p in parts])).abs().max() < 1e-5
    assert not counts.any()


SEQ_LENS, LONG_SEQ_LENS = [70, 33, 90, 41], [70, 33, 190, 141]


@pytest.mark.parametrize(
    ("query_lens", "window", "group", "dim", "seq_lens", "dtype", "tol"),
    [
        ([1, 1, 1, 1], 5, 2, 64, SEQ_LENS, torch.float32, 1e-5),  # decode rows, windows inside blocks, tiles
        ([1, 3, 1, 2], 20, 2, 64, SEQ_LENS, torch.float32, 1e-5),  # decode and prefill rows in 16-row tiles
        ([2, 1, 4, 1], 37, 2, 32, SEQ_LENS, torch.float32, 1e-5),
        ([1, 1, 1, 1], 20, 2, 256, SEQ_LENS, torch.bfloat16, 1e-2),  # 256-wide heads: 16-key tiles, 2 warps
        ([1, 1, 1, 1], 45, 2, 64, SEQ_LENS, torch.float16, 1e-2),  # 64-key tiles: cut into walks
        ([1, 2, 1, 3], 100, 2, 64, SEQ_LENS, torch.float16, 1e-2),
        # GQA 8, 128-wide heads: 64-key tiles cut into walks; windows starting inside a walk, and one
        # longer than a sequence (bf16 outputs: tolerances as test_fp8_walks_coverage.py's)
        ([1, 1, 1, 1], 45, 8, 128, LONG_SEQ_LENS, torch.float16, 1e-3),
        ([2, 1, 1, 2], 100, 8, 128, LONG_SEQ_LENS, torch.bfloat16, 6e-3),
        ([1, 1, 1, 1], 150, 8, 128, LONG_SEQ_LENS, torch.bfloat16, 6e-3),
    ],
)
def test_fp8_window_kernel_matches_fp64(query_lens, window, group, dim, seq_lens, dtype, tol) -> None:
    """The window kernel's walk over an e4m3 cache (``attend_range`` WINDOWED, fetched a tile ahead),
    called directly: on the CPU ``attend_layer`` takes the torch path and never launches it."""
    from prefixserve.attention.kernels.window_attention import window_attention as window_kernel

    gen = torch.Generator().manual_seed(window if group == 8 else dim + window)
    bs, hkv = 16, 2
    k, v, tables, _ = e4m3_cache(seq_lens, bs, hkv, dim, gen)
    q = torch.randn(sum(query_lens), hkv * group, dim, generator=gen).to(DEVICE, dtype)
    meta = build_metadata(bs, query_lens, seq_lens, tables, DEVICE)
    scale = dim**-0.5
    ref, _ = reference(q.cpu().float(), k.cpu().float(), v.cpu().float(), tables, seq_lens, query_lens,
                       scale, window)  # fmt: skip
    out = window_kernel(q, k, v, meta, scale, window)
    assert rel_err(out.cpu(), ref) < tol


def test_an_e4m3_cache_off_four_byte_strides_is_refused() -> None:
    """The e4m3 walks read codes as int32 words: a cache whose rows are not 4-byte aligned (the engine
    never makes one) is refused by name, not read wrong."""
    from prefixserve.attention.planning.tiles import check_cache

    q = torch.zeros(2, 2, 32, device=DEVICE)
    padded = torch.zeros(4, 16, 1, 33, device=DEVICE).to(torch.float8_e4m3fn)[..., :32]
    with pytest.raises(ValueError, match="multiples of 4 bytes"):
        check_cache(q, padded, padded)
    whole = torch.zeros(4, 16, 1, 32, device=DEVICE).to(torch.float8_e4m3fn)
    assert check_cache(q, whole, whole) == (2, 1, 32, 16)
