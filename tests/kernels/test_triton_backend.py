"""TritonBackend / TritonPagedBackend vs ReferenceBackend on batches with and without shared segments."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import DEVICE, paged_cache, rel_err

from prefixserve.attention.backend import make_backend
from prefixserve.attention.kernels import merge, paged_attention, shared_attention
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.reference import ReferenceBackend, attention_with_lse
from prefixserve.attention.triton_backend import TritonBackend, TritonPagedBackend

KV_HEADS = 2


def _batch(block_size: int, group: int, dim: int, query_lens: list[int], seed: int = 0):
    """Four sequences: a 3-block prefix shared by three, a module block shared mid-table, a loner."""
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    k, v, _ = paged_cache([40 * bs], bs, KV_HEADS, dim, torch.float32, gen)
    prefix, module = [4, 9, 2], [30]
    tables = [
        [*prefix, 11, *module, 12],  # prefix + own + module + own
        [*prefix, 13, *module, 14, 15],
        [*prefix[:2], 16],  # holds only the first two prefix blocks
        [20, 21],  # shares nothing
    ]
    own_tail = [bs - 3, bs, 5, bs + 7]
    seq_lens = [(len(t) - 1) * bs + tail for t, tail in zip(tables, own_tail, strict=True)]
    seq_lens[3] = bs + 7
    meta = build_metadata(bs, query_lens, seq_lens, tables, DEVICE)
    q = torch.randn(sum(query_lens), KV_HEADS * group, dim, generator=gen).to(DEVICE)
    return q, k, v, meta


@pytest.mark.parametrize(
    ("block_size", "group", "dim", "query_lens"),
    [
        (16, 4, 64, [1, 1, 1, 1]),  # decode
        (16, 1, 64, [3, 7, 2, 5]),  # prefill chunks after shared context
        (32, 8, 128, [1, 4, 1, 2]),  # mixed
    ],
)
def test_backends_match_reference(block_size: int, group: int, dim: int, query_lens: list[int]) -> None:
    q, k, v, meta = _batch(block_size, group, dim, query_lens)
    ref = ReferenceBackend().forward(q, k, v, meta, 0.1)
    for cls in (TritonBackend, TritonPagedBackend):
        be = cls()
        be.prepare(meta)
        out = be.forward(q, k, v, meta, 0.1)
        assert out.dtype == q.dtype and rel_err(out, ref) < 1e-5, cls.name
    TritonBackend().prepare(meta)
    assert meta.stats["kv_tokens_read"] < meta.stats["kv_tokens_logical"]
    assert meta.stats["shared_segments"] >= 2  # the prefix and the mid-table module


def test_reused_layout_buffers_are_fully_rewritten() -> None:
    """Poison the step's partial buffers between layers: the next forward must overwrite every slot."""
    q, k, v, meta = _batch(16, 4, 64, [1, 2, 1, 1], seed=1)
    be = TritonBackend()
    be.prepare(meta)
    first = be.forward(q, k, v, meta, 0.1)
    for lay in meta.plan.layouts.values():
        lay.o_part.fill_(math.nan)
        lay.lse_part.fill_(math.nan)
    second = be.forward(q, k, v, meta, 0.1)
    torch.testing.assert_close(first, second)


def test_no_sharing_runs_plain_paged_path() -> None:
    gen = torch.Generator().manual_seed(2)
    k, v, tables = paged_cache([20, 45], 16, KV_HEADS, 64, torch.float32, gen)
    meta = build_metadata(16, [1, 3], [20, 45], tables, DEVICE)
    q = torch.randn(4, KV_HEADS * 4, 64, generator=gen).to(DEVICE)
    be = TritonBackend()
    be.prepare(meta)
    assert meta.plan.shared is None
    ref = ReferenceBackend().forward(q, k, v, meta, 0.1)
    assert rel_err(be.forward(q, k, v, meta, 0.1), ref) < 1e-5


def test_registered_by_name() -> None:
    assert isinstance(make_backend("triton"), TritonBackend)
    assert isinstance(make_backend("triton_paged"), TritonPagedBackend)


def test_segment_plus_empty_own_part_merges_to_segment_only() -> None:
    """Own part with no KV (lse = -inf) merged with a segment: the row equals the segment's attention."""
    gen = torch.Generator().manual_seed(3)
    bs, group, dim = 16, 4, 64
    k, v, tables = paged_cache([32, 32], bs, KV_HEADS, dim, torch.float32, gen)
    blocks = tables[0]
    q = torch.randn(2, KV_HEADS * group, dim, generator=gen).to(DEVICE)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    seg = (
        torch.tensor(blocks, **i32),
        torch.tensor([0, 2], **i32),
        torch.tensor([32], **i32),
        torch.tensor([0, 1], **i32),
        torch.tensor([0, 2], **i32),
    )
    seg_o, seg_lse = shared_attention.shared_segment_attention(q, k, v, *seg, 0.1)
    own_o, own_lse = paged_attention.paged_attention(
        q,
        k,
        v,
        torch.zeros(2, 1, **i32),
        torch.tensor([0, 0], **i32),
        torch.tensor([0, 1, 2], **i32),
        0.1,
        1,
    )
    o_parts = torch.cat([seg_o, own_o.float()])
    lse_parts = torch.cat([seg_lse, own_lse])
    out, _ = merge.merge_partials(o_parts, lse_parts, 2, num_parts=2)
    kk = k[torch.tensor(blocks)].flatten(0, 1).cpu()
    vv = v[torch.tensor(blocks)].flatten(0, 1).cpu()
    ref, _ = attention_with_lse(q.cpu(), kk, vv, 0.1)
    assert rel_err(out.cpu(), ref) < 1e-5


