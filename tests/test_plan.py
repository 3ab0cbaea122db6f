"""make_plan on hand-built sharing structures, and against a slow loop-by-loop planner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning.plan import SharedPlan, make_plan

BS = 4


def plan_of(tables: list[list[int]], seq_lens: list[int], query_lens: list[int] | None = None) -> SharedPlan:
    query_lens = query_lens or [1] * len(tables)
    return make_plan(build_metadata(BS, query_lens, seq_lens, tables, "cpu"))


def segments(plan: SharedPlan) -> dict[tuple[int, ...], list[int]]:
    """{segment blocks: holders} (segment order is an implementation detail)."""
    blocks = plan.seg_blocks.tolist()
    starts = plan.seg_block_start.tolist()
    return {
        tuple(blocks[starts[g] : starts[g + 1]]): plan.seg_holders_host[g] for g in range(plan.num_segments)
    }


def own_tables(plan: SharedPlan) -> list[list[int]]:
    rows = plan.own_block_tables.tolist()
    return [row[: -(-n // BS)] for row, n in zip(rows, plan.own_seq_lens_host, strict=True)]


def full(n_blocks: int, tail: int = 1) -> int:
    """seq_len of a table of n_blocks whose last block holds `tail` tokens."""
    return (n_blocks - 1) * BS + tail


def test_global_prefix() -> None:
    tables = [[0, 1, 2, 10, 11], [0, 1, 2, 20], [0, 1, 2, 30, 31, 32]]
    plan = plan_of(tables, [full(5, 2), full(4, 3), full(6, 2)], [1, 1, 3])
    assert segments(plan) == {(0, 1, 2): [0, 1, 2]}
    assert own_tables(plan) == [[10, 11], [20], [30, 31, 32]]
    assert plan.own_seq_lens_host == [6, 3, 10]
    assert plan.seg_rows.tolist() == [0, 1, 2, 3, 4]  # seq 2's three query rows are 2, 3, 4
    assert plan.seg_num_tokens.tolist() == [12]
    assert plan.kv_tokens_read == 12 + 6 + 3 + 10


def test_two_level_tree() -> None:
    # few-shot prefix [0, 1] for all; problem A [2, 3] sampled twice, problem B [4] sampled twice
    tables = [[0, 1, 2, 3, 10], [0, 1, 2, 3, 11], [0, 1, 4, 12], [0, 1, 4, 13]]
    plan = plan_of(tables, [full(5), full(5), full(4), full(4)])
    assert segments(plan) == {(0, 1): [0, 1, 2, 3], (2, 3): [0, 1], (4,): [2, 3]}
    assert own_tables(plan) == [[10], [11], [12], [13]]


def test_three_level_tree() -> None:
    tables = [
        [0, 1, 2, 5, 20],
        [0, 1, 2, 5, 21],
        [0, 1, 2, 6, 7, 22],
        [0, 1, 2, 6, 7, 23],
        [0, 3, 4, 8, 24],
        [0, 3, 4, 8, 25],
    ]
    plan = plan_of(tables, [full(len(t)) for t in tables])
    assert segments(plan) == {
        (0,): [0, 1, 2, 3, 4, 5],
        (1, 2): [0, 1, 2, 3],
        (3, 4, 8): [4, 5],
        (5,): [0, 1],
        (6, 7): [2, 3],
    }
    assert plan.kv_tokens_read == 4 * (1 + 2 + 3 + 1 + 2) + 6


def test_independent_groups() -> None:
    tables = [[0, 1, 10], [0, 1, 11], [2, 3, 12], [2, 3, 13], [4, 5, 14]]
    plan = plan_of(tables, [full(3)] * 5)
    assert segments(plan) == {(0, 1): [0, 1], (2, 3): [2, 3]}
    assert own_tables(plan)[4] == [4, 5, 14]
    assert plan.own_seq_lens_host == [1, 1, 1, 1, 9]


def test_non_prefix_module() -> None:
    # the module [0, 1] sits at different table indices; own blocks before it stay own, in order
    tables = [[5, 0, 1, 10], [0, 1, 6, 11], [7, 8, 0, 1, 12]]
    plan = plan_of(tables, [full(4), full(4), full(5)])
    assert segments(plan) == {(0, 1): [0, 1, 2]}
    assert own_tables(plan) == [[5, 10], [6, 11], [7, 8, 12]]


def test_runs_split_where_adjacency_or_holders_differ() -> None:
    # 0,1 adjacent everywhere; 2 is shared but not adjacent to 1 in seq 1; 3 has a different holder set
    tables = [[0, 1, 2, 3, 10], [0, 1, 9, 2, 3, 11], [0, 1, 12]]
    plan = plan_of(tables, [full(5), full(6), full(3)])
    assert segments(plan) == {(0, 1): [0, 1, 2], (2, 3): [0, 1]}
    # reversed order in one table: same holders, but no common successor -> two segments
    plan = plan_of([[0, 1, 10], [1, 0, 11]], [full(3), full(3)])
    assert segments(plan) == {(0,): [0, 1], (1,): [0, 1]}


def test_partial_last_block_not_shared() -> None:
    # block 2 is the last (partial) block of both tables: it holds their query tokens
    plan = plan_of([[0, 1, 2], [0, 1, 2]], [full(3, 2), full(3, 3)])
    assert segments(plan) == {(0, 1): [0, 1]}
    assert own_tables(plan) == [[2], [2]]


def test_prefill_chunk_starting_inside_a_block() -> None:
    # seq 1's chunk starts at token BS + 1, inside block 1: block 1 is not wholly before its queries
    tables = [[0, 1, 2, 10], [0, 1, 2, 11]]
    seq_len = full(4)
    plan = plan_of(tables, [seq_len, seq_len], [1, seq_len - (BS + 1)])
    assert segments(plan) == {(0,): [0, 1]}
    assert own_tables(plan) == [[1, 2, 10], [1, 2, 11]]
    assert plan.seg_rows.tolist() == list(range(1 + seq_len - (BS + 1)))
    # a chunk starting exactly at block 2's first token: blocks 0 and 1 lie wholly before it
    plan = plan_of(tables, [seq_len, seq_len], [1, seq_len - 2 * BS])
    assert segments(plan) == {(0, 1): [0, 1]}


def test_single_sequence_and_no_sharing() -> None:
    plan = plan_of([[3, 4, 5]], [full(3)])
    assert plan.num_segments == 0
    assert own_tables(plan) == [[3, 4, 5]]
    assert plan.kv_tokens_read == full(3)
    plan = plan_of([[0, 1, 2], [3, 4]], [full(3), full(2)])
    assert plan.num_segments == 0
    assert own_tables(plan) == [[0, 1, 2], [3, 4]]
    assert plan.seg_block_start.tolist() == [0] and plan.seg_row_start.tolist() == [0]


def test_duplicate_block_in_one_table_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        plan_of([[0, 0, 5], [1, 6]], [full(3), full(2)])


# ---------------------------------------------------------------- property test against a slow planner


def slow_plan(bs: int, query_lens, seq_lens, tables):
    """The definitions of plan.py, one entry at a time."""
    cand = [t[: (s - q) // bs] for t, s, q in zip(tables, seq_lens, query_lens, strict=True)]
    holders: dict[int, list[int]] = {}
    for s, blocks in enumerate(cand):
        for b in blocks:
            holders.setdefault(b, []).append(s)
    shared = {b for b, h in holders.items() if len(h) >= 2}

    def runs_on(b1: int, b2: int) -> bool:
        if holders[b1] != holders[b2]:
            return False
        return all(cand[s].index(b2) == cand[s].index(b1) + 1 for s in holders[b1])

    segs: dict[tuple[int, ...], list[int]] = {}
    for blocks in cand:
        i = 0
        while i < len(blocks):
            if blocks[i] not in shared:
                i += 1
                continue
            j = i + 1
            while j < len(blocks) and blocks[j] in shared and runs_on(blocks[j - 1], blocks[j]):
                j += 1
            segs[tuple(blocks[i:j])] = holders[blocks[i]]
            i = j
    own = [
        [b for i, b in enumerate(t) if not (i < len(c) and b in shared)]
        for t, c in zip(tables, cand, strict=True)
    ]
    own_lens = [s - bs * (len(t) - len(o)) for s, t, o in zip(seq_lens, tables, own, strict=True)]
    return segs, own, own_lens


@st.composite
def sharing_batches(draw):
    """Trees, groups and modules (shared runs at any index) of fresh block ids, plus own blocks."""
    num_chunks = draw(st.integers(1, 5))
    next_id = 0
    chunks = []
    for _ in range(num_chunks):
        n = draw(st.integers(1, 3))
        chunks.append(list(range(next_id, next_id + n)))
        next_id += n
    num_seqs = draw(st.integers(1, 7))
    tables, seq_lens, query_lens = [], [], []
    for _ in range(num_seqs):
        picked = draw(st.lists(st.integers(0, num_chunks - 1), max_size=4, unique=True))
        table = [b for c in picked for b in chunks[c]]
        n_own = draw(st.integers(0 if table else 1, 2))
        table += list(range(next_id, next_id + n_own))
        next_id += n_own
        seq_len = (len(table) - 1) * BS + draw(st.integers(1, BS))
        tables.append(table)
        seq_lens.append(seq_len)
        query_lens.append(draw(st.one_of(st.just(1), st.integers(1, seq_len))))
    return tables, seq_lens, query_lens


@settings(max_examples=200, deadline=None)
@given(sharing_batches())
def test_matches_slow_planner(batch) -> None:
    tables, seq_lens, query_lens = batch
    plan = plan_of(tables, seq_lens, query_lens)
    segs, own, own_lens = slow_plan(BS, query_lens, seq_lens, tables)
    assert segments(plan) == segs
    assert own_tables(plan) == own
    assert plan.own_seq_lens_host == own_lens
    assert plan.kv_tokens_read == sum(len(s) * BS for s in segs) + sum(own_lens)
    # rows: every row of every holder, holder-major
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    rows = plan.seg_rows.tolist()
    row_start = plan.seg_row_start.tolist()
    for g, hs in enumerate(plan.seg_holders_host):
        expect = [r for s in hs for r in range(starts[s], starts[s + 1])]
        assert rows[row_start[g] : row_start[g + 1]] == expect
        assert plan.segment_rows_host(g) == len(expect)


def test_gpu_rule_wants_tall_segments_and_enough_saved_reads() -> None:
    from prefixserve.attention.auto import gpu_cascade_pays_off
    from prefixserve.attention.metadata import build_metadata
    from prefixserve.attention.planning.plan import make_plan

    def plan_for(holders: int, prefix_blocks: int, bs: int = 16):
        tables = [[*range(prefix_blocks), 10_000 + i] for i in range(holders)]
        seq_lens = [prefix_blocks * bs + 5] * holders
        meta = build_metadata(bs, [1] * holders, seq_lens, tables, "cpu")
        return make_plan(meta), meta.logical_kv_tokens()

    wide, logical = plan_for(256, 256)  # 256 holders x 4 heads = 1,024 stacked rows, 4K shared tokens
    assert gpu_cascade_pays_off(wide, logical, kv_bytes_per_token=4096)
    narrow, logical = plan_for(64, 1024)  # only 256 stacked rows: host-bound launches lose there
    assert not gpu_cascade_pays_off(narrow, logical, kv_bytes_per_token=4096)
    short, logical = plan_for(256, 2)  # too little KV saved to pay for the extra launches
    assert not gpu_cascade_pays_off(short, logical, kv_bytes_per_token=4096)


# ---------------------------------------------------------------- a prefill's own context as a segment


def test_context_segment_takes_a_prefill_own_context_blocks() -> None:
    """The prefill's whole blocks before its first query token that no other sequence holds become a
    segment held by it alone; the prefix two sequences hold stays theirs, and the block holding the
    first query token stays in the own part (causal there)."""
    from prefixserve.attention.planning.context_segments import ContextRule, with_context_segments

    tables = [[0, 1, 2, 3, 4, 5], [0, 1, 9]]
    seq_lens, query_lens = [full(6, 3), full(3)], [5, 1]  # row 0's queries start in block 4
    meta = build_metadata(BS, query_lens, seq_lens, tables, "cpu")
    base = make_plan(meta)
    assert segments(base) == {(0, 1): [0, 1]}
    plan = with_context_segments(base, meta, ContextRule(2, 2 * BS, min_work=0, min_run=BS))
    assert segments(plan) == {(0, 1): [0, 1], (2, 3): [0]}
    assert plan.context_segments == 1
    assert own_tables(plan) == [[4, 5], [9]]
    assert plan.own_seq_lens_host == [seq_lens[0] - 4 * BS, seq_lens[1] - 2 * BS]
    assert plan.kv_tokens_read == base.kv_tokens_read
    rows = plan.seg_rows.tolist()[plan.seg_row_start_host[1] : plan.seg_row_start_host[2]]
    assert rows == [0, 1, 2, 3, 4] and plan.seg_num_tokens_host[1] == 2 * BS
    # too few rows, or too short a context: the plan as it was
    assert with_context_segments(base, meta, ContextRule(6, BS, min_work=0, min_run=BS)) is base
    assert with_context_segments(base, meta, ContextRule(1, 3 * BS, min_work=0, min_run=BS)) is base
    assert with_context_segments(base, meta, ContextRule(1, BS, min_work=5 * 2 * BS + 1, min_run=BS)) is base


def test_context_segments_one_per_run_of_consecutive_blocks() -> None:
    """A context lying in two runs of the cache is two segments (each read by TMA); a run shorter
    than ``min_run`` keeps the whole context on the paged kernel."""
    from prefixserve.attention.planning.context_segments import ContextRule, with_context_segments

    tables = [[7, 8, 2, 3, 4, 20]]
    meta = build_metadata(BS, [3], [full(6, 3)], tables, "cpu")
    base = make_plan(meta)
    plan = with_context_segments(base, meta, ContextRule(1, BS, min_work=0, min_run=2 * BS))
    assert segments(plan) == {(7, 8): [0], (2, 3, 4): [0]}
    assert plan.seg_row_start_host == [0, 3, 6] and plan.context_segments == 2
    assert own_tables(plan) == [[20]]
    assert with_context_segments(base, meta, ContextRule(1, BS, min_work=0, min_run=3 * BS)) is base


@settings(max_examples=200, deadline=None)
@given(sharing_batches(), st.integers(1, 4), st.integers(1, 3))
def test_context_segments_keep_every_key_once(batch, min_rows: int, min_blocks: int) -> None:
    """Every sequence still attends each of its keys exactly once (segments it holds + own part); a
    new segment is one qualifying sequence's own whole context, its rows that sequence's rows."""
    from collections import Counter

    from prefixserve.attention.planning.context_segments import ContextRule, with_context_segments

    tables, seq_lens, query_lens = batch
    meta = build_metadata(BS, query_lens, seq_lens, tables, "cpu")
    base = make_plan(meta)
    plan = with_context_segments(base, meta, ContextRule(min_rows, min_blocks * BS, min_work=0, min_run=BS))
    segs = plan.seg_blocks.tolist()
    starts = plan.seg_block_start_host
    own = own_tables(plan)
    for s, table in enumerate(tables):
        mine = [g for g, hs in enumerate(plan.seg_holders_host) if s in hs]
        held = [b for g in mine for b in segs[starts[g] : starts[g + 1]]]
        assert Counter(held + own[s]) == Counter(table)
        tail = -(-seq_lens[s] // BS) - (seq_lens[s] - query_lens[s]) // BS
        assert own[s][len(own[s]) - tail :] == table[len(table) - tail :]  # the query blocks stay own, last
    assert plan.kv_tokens_read == base.kv_tokens_read
    new = range(base.num_segments, plan.num_segments)
    assert plan.context_segments == len(new)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    for g in new:
        (s,) = plan.seg_holders_host[g]
        assert query_lens[s] >= min_rows
        blocks = segs[starts[g] : starts[g + 1]]
        assert blocks == list(range(blocks[0], blocks[0] + len(blocks)))  # one run of the cache
        rows = plan.seg_rows.tolist()[plan.seg_row_start_host[g] : plan.seg_row_start_host[g + 1]]
        assert rows == list(range(qsl[s], qsl[s + 1]))
    for s in {plan.seg_holders_host[g][0] for g in new}:  # a sequence's runs: its whole context
        context = sum(plan.seg_num_tokens_host[g] for g in new if plan.seg_holders_host[g] == [s])
        assert context >= min_blocks * BS
