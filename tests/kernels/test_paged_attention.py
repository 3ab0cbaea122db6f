"""Paged kernel vs the oracle: decode, prefill chunks, mixed; GQA 1/4/8; d 64/128; blocks 16/32; splits."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import DEVICE, padded_table, paged_cache, rel_err

from prefixserve.attention.kernels.packed_decode import decode_pack
from prefixserve.attention.kernels.paged_attention import paged_attention, paged_attention_ref

KV_HEADS = 2


def _run(
    query_lens: list[int],
    seq_lens: list[int],
    group: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_splits: int | None = None,
    seed: int = 0,
    pack: int = 1,
) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    k, v, tables = paged_cache(seq_lens, block_size, KV_HEADS, dim, dtype, gen)
    bt = padded_table(tables)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(query_lens), KV_HEADS * group, dim, generator=gen).to(DEVICE, dtype)
    scale = 1 / math.sqrt(dim)
    out = torch.full_like(q, math.nan)  # poison: an unwritten row fails
    o, lse = paged_attention(
        q, k, v, bt, sl, qsl, scale, max(query_lens), num_splits=num_splits, out=out, pack=pack
    )
    assert o.data_ptr() == out.data_ptr() and o.dtype == dtype and lse.dtype == torch.float32
    ref_o, ref_lse = paged_attention_ref(q, k, v, bt, sl, qsl, scale, torch.float64)
    same = lse.double() == ref_lse  # equal -inf (a row with no KV) differs by nothing, not NaN
    return rel_err(o, ref_o), float(torch.where(same, 0.0, lse.double() - ref_lse).abs().max())


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("dim", "block_size"), [(64, 16), (128, 32)])  # a block size only addresses tokens
def test_decode_ragged(group: int, dim: int, block_size: int) -> None:
    err, lse_err = _run([1, 1, 1], [1, 37, 70], group, dim, block_size)
    assert err < 1e-5 and lse_err < 1e-4


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_chunks_causal(group: int) -> None:
    # chunk after a cached context, a whole prompt, and a chunk longer than one query tile
    err, lse_err = _run([5, 9, 20], [21, 9, 52], group, 64, 16)
    assert err < 1e-5 and lse_err < 1e-4


def test_mixed_decode_and_prefill_with_splits() -> None:
    err, lse_err = _run([1, 6, 1, 3], [40, 6, 90, 33], 4, 64, 16, num_splits=3)
    assert err < 1e-5 and lse_err < 1e-4


def test_split_kv_decode_gqa8_d128() -> None:
    err, lse_err = _run([1, 1], [100, 17], 8, 128, 32, num_splits=4)
    assert err < 1e-5 and lse_err < 1e-4


def test_bf16_error_is_bf16_rounding() -> None:
    err, _ = _run([1, 4, 1], [50, 30, 9], 4, 64, 16, dtype=torch.bfloat16, num_splits=2)
    assert err < 1.5e-2


def test_empty_sequence_gives_zero_and_minus_inf() -> None:
    """A part with no KV (an empty own part) must come back as o = 0, lse = -inf, never NaN."""
    gen = torch.Generator().manual_seed(3)
    k, v, _ = paged_cache([16], 16, KV_HEADS, 64, torch.float32, gen)
    q = torch.randn(2, KV_HEADS * 4, 64, generator=gen).to(DEVICE)
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    o, lse = paged_attention(q, k, v, bt, sl, qsl, 0.1, 1, out=torch.full_like(q, math.nan))
    assert (o[0] == 0).all() and (lse[0] == -math.inf).all()
    assert torch.isfinite(o[1]).all() and torch.isfinite(lse[1]).all()


def test_launcher_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(4)
    k, v, _ = paged_cache([16], 16, KV_HEADS, 64, torch.float32, gen)
    q = torch.randn(1, 4, 64, device=DEVICE)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([16], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError):
        paged_attention(q.half(), k, v, bt, sl, qsl, 0.1, 1)
    with pytest.raises(TypeError):
        paged_attention(q, k, v, bt.long(), sl, qsl, 0.1, 1)
    with pytest.raises(ValueError):
        paged_attention(q[..., :48], k[..., :48], v[..., :48], bt, sl, qsl, 0.1, 1)


@pytest.mark.parametrize(
    ("group", "pack", "block_size"), [(1, 4, 16), (4, 4, 32), (4, 2, 16), (8, 2, 32), (4, 8, 16)]
)
def test_packed_decode_matches_reference(group: int, pack: int, block_size: int) -> None:
    """Several sequences per program (block-diagonal tiles): ragged lengths, a pack cut short by the
    batch's end, an empty own part, and KV splits that leave some packed sequences without tokens.
    Block sizes alternate over the packs: the kernel only addresses a token's block by them."""
    seq_lens = [1, 37, 70, 0, 16, 5, 129]
    for splits in (None, 3):
        err, lse_err = _run(
            [1] * len(seq_lens), seq_lens, group, 64, block_size, num_splits=splits, pack=pack
        )
        assert err < 1e-5 and lse_err < 1e-4


