"""The planner's host fast paths are exact: make_plan against its previous (dense) implementation.

``dense_make_plan`` is ``make_plan`` as it was before it worked on head entries only (a verbatim copy,
kept here as the reference): every field of the plan must come out identical, bit for bit, on
hand-made and random batches (global prefixes, trees, interleaved groups, modules at other indices,
prefill chunks, deduplicated generated blocks, wide zero padding), and on tables given as arrays.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import prefixserve.attention.planning.plan as plan_mod
from prefixserve.attention.metadata import AttentionMetadata, TableRows, build_metadata
from prefixserve.attention.planning.plan import SharedPlan, make_plan, unshared_plan

TENSORS = SharedPlan.TENSOR_FIELDS


def dense_make_plan(meta: AttentionMetadata) -> SharedPlan:
    """make_plan as it was before the head-entry rewrite (dense passes over the whole table)."""
    device = meta.block_tables.device
    bs = meta.block_size
    num_seqs = meta.num_seqs
    seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)  # [S]
    query_lens = np.asarray(meta.query_lens_host, dtype=np.int64)  # [S]
    n_blocks = -(-seq_lens // bs)  # [S] table length
    n_cand = (seq_lens - query_lens) // bs  # [S] full blocks wholly before the first query token
    tables = plan_mod.host_tables(meta)  # [S, W] int32, zero-padded
    width = tables.shape[1]
    if num_seqs < 2 or int(n_cand.max(initial=0)) == 0:
        return plan_mod._no_sharing(meta, seq_lens, n_blocks, tables)

    # blk: candidate block ids, every other entry the sentinel `nb`. The last column is never a
    # candidate (it holds a query token or padding), so every candidate has a successor entry.
    nb = int(tables.max()) + 1
    blk = tables.astype(np.intp)  # [S, W]
    blk.ravel()[_dense_ranges(np.arange(num_seqs) * width + n_cand, width - n_cand)] = nb
    holders = np.bincount(blk.ravel(), minlength=nb + 1)  # [nb+1] candidate entries per block
    holders[nb] = 0
    is_shared = holders >= 2  # [nb+1]
    if not is_shared.any():
        return plan_mod._no_sharing(meta, seq_lens, n_blocks, tables)

    # (entry, successor) pairs that differ from the pair one row above: together they hold every
    # distinct pair of the batch, usually a small fraction of the table
    novel = np.empty((num_seqs, width), dtype=bool)  # [S, W]
    novel[0] = True
    np.not_equal(blk[1:], blk[:-1], out=novel[1:])
    novel[:, :-1] |= novel[:, 1:]  # now: the pair starting at this entry is new
    novel[:, -1] = False  # the last column starts no pair
    pair_s, pair_i = np.divmod(np.flatnonzero(novel), width)  # row-major
    cur = blk[pair_s, pair_i]
    succ = blk[pair_s, pair_i + 1]

    # join[b]: b runs on into its successor (the same successor in every holder, as many holders)
    sh = is_shared[cur]
    rep_next = np.full(nb + 1, nb, dtype=np.intp)  # [nb+1]
    rep_next[cur[sh]] = succ[sh]  # one holder's successor (any one will do)
    join = is_shared & (rep_next != nb) & (holders[rep_next] == holders)
    join[cur[sh & (rep_next[cur] != succ)]] = False
    # a shared block starts a segment iff it has no predecessor or its predecessor does not run on
    is_start = np.zeros(nb + 1, dtype=bool)
    is_start[blk[:, 0]] = True
    is_start[succ[~join[cur]]] = True
    is_start &= is_shared

    # segment lengths: pointer jumping along the join chains of the shared blocks
    shared_ids = np.flatnonzero(is_shared)  # [K]
    local = np.zeros(nb + 1, dtype=np.intp)
    local[shared_ids] = np.arange(len(shared_ids))
    chain_next = np.where(join[shared_ids], local[rep_next[shared_ids]], np.arange(len(shared_ids)))
    run = join[shared_ids].astype(np.int64)  # [K] links to the end of the chain
    while True:
        jumped = chain_next[chain_next]
        if np.array_equal(jumped, chain_next):
            break
        run += run[chain_next]
        chain_next = jumped

    # one start entry per (segment, holder); a segment is named by its first block
    start_s, start_i = np.divmod(np.flatnonzero(is_start.take(blk)), width)  # row-major: batch order
    start_blk = blk[start_s, start_i]
    order = np.argsort(start_blk, kind="stable")
    sorted_blk = start_blk[order]
    first = np.flatnonzero(np.r_[True, sorted_blk[1:] != sorted_blk[:-1]])  # [G]
    holder_start = np.r_[first, len(order)]  # [G+1]
    holder_seqs = start_s[order]  # [sum of holders]
    dup = np.flatnonzero(holder_seqs[1:] == holder_seqs[:-1]) + 1
    if np.isin(dup, first, invert=True).any():
        raise ValueError("a block appears twice in one sequence's block table")
    rep = order[first]  # a representative start entry per segment
    seg_len = run[local[sorted_blk[first]]] + 1  # [G] blocks
    seg_block_start = np.r_[0, np.cumsum(seg_len)]  # [G+1]
    seg_blocks = blk[np.repeat(start_s[rep], seg_len), _dense_ranges(start_i[rep], seg_len)]

    # query rows of each segment: every row of every holder, holder-major
    qsl = np.r_[0, np.cumsum(query_lens)]  # [S+1]
    row_counts = query_lens[holder_seqs]  # [sum of holders]
    seg_rows = _dense_ranges(qsl[holder_seqs], row_counts)
    seg_row_start = np.r_[0, np.cumsum(np.add.reduceat(row_counts, first))]  # [G+1]

    # own parts: unshared candidates (each differs from the entry above, so it is in the pair list)
    # followed by each table's non-candidate tail, order kept
    lone = (cur != nb) & ~is_shared[cur]
    own_s = np.r_[pair_s[lone], np.repeat(np.arange(num_seqs), n_blocks - n_cand)]
    own_i = np.r_[pair_i[lone], _dense_ranges(n_cand, n_blocks - n_cand)]
    by_row = np.lexsort((own_i, own_s))
    own_s, own_i = own_s[by_row], own_i[by_row]
    own_n = np.bincount(own_s, minlength=num_seqs)  # [S] own blocks
    own_tables = np.zeros((num_seqs, max(int(own_n.max()), 1)), dtype=np.int64)
    own_tables[own_s, np.arange(len(own_s)) - np.repeat(np.r_[0, np.cumsum(own_n)[:-1]], own_n)] = tables[
        own_s, own_i
    ]
    own_seq_lens = seq_lens - (n_blocks - own_n) * bs  # [S]

    kv_read = int(seg_len.sum()) * bs + int(own_seq_lens.sum())
    return plan_mod.SharedPlan(
        seg_blocks=plan_mod._to_i32(seg_blocks, device),
        seg_block_start=plan_mod._to_i32(seg_block_start, device),
        seg_num_tokens=plan_mod._to_i32(seg_len * bs, device),
        seg_rows=plan_mod._to_i32(seg_rows, device),
        seg_row_start=plan_mod._to_i32(seg_row_start, device),
        own_block_tables=plan_mod._to_i32(own_tables, device),
        own_seq_lens=plan_mod._to_i32(own_seq_lens, device),
        seg_holders_host=[h.tolist() for h in np.split(holder_seqs, holder_start[1:-1])],
        own_seq_lens_host=own_seq_lens.tolist(),
        kv_tokens_read=kv_read,
        seg_block_start_host=seg_block_start.tolist(),
        seg_row_start_host=seg_row_start.tolist(),
    )


def _dense_ranges(begin: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(begin[i], begin[i] + count[i])`` for all i without a Python loop."""
    total = int(count.sum())
    offsets = np.r_[0, np.cumsum(count)[:-1]]
    return np.repeat(begin - offsets, count) + np.arange(total)


