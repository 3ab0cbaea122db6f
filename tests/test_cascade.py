"""Cascade and auto backends equal the reference on random sharing structures; the LSE merge is exact."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.attention.auto import AutoBackend, CascadeCost, cascade_pays_off
from prefixserve.attention.backend import make_backend
from prefixserve.attention.cascade import CascadeBackend
from prefixserve.attention.merge import merge_attention_states, merge_many, scatter_merge_
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning.plan import make_plan
from prefixserve.attention.reference import ReferenceBackend, attention_with_lse

SETTINGS = settings(max_examples=40, deadline=None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@st.composite
def batches(draw):
    """(block_size, tables, seq_lens, query_lens) with a sharing structure of docs/architecture.md."""
    bs = draw(st.sampled_from([2, 4]))
    kind = draw(st.sampled_from(["global", "tree", "groups", "modules", "none"]))
    num_seqs = draw(st.integers(1, 6))
    ids = iter(range(10_000))

    def fresh(lo: int = 1, hi: int = 3) -> list[int]:
        return [next(ids) for _ in range(draw(st.integers(lo, hi)))]

    root, branches, modules = fresh(), [fresh() for _ in range(3)], [fresh() for _ in range(3)]
    leaves = [fresh() for _ in range(3)]
    tables = []
    for _ in range(num_seqs):
        if kind == "global":
            shared = root
        elif kind == "tree":  # few-shot root, then a problem prefix, sometimes a deeper node
            b = draw(st.integers(0, 2))
            shared = root + branches[b] + (leaves[b] if draw(st.booleans()) else [])
        elif kind == "groups":
            shared = branches[draw(st.integers(0, 2))]
        elif kind == "modules":  # shared runs at any index, own blocks between them
            picked = draw(st.lists(st.integers(0, 2), max_size=3, unique=True))
            shared = []
            for m in picked:
                shared += (fresh(0, 1) if draw(st.booleans()) else []) + modules[m]
        else:
            shared = []
        tables.append(shared + fresh(0 if shared else 1, 2))
    mode = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    seq_lens, query_lens = [], []
    for table in tables:
        seq_len = (len(table) - 1) * bs + draw(st.integers(1, bs))
        decode = mode == "decode" or (mode == "mixed" and draw(st.booleans()))
        seq_lens.append(seq_len)
        query_lens.append(1 if decode else draw(st.integers(1, min(seq_len, 3 * bs))))
    return bs, tables, seq_lens, query_lens


def make_inputs(batch, kv_heads: int, group: int, head_dim: int, seed: int):
    """Random q and a random cache; every slot no sequence may read is NaN, so a stray read shows."""
    bs, tables, seq_lens, query_lens = batch
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(b for t in tables for b in t) + 3
    shape = (num_blocks, bs, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen) + 0.1
    v_cache = torch.randn(shape, generator=gen) - 0.1
    readable = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for table, seq_len in zip(tables, seq_lens, strict=True):
        for idx in range(seq_len):
            readable[table[idx // bs] * bs + idx % bs] = True
    k_cache.view(-1, kv_heads, head_dim)[~readable] = float("nan")
    v_cache.view(-1, kv_heads, head_dim)[~readable] = float("nan")
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen)
    meta = build_metadata(bs, query_lens, seq_lens, tables, "cpu")
    return q, k_cache, v_cache, meta


def run_backend(backend, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    meta.plan = None
    meta.stats.clear()
    backend.prepare(meta)
    return backend.forward(q, k_cache, v_cache, meta, scale)


@SETTINGS
@given(
    batches(),
    st.sampled_from([1, 3, 4, 8]),
    st.sampled_from([64, 128]),
    st.integers(1, 2),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_cascade_and_auto_match_reference(batch, group, head_dim, kv_heads, seed, small_pieces) -> None:
    import prefixserve.attention.cascade as cascade

    q, k_cache, v_cache, meta = make_inputs(batch, kv_heads, group, head_dim, seed)
    scale = 1.0 / math.sqrt(head_dim)
    ref = run_backend(ReferenceBackend(), q, k_cache, v_cache, meta, scale)
    assert torch.isfinite(ref).all()
    saved = cascade._GATHER_BYTES
    if small_pieces:  # one block per gathered piece, one sequence per decode batch: many LSE merges
        cascade._GATHER_BYTES = 1
    try:
        out = run_backend(CascadeBackend(), q, k_cache, v_cache, meta, scale)
    finally:
        cascade._GATHER_BYTES = saved
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref) < 1e-5
    assert meta.stats["kv_tokens_read"] <= meta.stats["kv_tokens_logical"]
    assert meta.stats["shared_segments"] == meta.plan.num_segments
    out = run_backend(AutoBackend(), q, k_cache, v_cache, meta, scale)
    assert rel_err(out, ref) < 1e-5
    assert meta.stats["cascade"] in (0.0, 1.0)


@SETTINGS
@given(batches(), st.integers(0, 2**31 - 1))
def test_cascade_matmul_path_matches_reference(batch, seed) -> None:
    """The non-fused fallback (GPU without Triton, old torch) is exact too, with KV chunking."""
    import prefixserve.attention.cascade as cascade

    q, k_cache, v_cache, meta = make_inputs(batch, 2, 4, 64, seed)
    saved = cascade._CPU_FLASH, cascade._MAX_SCORES, cascade._GATHER_BYTES
    # tiny chunks and pieces: exercises the split-KV merges
    cascade._CPU_FLASH, cascade._MAX_SCORES, cascade._GATHER_BYTES = None, 64, 4096
    try:
        out = run_backend(CascadeBackend(), q, k_cache, v_cache, meta, 0.125)
    finally:
        cascade._CPU_FLASH, cascade._MAX_SCORES, cascade._GATHER_BYTES = saved
    ref = run_backend(ReferenceBackend(), q, k_cache, v_cache, meta, 0.125)
    assert rel_err(out, ref) < 1e-5


def test_global_prefix_decode_uses_cascade() -> None:
    bs, n = 4, 16
    tables = [[0, 1, 2, 3, 4, 5, 6, 7, 100 + s] for s in range(n)]
    batch = (bs, tables, [8 * bs + 1] * n, [1] * n)
    q, k_cache, v_cache, meta = make_inputs(batch, 2, 4, 64, 0)
    ref = run_backend(make_backend("reference"), q, k_cache, v_cache, meta, 0.125)
    out = run_backend(make_backend("auto"), q, k_cache, v_cache, meta, 0.125)
    assert meta.stats["cascade"] == 1.0
    assert meta.stats["kv_tokens_read"] == 8 * bs + n
    assert rel_err(out, ref) < 1e-5
    # no sharing: auto takes the per-sequence path and reports the full reads
    batch = (bs, [[s] for s in range(n)], [3] * n, [1] * n)
    q, k_cache, v_cache, meta = make_inputs(batch, 2, 4, 64, 0)
    run_backend(make_backend("auto"), q, k_cache, v_cache, meta, 0.125)
    assert meta.stats["cascade"] == 0.0
    assert meta.stats["kv_tokens_read"] == meta.stats["kv_tokens_logical"] == 3 * n


def test_cost_model_thresholds() -> None:
    bs = 4
    two = build_metadata(bs, [1, 1], [4 * bs + 1] * 2, [[0, 1, 2, 3, 10], [0, 1, 2, 3, 11]], "cpu")
    plan = make_plan(two)
    assert plan.num_segments == 1
    assert cascade_pays_off(plan, two.logical_kv_tokens(), group=4, cost=CascadeCost(segment_overhead_rows=0))
    assert not cascade_pays_off(plan, two.logical_kv_tokens(), group=1)  # 2 rows: too few to stack
    assert not cascade_pays_off(
        plan, two.logical_kv_tokens(), group=4, cost=CascadeCost(max_read_fraction=0.5)
    )


# ---------------------------------------------------------------- merge


def test_merge_equals_attention_over_the_union() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 8, 32, generator=gen)
    k = torch.randn(40, 2, 32, generator=gen)
    v = torch.randn(40, 2, 32, generator=gen)
    o_full, lse_full = attention_with_lse(q, k, v, 0.2)
    o_a, lse_a = attention_with_lse(q, k[:13], v[:13], 0.2)
    o_b, lse_b = attention_with_lse(q, k[13:], v[13:], 0.2)
    o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert rel_err(o, o_full) < 1e-6 and rel_err(lse, lse_full) < 1e-6
    o3, lse3 = merge_many([o_a[:, :, :], o_b], [lse_a, lse_b])
    assert rel_err(o3, o_full) < 1e-6 and rel_err(lse3, lse_full) < 1e-6


def test_merge_with_empty_parts() -> None:
    gen = torch.Generator().manual_seed(2)
    o_a = torch.randn(3, 2, 16, generator=gen)
    lse_a = torch.randn(3, 2, generator=gen)
    empty_o = torch.zeros(3, 2, 16)
    empty_lse = torch.full((3, 2), -math.inf)
    o, lse = merge_attention_states(o_a, lse_a, empty_o, empty_lse)  # an empty part changes nothing
    assert torch.equal(o, o_a) and torch.equal(lse, lse_a)
    o, lse = merge_attention_states(empty_o, empty_lse, o_a, lse_a)
    assert torch.equal(o, o_a) and torch.equal(lse, lse_a)
    o, lse = merge_attention_states(empty_o, empty_lse, empty_o, empty_lse)  # both empty: 0, -inf
    assert torch.equal(o, empty_o) and torch.isneginf(lse).all() and not torch.isnan(o).any()
    o, lse = merge_many([empty_o, empty_o], [empty_lse, empty_lse])
    assert torch.equal(o, empty_o) and torch.isneginf(lse).all()
    # mixed per row and head: only the finite side counts
    lse_b = lse_a.clone()
    lse_b[0, 1] = -math.inf
    o, lse = merge_attention_states(o_a, lse_a, o_a * 2, lse_b)
    assert torch.allclose(o[0, 1], o_a[0, 1]) and lse[0, 1] == lse_a[0, 1]
    assert torch.allclose(o[1], 1.5 * o_a[1]) and torch.allclose(lse[1], lse_a[1] + math.log(2))


def test_scatter_merge_folds_into_selected_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 16, generator=gen)
    k = torch.randn(20, 4, 16, generator=gen)
    v = torch.randn(20, 4, 16, generator=gen)
    o_acc, lse_acc = attention_with_lse(q, k[8:], v[8:], 0.25)  # every row's own part
    rows = torch.tensor([4, 1, 2])
    o_seg, lse_seg = attention_with_lse(q[rows], k[:8], v[:8], 0.25)  # a segment of three rows
    before_o, before_lse = o_acc.clone(), lse_acc.clone()
    scatter_merge_(o_acc, lse_acc, rows, o_seg, lse_seg)
    o_full, lse_full = attention_with_lse(q, k, v, 0.25)
    assert rel_err(o_acc[rows], o_full[rows]) < 1e-6 and rel_err(lse_acc[rows], lse_full[rows]) < 1e-6
    untouched = torch.tensor([0, 3, 5])
    assert torch.equal(o_acc[untouched], before_o[untouched])
    assert torch.equal(lse_acc[untouched], before_lse[untouched])


def test_same_length_segments_batched_equal_reference() -> None:
    """A shared prefix, then one-block segments held by pairs of sequences (one sequence in two of
    them): they are attended as one batch, and the output still equals the reference."""
    bs = 4
    tables = [
        [1, 2, 3, 10, 13, 30],
        [1, 2, 3, 10, 14, 31],
        [1, 2, 3, 11, 13, 32],
        [1, 2, 3, 11, 15, 33],
        [1, 2, 3, 12, 16, 34],
    ]
    seq_lens = [5 * bs + 2] * len(tables)
    batch = (bs, tables, seq_lens, [1] * len(tables))
    q, k_cache, v_cache, meta = make_inputs(batch, 2, 3, 64, seed=3)
    scale = 1.0 / 8.0
    ref = run_backend(ReferenceBackend(), q, k_cache, v_cache, meta, scale)
    out = run_backend(CascadeBackend(), q, k_cache, v_cache, meta, scale)
    lengths = sorted(
        int(meta.plan.seg_block_start_host[g + 1] - meta.plan.seg_block_start_host[g])
        for g in range(meta.plan.num_segments)
    )
    assert lengths.count(1) >= 3 and lengths[-1] == 3, lengths  # the batched path ran
    assert rel_err(out, ref) < 1e-5