def test_own_pack_rule_needs_an_own_heavy_step_and_enough_programs() -> None:
    """Own programs pack 4 decode sequences (G=4) only when the own KV outweighs the shared FLOPs and
    the packed grid still gives every SM two programs (the CPU interpreter counts 4 SMs)."""
    from types import SimpleNamespace

    from prefixserve.attention.planning.step_plan import own_pack_rule

    def plan(batch: int, prefix: int, suffix: int) -> SimpleNamespace:
        starts = {"seg_row_start_host": [0, batch], "seg_block_start_host": [0, prefix // 16]}
        return SimpleNamespace(**starts, own_seq_lens_host=[suffix] * batch)

    cpu = torch.device("cpu")
    shape = (32, 8, 128, 2)
    assert own_pack_rule(plan(256, 1024, 512), 256, shape, 16, cpu) == 4
    assert own_pack_rule(plan(256, 16384, 128), 256, shape, 16, cpu) == 1  # shared-heavy
    assert own_pack_rule(plan(8, 1024, 512), 8, (4, 1, 128, 2), 16, cpu) == 1  # 2 programs for 4 SMs
    assert own_pack_rule(plan(256, 1024, 512), 256, (32, 2, 128, 2), 16, cpu) == 1  # G=16: no packing


@pytest.mark.parametrize(("block_size", "group", "query_lens"), [(16, 4, [1, 1, 1]), (16, 1, [5, 1, 9])])
def test_module_holes_match_reference(block_size: int, group: int, query_lens: list[int]) -> None:
    """Prompt Cache module blocks: a partly filled last block's empty rows (NaN here) are never read;
    modules held by one sequence or several, in any order, ahead of each sequence's own blocks."""
    import numpy as np

    gen = torch.Generator().manual_seed(3)
    bs, dim = block_size, 64
    k, v, _ = paged_cache([40 * bs], bs, KV_HEADS, dim, torch.float32, gen)
    rows = np.zeros(k.shape[0] + 1, dtype=np.int32)
    mod_a, mod_b, mod_c = [4, 5, 6], [9], [12, 13]
    rows[mod_a], rows[mod_a[-1]] = bs, 5
    rows[mod_b] = 11
    rows[mod_c], rows[mod_c[-1]] = bs, bs
    for b in (mod_a[-1], mod_b[-1]):  # the holes
        k[b, rows[b] :] = float("nan")
        v[b, rows[b] :] = float("nan")
    tables = [[*mod_a, *mod_b, 20, 21], [*mod_b, *mod_a, 22], [*mod_c, *mod_a, 23, 24]]
    seq_lens = [(len(t) - 1) * bs + 7 for t in tables]
    meta = build_metadata(bs, query_lens, seq_lens, tables, DEVICE, rows)
    q = torch.randn(sum(query_lens), KV_HEADS * group, dim, generator=gen).to(DEVICE)
    ref = ReferenceBackend().forward(q, k, v, meta, 0.1)
    assert torch.isfinite(ref).all()
    for be in (TritonBackend(), make_backend("auto")):
        meta.plan = None
        be.prepare(meta)
        out = be.forward(q, k, v, meta, 0.1)
        assert rel_err(out, ref) < 1e-5, be.name


@pytest.mark.parametrize(("group", "query_lens"), [(4, [5, 1, 9, 2]), (1, [3, 7, 2, 5])])
def test_context_segments_match_reference(group: int, query_lens: list[int]) -> None:
    """Prefills' own cached context as one-holder segments (``context_segments.py``), beside a prefix
    three sequences share: the same attention as the reference, the plan's new segments counted."""
    from prefixserve.attention.planning.context_segments import ContextRule

    q, k, v, meta = _batch(16, group, 64, query_lens, seed=4)
    ref = ReferenceBackend().forward(q, k, v, meta, 0.1)
    be = TritonBackend()
    be.context_rule = ContextRule(2, 16, min_work=0, min_run=16)
    be.prepare(meta)
    assert meta.stats["context_segments"] >= 1
    assert rel_err(be.forward(q, k, v, meta, 0.1), ref) < 1e-5
    be.context_rule = None  # off: the plan of the shared prefix alone
    meta.plan = None
    be.prepare(meta)
    assert meta.stats["context_segments"] == 0
