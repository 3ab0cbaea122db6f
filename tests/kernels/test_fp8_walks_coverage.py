"""e4m3 walks cut into ``attend.E4M3_WALKS`` runs (``attend.attend_range_walks``) in shapes no other
CPU test reaches: GQA 8 and 16 (16-row tiles of 8 / 16 heads, ``pick_block_m``), 128-wide heads over
64-key tiles (256-wide ones keep one walk: ``attend.attend_range_fetched``), query tiles of several
rows (a verify / short prefill step), each also as one walk (the launcher's pick for short runs), and
runs of several tiles whose last tile is masked (the window kernel's walks: test_fp8_fetched_walks.py).
Against fp64 attention over the same codes: the products take fp16 operands (bf16 q widened exactly,
P rounded to fp16): 1e-3 relative for fp16 outputs; bf16 outputs add their own rounding (1.1-1.7e-3
alone, about twice that through the CPU interpreter's bf16 store), so 6e-3; the LSE (fp32) to 1e-3."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE, e4m3_cache, rel_err
from test_fp8_kv_kernels import reference

TOL = {torch.float16: 1e-3, torch.bfloat16: 6e-3}


@pytest.mark.parametrize(
    ("group", "dim", "query_lens", "dtype"),
    [
        (8, 128, [1, 1, 1, 1], torch.bfloat16),  # GQA 8 decode: a 16-row tile, 8 of them padding
        (8, 256, [1, 1, 1, 1], torch.bfloat16),  # 256-wide heads (Gemma's global layers): one walk
        (16, 64, [1, 1, 1, 1], torch.float16),  # GQA 16: 16 heads of one query
        (8, 64, [2, 1, 2, 1], torch.bfloat16),  # 2 queries x 8 heads a tile: causal limits per row
        (4, 128, [4, 3, 1, 2], torch.float16),  # 4 queries x 4 heads
    ],
)
@pytest.mark.parametrize("cut", [True, False], ids=["cut", "one-walk"])
def test_fp8_paged_walks_match_fp64(
    group: int,
    dim: int,
    query_lens: list[int],
    dtype: torch.dtype,
    cut: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefixserve.attention.kernels import attend
    from prefixserve.attention.kernels.paged_attention import paged_attention, pick_block_m
    from prefixserve.attention.planning import e4m3_walks

    # these runs are short: the launcher cuts a walk only past E4M3_WALK_MIN_RUN tokens
    monkeypatch.setattr(e4m3_walks, "E4M3_WALK_MIN_RUN", 0 if cut else 1 << 30)

    block_n = 64  # paged_attention's
    assert pick_block_m(max(query_lens) * group, group) == 16  # attend.fetches_ahead: <= 16 rows
    assert attend.E4M3_WALKS > 1 and block_n // attend.E4M3_WALKS >= 16  # cut into walks (dim <= 128)
    gen = torch.Generator().manual_seed(group * dim + sum(query_lens))
    bs, hkv = 16, 2
    # one key; under a tile; a tile and a walk and a bit; three tiles and a masked fourth
    lens = [max(n, m) for n, m in zip([1, 37, 64 + 16 + 5, 3 * 64 + 29], query_lens, strict=True)]
    k, v, tables, bt = e4m3_cache(lens, bs, hkv, dim, gen)
    q = torch.randn(sum(query_lens), hkv * group, dim, generator=gen).to(DEVICE, dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = dim**-0.5
    o, lse = paged_attention(q, k, v, bt, sl, qsl, scale, max(query_lens), num_splits=1, block_n=block_n)
    ref, parts = reference(q.cpu().float(), k.cpu().float(), v.cpu().float(), tables, lens, query_lens, scale)
    assert o.dtype == dtype and rel_err(o.cpu(), ref) < TOL[dtype]
    lse_ref = torch.cat([p[-1] for p in parts])
    assert (lse.cpu().double() - lse_ref).abs().max() < 1e-3


def test_fp32_queries_cut_into_walks_keep_exact_products() -> None:
    """fp32 q over an e4m3 cache (the 1e-5 path: ``tiles.dot_precision`` "ieee") cut into walks, compiled
    for sm_90: the walks' batched products must take DOT_PREC, not Triton's tf32 default, which the
    CPU interpreter never applies (its products are exact whatever the precision asked)."""
    from _kernel_helpers import compiled_for_hopper

    (record,) = compiled_for_hopper("_walks_compile.py")
    assert record["walks"] and record["tf32_mma"] == 0, record


def test_the_launcher_cuts_long_walks_of_one_split_or_one_wave() -> None:
    """``e4m3_walks``: a program walking at least ``E4M3_WALK_MIN_RUN`` tokens is cut into E4M3_WALKS
    walks where its grid is one split a sequence or one wave of cut walks (2 an SM); shorter runs and
    a grid of splits past one wave keep one walk (measured slower cut: docs/kernels.md §2.13). A decode
    step over an e4m3 cache gets that one wave where its splits stay long (``choose_split``)."""
    from prefixserve.attention.kernels import attend
    from prefixserve.attention.kernels.paged_attention import choose_split
    from prefixserve.attention.planning.e4m3_walks import E4M3_WALK_MIN_RUN as RUN
    from prefixserve.attention.planning.e4m3_walks import e4m3_walks

    cut, sms = attend.E4M3_WALKS.value, 132
    assert cut > 1
    assert e4m3_walks(1, RUN, 4096, sms) == cut  # B=512: one split a sequence, many waves
    assert e4m3_walks(1, RUN - 64, 4096, sms) == 1  # a short walk
    assert e4m3_walks(4, RUN, 512, sms) == 1  # B=16's 4 splits: two waves
    assert e4m3_walks(2, 2 * RUN, 256, sms) == cut  # 2 splits: one wave
    gpu = torch.device("meta")  # 4 SMs (``num_sms`` off a GPU): 8 cut walks a wave
    e4m3 = torch.float8_e4m3fn
    assert choose_split(4 * RUN, 2, gpu, 64, kv_dtype=e4m3) == (4, RUN)  # 2 sequences' KV heads
    assert choose_split(4 * RUN, 2, gpu, 64)[0] == 4  # the model dtype: ~2 waves of one-walk programs
    assert choose_split(4 * RUN, 3, gpu, 64, kv_dtype=e4m3) == (2, 2 * RUN)
    assert choose_split(RUN, 2, gpu, 64, kv_dtype=e4m3) == choose_split(RUN, 2, gpu, 64)  # too short
    assert choose_split(4 * RUN, 2, gpu, 64, prefill=True, kv_dtype=e4m3) == choose_split(
        4 * RUN, 2, gpu, 64, prefill=True
    )
