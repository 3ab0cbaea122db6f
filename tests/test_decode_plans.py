"""A decode plan carried on from the step before equals the plan made from scratch, field by field.

Random decode runs (``_DecodeRun``): groups of sequences sharing prefixes of several lengths, every
sequence one token longer each step, a fresh block where one fills up, and now and then a change that
must end the carrying: copy-on-write of a query block, a candidate block moved, a sequence leaving or
joining, a joining
sequence whose query token recomputes the last token of a block others hold as a candidate (the next
step makes it shared), and two joiners sharing their query block. Each step's carried plan, and the
graphed step planned from it (key and every array), must equal what planning from scratch gives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.attention.auto import AutoBackend
from prefixserve.attention.graph import HeadShape
from prefixserve.attention.graph_attention import shared_graph_step
from prefixserve.attention.metadata import AttentionMetadata, build_metadata
from prefixserve.attention.planning.decode_plans import DecodePlans
from prefixserve.attention.planning.plan import SharedPlan, make_plan
from prefixserve.attention.planning.step_plan import host_plan

BS = 4
SHAPE = HeadShape(8, 2, 16, torch.float32, torch.device("cpu"))
HOST_FIELDS = (
    "seg_holders_host",
    "own_seq_lens_host",
    "kv_tokens_read",
    "seg_block_start_host",
    "seg_row_start_host",
    "seg_num_tokens_host",
    "has_holes",
)


class _DecodeRun:
    """Block tables of a decode batch that grows one token a sequence per step."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self._next_block = int(rng.integers(0, 50))
        self.tables: list[list[int]] = []
        self.lens: list[int] = []
        for _ in range(int(rng.integers(1, 4))):  # groups, each under one shared prefix
            prefix = self._fresh(int(rng.integers(0, 6)))
            for _ in range(int(rng.integers(1, 6))):
                self._join(prefix, len(prefix) * BS + int(rng.integers(1, 3 * BS)))

    def _fresh(self, n: int) -> list[int]:
        gap = int(self.rng.integers(1, 3))  # block ids with gaps, as a pool hands them out
        blocks = list(range(self._next_block, self._next_block + n * gap, gap))
        self._next_block += n * gap
        return blocks

    def _join(self, prefix: list[int], seq_len: int, at: int | None = None) -> None:
        table = prefix[: -(-seq_len // BS)]
        table = table + self._fresh(-(-seq_len // BS) - len(table))
        at = len(self.tables) if at is None else at
        self.tables.insert(at, table)
        self.lens.insert(at, seq_len)

    def step(self) -> None:
        """One decode step: every sequence one token on; sometimes a change that ends the carrying."""
        for s in range(len(self.lens)):
            self.lens[s] += 1
            if -(-self.lens[s] // BS) > len(self.tables[s]):
                self.tables[s].append(self._fresh(1)[0])
        event = self.rng.integers(0, 12)
        s = int(self.rng.integers(0, len(self.lens)))
        if event == 0:  # copy-on-write of the block holding the query token
            self.tables[s][-1] = self._fresh(1)[0]
        elif event == 1 and len(self.lens) > 1:  # a sequence leaves
            del self.tables[s], self.lens[s]
        elif event == 2:  # a sequence joins under another's prefix
            full = (self.lens[s] - 1) // BS
            self._join(
                self.tables[s][: int(self.rng.integers(0, full + 1))], int(self.rng.integers(1, 40)), s
            )
        elif event == 3 and (self.lens[s] - 1) // BS >= 1:
            # a prefix-cache hit recomputing the last token of a block s holds as a candidate: one step
            # on, that block is a candidate of both
            k = int(self.rng.integers(1, (self.lens[s] - 1) // BS + 1))
            self._join(self.tables[s][:k], k * BS, int(self.rng.integers(0, len(self.lens) + 1)))
        elif event == 4:  # two joiners whose query tokens end the same full block: both gain it next
            blocks = self._fresh(int(self.rng.integers(1, 4)))
            self._join(blocks, len(blocks) * BS)
            self._join(blocks, len(blocks) * BS)
        elif event == 5 and (self.lens[s] - 1) // BS >= 1:  # a candidate block moved elsewhere
            self.tables[s][int(self.rng.integers(0, (self.lens[s] - 1) // BS))] = self._fresh(1)[0]

    def meta(self) -> AttentionMetadata:
        width = max(len(t) for t in self.tables)
        tables = np.zeros((len(self.tables), width), dtype=np.int32)
        for s, t in enumerate(self.tables):
            tables[s, : len(t)] = t
        return build_metadata(BS, [1] * len(self.lens), list(self.lens), tables, "cpu")


def _assert_same_plan(got: SharedPlan, want: SharedPlan) -> None:
    for name in SharedPlan.TENSOR_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    for name in HOST_FIELDS:
        assert getattr(got, name) == getattr(want, name), name


def _assert_same_graph_step(meta: AttentionMetadata, got: SharedPlan, want: SharedPlan) -> None:
    bucket = 1 << (meta.num_seqs - 1).bit_length()
    a, b = shared_graph_step(meta, got, SHAPE, bucket), shared_graph_step(meta, want, SHAPE, bucket)
    assert a.key == b.key
    assert a.arrays.keys() == b.arrays.keys()
    for name, array in a.arrays.items():
        assert array.dtype == b.arrays[name].dtype and np.array_equal(array, b.arrays[name]), name


def _folded(meta: AttentionMetadata) -> SharedPlan:
    """AutoBackend's graphed plan, with a saving threshold that folds some segments of these runs."""
    return AutoBackend._folded(host_plan(meta), meta.block_size, 3 * BS)


@pytest.mark.parametrize("make", [host_plan, _folded], ids=["plain", "folded"])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_carried_plan_equals_a_fresh_one(make, seed: int) -> None:
    run, plans = _DecodeRun(np.random.default_rng(seed)), DecodePlans()
    for _ in range(40):
        meta = run.meta()
        got, want = plans.plan(meta, make), make(meta)
        _assert_same_plan(got, want)
        if want.num_segments:
            _assert_same_graph_step(meta, got, want)
        run.step()
    assert plans.carried + plans.made == 40


def test_steady_decode_carries_its_plan_and_a_change_stops_it() -> None:
    """Under one prefix, steady decode plans once; CoW, a leave and a prefill step each plan again."""
    run, plans = _DecodeRun(np.random.default_rng(0)), DecodePlans()
    prefix = run._fresh(4)
    run.tables, run.lens = [], []
    for own in range(1, 9):
        run._join(prefix, 4 * BS + own)
    for _ in range(20):  # rows fill blocks at different steps: carried all the same
        got = plans.plan(run.meta(), make_plan)
        assert got.num_segments == 1
        for s in range(len(run.lens)):
            run.lens[s] += 1
            if -(-run.lens[s] // BS) > len(run.tables[s]):
                run.tables[s].append(run._fresh(1)[0])
    assert (plans.made, plans.carried) == (1, 19)

    run.tables[3][-1] = run._fresh(1)[0]  # copy-on-write: the query block changes, the plan moves
    _assert_same_plan(plans.plan(run.meta(), make_plan), make_plan(run.meta()))
    assert plans.made == 1  # a query block is an own entry: carried, with the new block

    run.tables[3][0] = run._fresh(1)[0]  # a candidate changed: planned again
    run.lens = [n + 1 for n in run.lens]
    for t, n in zip(run.tables, run.lens, strict=True):
        if -(-n // BS) > len(t):
            t.append(run._fresh(1)[0])
    _assert_same_plan(plans.plan(run.meta(), make_plan), make_plan(run.meta()))
    assert plans.made == 2

    del run.tables[0], run.lens[0]  # a leave: planned again
    run.lens = [n + 1 for n in run.lens]
    for t, n in zip(run.tables, run.lens, strict=True):
        if -(-n // BS) > len(t):
            t.append(run._fresh(1)[0])
    plans.plan(run.meta(), make_plan)
    assert plans.made == 3

    prefill = build_metadata(BS, [2], [run.lens[0] + 2], run.meta().block_tables_np[:1], "cpu")
    plans.plan(prefill, make_plan)  # not a decode step: made, not kept
    assert plans.made == 3 and plans._last is None


def test_prompt_cache_modules_are_never_carried() -> None:
    run, plans = _DecodeRun(np.random.default_rng(1)), DecodePlans()
    meta = run.meta()
    meta.module_rows = np.zeros(1024, dtype=np.int64)
    plans.plan(meta, make_plan)
    run.step()
    meta = run.meta()
    meta.module_rows = np.zeros(1024, dtype=np.int64)
    plans.plan(meta, make_plan)
    assert plans.carried == 0