def test_packed_decode_bf16_equals_unpacked() -> None:
    """Packing changes which rows share a tile, not any row's sums: bf16 outputs match the unpacked path."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [40, 9, 77, 64, 3]
    k, v, tables = paged_cache(seq_lens, 16, KV_HEADS, 128, torch.bfloat16, gen)
    bt = padded_table(tables)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), KV_HEADS * 4, 128, generator=gen).to(DEVICE, torch.bfloat16)
    plain = paged_attention(q, k, v, bt, sl, qsl, 0.09, 1, num_splits=1)
    packed = paged_attention(q, k, v, bt, sl, qsl, 0.09, 1, num_splits=1, pack=4)
    assert (plain[0].float() - packed[0].float()).abs().max() <= 1e-2
    assert torch.allclose(plain[1], packed[1], atol=1e-4)


def test_decode_pack_fills_sixteen_rows() -> None:
    assert [decode_pack(g, 1) for g in (1, 2, 3, 4, 8, 16)] == [16, 8, 4, 4, 2, 1]
    assert decode_pack(4, 2) == 1  # prefill rows: one sequence per program


def test_packed_decode_gqa3() -> None:
    """The default model's grouping (9 query heads over 3 KV heads): 12 real rows of a 16-row tile."""
    err, lse_err = _run([1] * 5, [3, 40, 17, 0, 65], 3, 64, 16, pack=decode_pack(3, 1))
    assert err < 1e-5 and lse_err < 1e-4


@pytest.mark.parametrize(
    ("group", "splits", "longest"), [(3, 5, 130), (4, 9, 130), (1, 2, 130), (8, 37, 600)]
)
def test_decode_splits_merged_by_the_last_program(group: int, splits: int, longest: int) -> None:
    """A decode step's splits merged inside the kernel (``merge_last``: the last program of each
    sequence and KV head to finish) against the oracle, with GQA groups that are not powers of two,
    sequences shorter than a split (empty splits: o = 0, lse = -inf parts) and an empty sequence; the
    counts are back at zero after every call, so a second call (a graph replay) merges again. The
    long case fills more splits than one merge turn loads (a split holds at least 64 tokens: 10
    splits, ``MERGE_UNROLL`` 8 a turn, the second turn part masked) and runs one seed."""
    from prefixserve.attention.kernels import paged_attention as paged
    from prefixserve.attention.kernels.paged_attention import merge_counts

    long = longest > 500
    assert not long or math.ceil(longest / 64) > paged.MERGE_UNROLL  # splits of 64: two turns or more
    for seed in range(1 if long else 2):
        lens = [3, 77, 0, longest]
        err, lse_err = _run([1, 1, 1, 1], lens, group, 64, 16, num_splits=splits, seed=seed)
        assert err < 1e-5 and lse_err < 1e-4
        assert int(merge_counts(torch.device(DEVICE), 4 * KV_HEADS).count_nonzero()) == 0


