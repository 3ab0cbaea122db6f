"""The CPU decode fast paths are exact: folded segments, in-place reads of consecutive blocks, the
aligned merge of a segment every row holds, and linear layers through oneDNN's packed weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from prefixserve.attention.auto import AutoBackend, CascadeCost, small_segments
from prefixserve.attention.cascade import _all_rows_in_order, _block_run, attend_blocks, cascade_attention
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning.plan import fold_segments, make_plan
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.model import cpu_linear
from tests.test_cascade import batches, make_inputs, rel_err, run_backend

SETTINGS = settings(max_examples=60, deadline=None)


def _table_blocks(meta, s: int) -> list[int]:
    return list(meta.block_tables_host[s])


@SETTINGS
@given(
    batches(),
    st.sampled_from([1, 3, 4]),
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(0, 2**31 - 1),
    st.data(),
)
def test_folded_segments_match_reference(batch, group, dtype, seed, data) -> None:
    """Any subset of whole-block segments moved into their holders' own parts: same attention."""
    q, k_cache, v_cache, meta = make_inputs(batch, 2, group, 64, seed)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    scale = 0.125
    ref = run_backend(ReferenceBackend(), q, k_cache, v_cache, meta, scale)
    plan = make_plan(meta)
    g = plan.num_segments
    fold = np.array(data.draw(st.lists(st.booleans(), min_size=g, max_size=g)), dtype=bool)
    folded = fold_segments(plan, fold, meta.block_size)
    assert folded.num_segments == plan.num_segments - int(fold.sum())
    # every sequence still reads each of its KV blocks exactly once: in a kept segment or its own part
    bs = meta.block_size
    for s in range(meta.num_seqs):
        own = folded.own_block_tables[s, : -(-folded.own_seq_lens_host[s] // bs)].tolist()
        starts = folded.seg_block_start_host
        kept = [
            b
            for g in range(folded.num_segments)
            if s in folded.seg_holders_host[g]
            for b in folded.seg_blocks[starts[g] : starts[g + 1]].tolist()
        ]
        assert sorted(own + kept) == sorted(_table_blocks(meta, s))
    assert folded.kv_tokens_read == sum(folded.seg_num_tokens_host) + sum(folded.own_seq_lens_host)
    assert folded.kv_tokens_read >= plan.kv_tokens_read
    out = cascade_attention(q, k_cache, v_cache, meta, folded, scale)
    assert out.dtype == dtype and rel_err(out, ref) < 1e-5
    # folding nothing returns the plan itself; folding everything leaves no segment
    assert fold_segments(plan, np.zeros(plan.num_segments, dtype=bool), meta.block_size) is plan
    every = fold_segments(plan, np.ones(plan.num_segments, dtype=bool), meta.block_size)
    assert every.num_segments == 0
    assert rel_err(cascade_attention(q, k_cache, v_cache, meta, every, scale), ref) < 1e-5


def test_small_segments_rule() -> None:
    """A one-block segment of a few holders is folded; a long prefix many sequences hold is kept."""
    bs = 4
    tables = [[0, 1, 2, 3, 4, 5, 6, 7, 20 + 2 * s, 40 + s] for s in range(8)]
    tables[1][8] = tables[0][8]  # sequences 0 and 1 also share their ninth block
    meta = build_metadata(bs, [1] * 8, [9 * bs + 1] * 8, tables, "cpu")
    plan = make_plan(meta)
    assert plan.num_segments == 2
    small = small_segments(plan, bs, CascadeCost(min_segment_saving=16))
    lengths = np.diff(plan.seg_block_start_host)
    assert small.tolist() == (lengths == 1).tolist()  # (2 - 1) * 4 rows < 16 <= 7 * 32 rows
    assert not small_segments(plan, bs, CascadeCost(min_segment_saving=0)).any()
    assert small_segments(plan, bs, CascadeCost(min_segment_saving=10**9)).all()
    backend = AutoBackend()
    backend.cost = CascadeCost(min_segment_saving=16)
    q, k_cache, v_cache, meta = make_inputs((bs, tables, [9 * bs + 1] * 8, [1] * 8), 2, 4, 64, 5)
    out = run_backend(backend, q, k_cache, v_cache, meta, 0.125)
    assert meta.stats["cascade"] == 1.0 and meta.stats["shared_segments"] == 1.0
    assert rel_err(out, run_backend(ReferenceBackend(), q, k_cache, v_cache, meta, 0.125)) < 1e-5


def test_block_run_and_row_order_checks() -> None:
    t = torch.tensor
    assert _block_run(t([[5, 6, 7, 8]])) == 5
    assert _block_run(t([[9]])) == 9
    assert _block_run(t([[5, 7, 6, 8]])) is None  # ends agree, order does not
    assert _block_run(t([[5, 6, 8]])) is None
    assert _block_run(t([[0, 1], [2, 3]])) is None  # several rows always gather
    assert _all_rows_in_order(t([0, 1, 2, 3]), 4)
    assert not _all_rows_in_order(t([1, 0, 2, 3]), 4)
    assert not _all_rows_in_order(t([0, 1, 2]), 4)
    assert _all_rows_in_order(t([0]), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nblk", [1, 3, 40])
def test_consecutive_blocks_read_in_place_equal_gathered(dtype, nblk) -> None:
    """A table of consecutive blocks is read as a view of the cache; the result equals the gathered
    copy of the same KV placed elsewhere (non-consecutive ids)."""
    gen = torch.Generator().manual_seed(nblk)
    bs, kvh, d = 4, 2, 32
    cache_k = torch.randn(2 * nblk + 4, bs, kvh, d, generator=gen, dtype=dtype)
    cache_v = torch.randn(2 * nblk + 4, bs, kvh, d, generator=gen, dtype=dtype)
    run = torch.arange(2, 2 + nblk)[None]  # consecutive
    scattered = torch.arange(nblk + 4, 2 * nblk + 4).flip(0)[None]  # the same KV, reversed ids
    cache_k[scattered[0]] = cache_k[run[0]]
    cache_v[scattered[0]] = cache_v[run[0]]
    if nblk > 1:
        assert _block_run(scattered) is None
    q = torch.randn(1, kvh, 7, d, generator=gen, dtype=dtype)
    visible = torch.rand(1, 1, 7, nblk * bs, generator=gen) < 0.7
    for mask in (None, visible):
        o1, lse1 = attend_blocks(q, cache_k, cache_v, run, 0.2, visible=mask)
        o2, lse2 = attend_blocks(q, cache_k, cache_v, scattered, 0.2, visible=mask)
        assert rel_err(o1, o2) < 1e-5
        assert torch.equal(torch.isfinite(lse1), torch.isfinite(lse2))
        assert rel_err(lse1[torch.isfinite(lse1)], lse2[torch.isfinite(lse2)]) < 1e-5


def test_aligned_merge_of_a_global_prefix_equals_reference() -> None:
    """Decode over a prefix every sequence holds, in consecutive blocks: the view read and the aligned
    merge path, against the reference (fp32 and fp64)."""
    bs, n = 4, 6
    tables = [[0, 1, 2, 3, 4, 5, 50 + s] for s in range(n)]
    for dtype in (torch.float32, torch.float64):
        q, k_cache, v_cache, meta = make_inputs((bs, tables, [6 * bs + 3] * n, [1] * n), 2, 4, 64, 9)
        q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
        plan = make_plan(meta)
        assert plan.num_segments == 1 and _block_run(plan.seg_blocks[None].long()) == 0
        out = cascade_attention(q, k_cache, v_cache, meta, plan, 0.125)
        assert rel_err(out, run_backend(ReferenceBackend(), q, k_cache, v_cache, meta, 0.125)) < 1e-5


# ---------------------------------------------------------------- oneDNN linear layers

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="torch without oneDNN linear ops")


class _Lin(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(self, x)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias) -> None:
    torch.manual_seed(0)
    layer = _Lin(96, 200, bias=bias).to(dtype).requires_grad_(False)
    assert cpu_linear.can_pack(torch.float32)  # fp32 packs wherever oneDNN's linear ops exist
    if not cpu_linear.can_pack(dtype):  # bf16 on a CPU without AVX-512: not packed, F.linear
        assert cpu_linear.pack_linear_weights(layer) == 0
        assert "_packed_weight" not in layer.__dict__
    else:
        assert cpu_linear.pack_linear_weights(layer) == 1
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (0, 1, 5, 32, 300):
        x = torch.randn(rows, 96).to(dtype)
        with torch.inference_mode():
            got = layer(x)
        ref = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
        assert got.dtype == dtype and got.shape == (rows, 200)
        if rows:
            assert rel_err(got, ref) < tol


@needs_onednn
def test_packed_weight_is_dropped_when_the_weight_changes() -> None:
    """In-place updates, a new weight tensor, and dropping the packs all fall back to the new weight."""
    torch.manual_seed(1)
    layer = _Lin(64, 48, bias=True).requires_grad_(False)
    cpu_linear.pack_linear_weights(layer)
    x = torch.randn(8, 64)

    def check() -> None:
        with torch.inference_mode():
            assert rel_err(layer(x), F.linear(x.double(), layer.weight.double(), layer.bias.double())) < 1e-5

    check()
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version moves
    check()
    layer.weight = nn.Parameter(torch.randn(48, 64), requires_grad=False)  # another tensor
    check()
    cpu_linear.pack_linear_weights(layer)  # packed again from the new one
    assert layer.__dict__["_packed_weight"].matches(layer.weight)
    check()
    assert cpu_linear.pack_linear_weights(layer, enabled=False) == 0
    assert "_packed_weight" not in layer.__dict__
    check()


@needs_onednn
def test_packed_linear_keeps_autograd_on_the_plain_path() -> None:
    layer = _Lin(16, 8)
    cpu_linear.pack_linear_weights(layer)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()  # grad mode: F.linear, differentiable
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("causal_bytes", [0, 64 << 20])  # 0: every chunk takes the masked path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op_groups", [True, False], ids=["op-groups-heads", "kv-expanded"])
def test_prefill_chunks_causal_own_part_equal_reference(causal_bytes, dtype, op_groups, monkeypatch) -> None:
    """Prefill chunks whose own part is just the chunk (a fresh prompt after cached blocks), longer
    than the chunk (a later chunk), in consecutive and scattered blocks, beside decode rows; the
    flash op grouping the query heads itself, and K and V expanded to them as where it cannot."""
    import prefixserve.attention.cascade as cascade

    if op_groups and not cascade._flash_takes_gqa():
        pytest.skip("this torch's CPU flash op does not group query heads")
    monkeypatch.setattr(cascade, "_CAUSAL_BYTES", causal_bytes)
    monkeypatch.setattr(cascade, "_flash_takes_gqa", lambda: op_groups)
    bs = 4
    tables = [
        [0, 1, 2, 3, 4, 5, 6],  # shared 0-2, then consecutive own blocks, chunk = own part
        [0, 1, 2, 20, 11, 30, 9],  # scattered own blocks, chunk shorter than the own part
        [0, 1, 2, 40],  # a decode row
        [50, 51],  # no sharing, a first chunk inside a block
    ]
    seq_lens = [7 * bs, 6 * bs + 3, 3 * bs + 2, bs + 3]
    query_lens = [4 * bs, 5, 1, bs + 3]
    for group in (1, 3):
        q, k_cache, v_cache, meta = make_inputs((bs, tables, seq_lens, query_lens), 2, group, 32, group)
        q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
        ref = run_backend(ReferenceBackend(), q, k_cache, v_cache, meta, 0.3)
        for plan in (make_plan(meta), fold_segments(make_plan(meta), np.array([True]), bs)):
            out = cascade_attention(q, k_cache, v_cache, meta, plan, 0.3)
            assert out.dtype == dtype and rel_err(out, ref) < 1e-5


def test_keep_freed_memory_is_applied_once() -> None:
    import sys

    from prefixserve.worker import cpu_malloc

    first = cpu_malloc.keep_freed_memory()
    assert cpu_malloc.keep_freed_memory() is first
    if sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver()):
        assert first
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # allocations still work either way