# ---------------------------------------------------------------------------------------------- checks


def assert_same_plan(meta: AttentionMetadata) -> SharedPlan | None:
    """make_plan(meta) equals dense_make_plan(meta) in every field (or both refuse alike)."""
    try:
        want = dense_make_plan(meta)
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc)):
            make_plan(meta)
        return None
    got = make_plan(meta)
    for name in TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert got.seg_holders_host == want.seg_holders_host
    assert got.own_seq_lens_host == want.own_seq_lens_host
    assert got.kv_tokens_read == want.kv_tokens_read
    assert got.seg_block_start_host == want.seg_block_start_host
    assert got.seg_row_start_host == want.seg_row_start_host
    return got


def metas(bs: int, query_lens: list[int], seq_lens: list[int], tables: list[list[int]], pad: int = 0):
    """The batch's metadata from lists, and from an array (with ``pad`` extra zero columns)."""
    from_lists = build_metadata(bs, query_lens, seq_lens, tables, "cpu")
    width = max(max((len(t) for t in tables), default=1), 1) + pad
    arr = np.zeros((len(tables), width), dtype=np.int64)
    for i, (t, s) in enumerate(zip(tables, seq_lens, strict=True)):
        n = -(-s // bs)
        arr[i, :n] = t[:n]
    return from_lists, build_metadata(bs, query_lens, seq_lens, arr, "cpu")


@st.composite
def batches(draw):
    """Shared chunks placed anywhere (trees, groups, modules), own blocks, decode rows and chunks."""
    bs = draw(st.sampled_from([1, 2, 4]))
    num_chunks = draw(st.integers(1, 5))
    next_id = draw(st.integers(0, 3))
    chunks = []
    for _ in range(num_chunks):
        n = draw(st.integers(1, 4))
        chunks.append(list(range(next_id, next_id + n)))
        next_id += n
    num_seqs = draw(st.integers(1, 9))
    tables, seq_lens, query_lens = [], [], []
    for _ in range(num_seqs):
        picked = draw(st.lists(st.integers(0, num_chunks - 1), max_size=4, unique=True))
        table = [b for c in picked for b in chunks[c]]
        n_own = draw(st.integers(0 if table else 1, 3))
        table += list(range(next_id, next_id + n_own))
        next_id += n_own
        seq_len = (len(table) - 1) * bs + draw(st.integers(1, bs))
        extra = draw(st.integers(0, 2))  # a list may be longer than its sequence needs
        tables.append(table + list(range(next_id, next_id + extra)))
        next_id += extra
        seq_lens.append(seq_len)
        query_lens.append(draw(st.one_of(st.just(1), st.integers(1, seq_len))))
    return bs, tables, seq_lens, query_lens, draw(st.integers(0, 3))


@contextlib.contextmanager
def segment_lengths_by(way: str):
    """Measure segments by scanning holder rows, or by pointer jumping along the join chains."""
    saved = plan_mod.SCAN_SLACK
    plan_mod.SCAN_SLACK = saved if way == "scan" else -(10**9)
    try:
        yield
    finally:
        plan_mod.SCAN_SLACK = saved


@settings(max_examples=300, deadline=None)
@given(batch=batches(), way=st.sampled_from(["scan", "pointer_jumping"]))
def test_matches_dense_planner(batch, way: str) -> None:
    bs, tables, seq_lens, query_lens, pad = batch
    from_lists, from_array = metas(bs, query_lens, seq_lens, tables, pad)
    with segment_lengths_by(way):
        assert_same_plan(from_lists)
        assert_same_plan(from_array)
    for name in TENSORS:  # the array form plans exactly like the list form
        assert torch.equal(getattr(make_plan(from_lists), name), getattr(make_plan(from_array), name))


def test_duplicate_block_refused_like_before() -> None:
    from_lists, _ = metas(4, [1, 1], [9, 5], [[0, 0, 5], [1, 6]])
    assert assert_same_plan(from_lists) is None


def _decode_batch(rng: np.random.Generator, groups: int, per_group: int, prefix: int, interleave: bool):
    """Decode rows: ``groups`` prompts of ``prefix`` blocks (a common first block), samples of each
    sharing some generated blocks (deduplicated greedy samples), staggered lengths."""
    bs = 16
    next_id = 1
    common = [0]
    prompts = []
    for _ in range(groups):
        prompts.append(common + list(range(next_id, next_id + prefix)))
        next_id += prefix
    rows = []
    for g in range(groups):
        same_gen = list(range(next_id, next_id + int(rng.integers(0, 3))))
        next_id += len(same_gen)
        for _ in range(per_group):
            own = int(rng.integers(1, 8))
            rows.append((g, prompts[g] + same_gen + list(range(next_id, next_id + own))))
            next_id += own
    if interleave:  # round robin over the groups, as admissions of several prompts would be
        rows = [rows[g * per_group + k] for k in range(per_group) for g in range(groups)]
    tables = [t for _, t in rows]
    seq_lens = [(len(t) - 1) * bs + int(rng.integers(1, bs + 1)) for t in tables]
    return bs, tables, seq_lens, [1] * len(tables)


@pytest.mark.parametrize("groups,per_group,prefix", [(1, 256, 64), (8, 32, 16), (64, 4, 8), (3, 50, 40)])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("way", ["scan", "pointer_jumping"])
def test_large_decode_batches_match(
    groups: int, per_group: int, prefix: int, interleave: bool, way: str
) -> None:
    rng = np.random.default_rng(groups * 1000 + per_group)
    bs, tables, seq_lens, query_lens = _decode_batch(rng, groups, per_group, prefix, interleave)
    from_lists, from_array = metas(bs, query_lens, seq_lens, tables, pad=3)
    with segment_lengths_by(way):
        plan = assert_same_plan(from_lists)
        assert plan is not None and plan.num_segments >= 1
        assert_same_plan(from_array)


def test_mixed_prefill_and_decode_match() -> None:
    rng = np.random.default_rng(7)
    bs, tables, seq_lens, query_lens = _decode_batch(rng, 4, 16, 12, interleave=True)
    query_lens = [int(rng.integers(1, s + 1)) if i % 5 == 0 else 1 for i, s in enumerate(seq_lens)]
    from_lists, _ = metas(bs, query_lens, seq_lens, tables)
    assert_same_plan(from_lists)


def test_unshared_plan_and_no_sharing_match() -> None:
    tables = [[1, 2, 3], [4, 5], [6]]
    from_lists, from_array = metas(4, [1, 2, 1], [9, 6, 3], tables, pad=2)
    for meta in (from_lists, from_array):
        assert assert_same_plan(meta).num_segments == 0
        a, b = (
            unshared_plan(meta),
            plan_mod._no_sharing(
                meta,
                np.asarray(meta.seq_lens_host),
                -(-np.asarray(meta.seq_lens_host) // 4),
                meta.block_tables_np,
            ),
        )
        for name in TENSORS:
            assert torch.equal(getattr(a, name), getattr(b, name))


# ------------------------------------------------------------------------------- metadata from arrays


def slow_slots(bs: int, query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> list[int]:
    out = []
    for q, s, t in zip(query_lens, seq_lens, tables, strict=True):
        for idx in range(s - q, s):
            out.append(t[idx // bs] * bs + idx % bs)
    return out


@settings(max_examples=200, deadline=None)
@given(batches())
def test_metadata_from_array_equals_from_lists(batch) -> None:
    bs, tables, seq_lens, query_lens, pad = batch
    from_lists, from_array = metas(bs, query_lens, seq_lens, tables, pad)
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        a, b = getattr(from_lists, name), getattr(from_array, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert from_lists.slot_mapping.tolist() == slow_slots(bs, query_lens, seq_lens, tables)
    # the array form keeps only each sequence's blocks; the lists may be longer
    cut = [t[: -(-s // bs)] for t, s in zip(tables, seq_lens, strict=True)]
    assert list(from_array.block_tables_host) == cut
    assert from_array.block_tables_np.dtype == np.int32
    n = from_array.block_tables_np.shape[1]
    assert n == max(-(-s // bs) for s in seq_lens)
    assert from_lists.block_tables_np[:, :n].tolist() == [
        row[:n] for row in from_lists.block_tables_np.tolist()
    ]


def test_table_rows_behave_like_lists() -> None:
    tables = np.array([[3, 4, 0], [5, 6, 7]], dtype=np.int32)
    rows = TableRows(tables, np.array([2, 3]))
    assert len(rows) == 2 and rows[0] == [3, 4] and rows[-1] == [5, 6, 7]
    assert rows[:1] == [[3, 4]] and list(rows) == [[3, 4], [5, 6, 7]]
    assert rows == [[3, 4], [5, 6, 7]] and rows != [[3, 4]]


def test_array_tables_too_narrow_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata(4, [1], [9], np.zeros((1, 2), dtype=np.int32), "cpu")
    with pytest.raises(ValueError, match="one entry per sequence"):
        build_metadata(4, [1, 1], [9, 9], np.zeros((1, 3), dtype=np.int32), "cpu")
