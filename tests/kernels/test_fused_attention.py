"""The fused launch (shared + own items in one persistent kernel) vs the two-kernel path and the reference.

Under the CPU interpreter programs run one after another, so the first program takes every ticket;
``own_programs`` and the grid still change which queue each program starts on, and the counters must
come back to zero after every launch (a recorded or captured launch replays with them).
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE, rel_err
from test_triton_backend import _batch

from prefixserve.attention.kernels import fused_attention, merge, paged_attention, shared_attention
from prefixserve.attention.kernels.triton_backend import TritonBackend, build_layout
from prefixserve.attention.reference import ReferenceBackend

CASES = [
    (16, 4, 64, [1, 1, 1, 1]),  # decode
    (16, 1, 64, [3, 7, 2, 5]),  # prefill chunks after shared context
    (32, 8, 128, [1, 4, 1, 2]),  # mixed
]


def _step(q, k, v, meta):
    """The triton backend's plan and layout for this batch (what a forward would launch)."""
    TritonBackend(fused=True).prepare(meta)
    step = meta.plan
    lay = build_layout(meta, step, q.shape[1], k.shape[2], q.shape[2], q.device, q.dtype)
    lay.counters = torch.zeros(fused_attention.COUNTERS, dtype=torch.int32, device=q.device)
    return step, lay


def _fused_parts(q, k, v, meta, step, lay, own_programs=None):
    lay.o_part.fill_(float("nan"))
    lay.lse_part.fill_(float("nan"))
    plan = step.shared
    launch = fused_attention.launch_fused(
        q, k, v, plan.seg_blocks, plan.seg_block_start, plan.seg_rows, lay.work,
        plan.own_block_tables, plan.own_seq_lens, meta.query_start_loc, 0.1,
        step.max_query_len, lay.own_splits, lay.own_split_size, lay.o_part, lay.lse_part, lay.counters,
        own_programs=own_programs, shared_row_tokens=lay.shared_row_tokens, own_tokens=lay.own_tokens,
    )  # fmt: skip
    assert launch is not None
    assert lay.counters.tolist() == [0, 0, 0], "the last program resets the ticket counters"
    return lay.o_part.clone(), lay.lse_part.clone()


def _split_parts(q, k, v, meta, step, lay):
    lay.o_part.fill_(float("nan"))
    lay.lse_part.fill_(float("nan"))
    plan, ns, tokens = step.shared, lay.work.num_slots, q.shape[0]
    shared_attention.launch_shared(
        q, k, v, plan.seg_blocks, plan.seg_block_start, plan.seg_rows, lay.work, 0.1, lay.o_part, lay.lse_part
    )
    paged_attention.launch_paged(
        q, k, v, plan.own_block_tables, plan.own_seq_lens, meta.query_start_loc, 0.1, step.max_query_len,
        lay.own_splits, lay.own_split_size, lay.o_part[ns:], lay.lse_part[ns:],
        tokens * lay.o_part.stride(0), tokens * lay.lse_part.stride(0),
    )  # fmt: skip
    return lay.o_part.clone(), lay.lse_part.clone()


@pytest.mark.parametrize(("block_size", "group", "dim", "query_lens"), CASES)
def test_fused_partials_equal_two_kernel_partials(block_size, group, dim, query_lens) -> None:
    q, k, v, meta = _batch(block_size, group, dim, query_lens, seed=3)
    step, lay = _step(q, k, v, meta)
    o_split, lse_split = _split_parts(q, k, v, meta, step, lay)
    for own_programs in (None, 0, 10_000):  # rule; every program shared-first; every one own-first
        o, lse = _fused_parts(q, k, v, meta, step, lay, own_programs)
        assert torch.isfinite(o).all(), "every slot is written"
        torch.testing.assert_close(o, o_split, rtol=0, atol=0)
        torch.testing.assert_close(lse, lse_split, rtol=0, atol=0)


@pytest.mark.parametrize(("block_size", "group", "dim", "query_lens"), CASES)
def test_fused_backend_matches_reference_and_two_kernel_path(block_size, group, dim, query_lens) -> None:
    q, k, v, meta = _batch(block_size, group, dim, query_lens, seed=4)
    ref = ReferenceBackend().forward(q, k, v, meta, 0.1)
    outs = []
    for fused in (True, False):
        be = TritonBackend(fused=fused)
        be.own_pack = 1  # the fused launch runs one sequence per own program: the same sums, bit for bit
        be.prepare(meta)
        first = be.forward(q, k, v, meta, 0.1)  # records the launches
        again = be.forward(q, k, v, meta, 0.1)  # replays them (a later layer)
        assert rel_err(first, ref) < 1e-5 and rel_err(again, ref) < 1e-5
        outs.append(again)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_fused_merge_of_partials_matches_reference() -> None:
    """Merging the fused partials with the layout's CSR gives the reference output (all rows covered)."""
    q, k, v, meta = _batch(16, 4, 64, [1, 2, 1, 3], seed=5)
    step, lay = _step(q, k, v, meta)
    o, lse = _fused_parts(q, k, v, meta, step, lay)
    out, _ = merge.merge_partials(o, lse, q.shape[0], row_ptr=lay.row_ptr, part_idx=lay.part_idx)
    assert rel_err(out, ReferenceBackend().forward(q, k, v, meta, 0.1)) < 1e-5


def test_own_share_rule() -> None:
    assert fused_attention.own_share(1e12, 0.0, 132) == 0  # nothing own: every program shared-first
    small = fused_attention.own_share(275e9, 0.54e9, 132)  # B=1024, P=16K, S=128
    large = fused_attention.own_share(275e9, 2.15e9, 132)  # S=512
    assert 1 <= small < large < 132
    assert fused_attention.own_share(1.0, 1e12, 132) == 131  # keep one shared-first program


def test_counters_are_checked() -> None:
    q, k, v, meta = _batch(16, 4, 64, [1, 1, 1, 1])
    step, lay = _step(q, k, v, meta)
    lay.counters = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="counters"):
        _fused_parts(q, k, v, meta, step, lay)