def test_the_merged_launchs_output_position_is_its_out_ptr() -> None:
    """Later layers relaunch a merged launch with their output at ``PAGED_MERGED``'s position."""
    from prefixserve.attention.kernels import paged_attention as paged
    from prefixserve.attention.step_launch import PAGED_MERGED

    names = list(paged._paged_kernel.arg_names)
    assert PAGED_MERGED[3] == paged.MERGED_OUT and names[paged.MERGED_OUT] == "out_ptr"
    assert PAGED_MERGED[:3] == (names.index("q_ptr"), names.index("k_ptr"), names.index("v_ptr"))


def _spy_ahead(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``PAGES_AHEAD`` of every paged launch from now on (0: a tile's ids loaded with the tile)."""
    from prefixserve.attention.kernels import paged_attention as paged

    seen: list[int] = []
    real = paged.launch_fitting
    monkeypatch.setattr(
        paged, "launch_fitting", lambda *a, **kw: seen.append(kw["PAGES_AHEAD"]) or real(*a, **kw)
    )
    return seen


@pytest.mark.parametrize("ahead", [0, 256])
@pytest.mark.parametrize(
    ("splits", "longest", "block_size"),
    [(5, 130, 16), (2, 300, 16), (9, 600, 16), (3, 200, 32), (7, 200, 64)],
)
def test_block_ids_read_ahead_or_per_tile(
    monkeypatch: pytest.MonkeyPatch, ahead: int, splits: int, longest: int, block_size: int
) -> None:
    """Each program's block ids read in one load before its walk (``attend_range_ahead``: a decode
    step's splits whose runs' blocks fit ``PAGES_AHEAD``) or a tile at a time, against the oracle;
    prefill chunks beside, a tile at a time even with the ids ahead on (with them off the same
    launch as the other case's)."""
    from prefixserve.attention.kernels import paged_attention as paged

    monkeypatch.setattr(paged, "PAGES_AHEAD", ahead)
    seen = _spy_ahead(monkeypatch)
    err, lse_err = _run([1, 1, 1, 1], [3, 77, 0, longest], 4, 64, block_size, num_splits=splits)
    assert err < 1e-5 and lse_err < 1e-4
    assert (seen[-1] > 0) == (ahead > 0)
    if ahead:
        err, lse_err = _run([3, 1, 5], [40, longest, 130], 4, 64, block_size, num_splits=splits)
        assert err < 1e-5 and lse_err < 1e-4
        assert seen[-1] == 0


def _graph_decode(lens: list[int], bs: int, width: int, splits: int, kv_dtype: torch.dtype | None = None):
    """A graph's decode launch (``split_size`` 0: each sequence's splits sized in the kernel) and the
    merge, fp32 (or bf16 q over an e4m3 cache); (output, oracle)."""
    from prefixserve.attention.kernels import paged_attention as paged
    from prefixserve.attention.kernels.merge import merge_partials

    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if kv_dtype is None else torch.bfloat16
    k, v, tables = paged_cache(lens, bs, 2, 64, torch.float32, gen)
    k, v = (k.to(kv_dtype), v.to(kv_dtype)) if kv_dtype is not None else (k, v)
    bt = padded_table(tables, width)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 6, 64, generator=gen).to(DEVICE, dtype)
    t, h = q.shape[:2]
    o = torch.full((splits * t, h, 64), math.nan, device=DEVICE)
    lse = torch.full((splits * t, h), math.nan, device=DEVICE)
    paged.launch_paged(q, k, v, bt, sl, qsl, 0.1, 1, splits, 0, o, lse, t * h * 64, t * h, 64)
    out, _ = merge_partials(o, lse, t, num_parts=splits, part_stride=t)
    ref, _ = paged_attention_ref(q.float(), k.float(), v.float(), bt, sl, qsl, 0.1, torch.float64)
    return out, ref


@pytest.mark.parametrize(("fitted_n", "block_size"), [(64, 16), (16, 16), (64, 64), (16, 64), (16, 128)])
def test_graph_decode_reads_ids_ahead_when_the_tiles_narrow(
    monkeypatch: pytest.MonkeyPatch, fitted_n: int, block_size: int
) -> None:
    """Splits sized in the kernel start at multiples of the tile width the launch ends up with, which
    ``fit_tiles`` may narrow after the ids' count was chosen: inside a block then (a 64-token block
    read from a 16-token tile's start missed a block before ``walk_pages`` counted one more)."""
    from prefixserve.attention.kernels import paged_attention as paged

    monkeypatch.setattr(paged, "fit_tiles", lambda m, n, s, *a: (m, min(n, fitted_n), s))
    seen = _spy_ahead(monkeypatch)
    width = max(4, 128 // block_size)  # 8 blocks of 16, 4 of 64 or 128: each split spans several
    out, ref = _graph_decode(
        [width * block_size - 2 * fitted_n, 0, 1, width * block_size // 2 + 3], block_size, width, 2
    )
    assert rel_err(out, ref) < 1e-5 and seen[-1] > 0


def test_an_e4m3_caches_splits_read_ahead_equal_a_tile_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 q over an e4m3 cache, decode splits: the ids read ahead give the per-tile walk's attention.
    Not bit for bit: a tile at a time, a program's tiles are cut into walks (``attend.E4M3_WALKS``),
    each with its own running max, so P rounds to fp16 differently."""
    from prefixserve.attention.kernels import paged_attention as paged

    lens = [250, 3, 0, 129]  # two splits of two 64-key tiles at most
    ahead, ref = _graph_decode(lens, 32, 8, 2, torch.float8_e4m3fn)
    monkeypatch.setattr(paged, "PAGES_AHEAD", 0)
    per_tile, _ = _graph_decode(lens, 32, 8, 2, torch.float8_e4m3fn)
    assert rel_err(ahead, per_tile) < 5e-3 and rel_err(ahead, ref) < 1e-2 and rel_err(per_tile, ref) < 1e-2


def test_walk_pages_bounds_the_blocks_a_program_spans() -> None:
    """Against the kernel's own runs (``paged_program``: [split * size, + size) cut at the sequence's
    end; size the given split size, or each sequence's even share rounded up to the launch's tile
    width, which may be narrower than the width asked for), over block sizes, tiles, splits and
    table widths."""
    from prefixserve.attention.kernels.paged_attention import walk_pages

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    assert walk_pages(512, 32, 1024, 16, 64, 256) == 32  # a B=1 16K decode's splits
    assert walk_pages(0, 32, 1024, 16, 64, 256) == 32  # sized per sequence: the table's width bounds it
    assert walk_pages(0, 1, 8192, 16, 64, 256) == 0  # a whole long table: each tile loads its own
    assert walk_pages(512, 32, 1024, 16, 64, 0) == 0
    for bs in (8, 12, 16, 32, 64, 128):
        for asked in (4, 16, 64, 128):  # a tile asked narrower than MIN_BLOCK_N runs as asked
            for tile in [n for n in (16, 32, 64, 128) if n <= asked] or [asked]:
                for splits in (2, 3, 5, 33):
                    for width in (1, 3, 8, 17):
                        for seq_len in range(0, width * bs + 1, max(1, bs // 2)):
                            for given in (0, cdiv(cdiv(max(seq_len, 1), splits), asked) * asked, 30):
                                size = given or cdiv(cdiv(seq_len, splits), tile) * tile
                                pages = walk_pages(given, splits, width, bs, asked, 1 << 30)
                                for k in range(splits):
                                    lo, hi = k * size, min(k * size + size, seq_len)
                                    if hi > lo:
                                        assert (hi - 1) // bs - lo // bs + 1 <= pages, (bs, asked, tile, k)
