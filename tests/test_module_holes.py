"""Prompt Cache module blocks with holes: the plan attends them as segments that end where the rows do.

A module's last block may be partly filled; its empty rows are holes in every table holding it. Here
the hole slots hold NaN, so a backend that reads one shows it. Every backend must equal an fp64
oracle that attends only the rows that exist.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.attention.auto import AutoBackend
from prefixserve.attention.cascade import CascadeBackend
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning.plan import make_plan
from prefixserve.attention.reference import ReferenceBackend, attention_with_lse


@st.composite
def module_batches(draw):
    """(block_size, tables, seq_lens, query_lens, module_rows): modules lead each table in any order."""
    bs = draw(st.sampled_from([2, 4]))
    ids = iter(range(1, 10_000))
    modules = []
    rows: dict[int, int] = {}
    for _ in range(3):
        blocks = [next(ids) for _ in range(draw(st.integers(1, 3)))]
        for b in blocks:
            rows[b] = bs
        rows[blocks[-1]] = draw(st.integers(1, bs))  # the last block may be partly filled
        modules.append(blocks)
    tables, seq_lens, query_lens = [], [], []
    for _ in range(draw(st.integers(1, 5))):
        picked = draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
        lead = [b for m in picked for b in modules[m]]
        own = [next(ids) for _ in range(draw(st.integers(1, 2)))]
        tables.append(lead + own)
        seq_len = (len(tables[-1]) - 1) * bs + draw(st.integers(1, bs))
        own_tokens = seq_len - len(lead) * bs
        seq_lens.append(seq_len)
        query_lens.append(draw(st.integers(1, own_tokens)))
    module_rows = np.zeros(10_000, dtype=np.int32)
    for b, r in rows.items():
        module_rows[b] = r
    return bs, tables, seq_lens, query_lens, module_rows


def make_inputs(batch, kv_heads: int, group: int, dim: int, seed: int, device: str = "cpu"):
    """Random q and cache; holes and every slot no sequence may read are NaN."""
    bs, tables, seq_lens, query_lens, module_rows = batch
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(b for t in tables for b in t) + 2
    k = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    readable = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for table, seq_len in zip(tables, seq_lens, strict=True):
        for idx in range(seq_len):
            block = table[idx // bs]
            if module_rows[block] == 0 or idx % bs < module_rows[block]:
                readable[block * bs + idx % bs] = True
    k.view(-1, kv_heads, dim)[~readable] = float("nan")
    v.view(-1, kv_heads, dim)[~readable] = float("nan")
    q = torch.randn(sum(query_lens), kv_heads * group, dim, generator=gen)
    meta = build_metadata(bs, query_lens, seq_lens, tables, device, module_rows[: num_blocks + 1].copy())
    return q.to(device), k.to(device), v.to(device), meta


def oracle(q, k, v, batch, scale: float) -> torch.Tensor:
    """fp64, per sequence, over the rows that exist (holes dropped), causal over the new tokens."""
    bs, tables, seq_lens, query_lens, module_rows = batch
    out, start = [], 0
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        idx = [
            i
            for i in range(seq_len)
            if module_rows[table[i // bs]] == 0 or i % bs < module_rows[table[i // bs]]
        ]
        slots = torch.tensor([table[i // bs] * bs + i % bs for i in idx])
        ks = k.reshape(-1, *k.shape[2:])[slots].double()
        vs = v.reshape(-1, *v.shape[2:])[slots].double()
        limit = torch.tensor([len(idx) - q_len + j + 1 for j in range(q_len)])
        o, _ = attention_with_lse(q[start : start + q_len].double(), ks, vs, scale, limit, torch.float64)
        out.append(o)
        start += q_len
    return torch.cat(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@settings(max_examples=60, deadline=None)
@given(module_batches(), st.sampled_from([1, 3]), st.integers(0, 2**31 - 1))
def test_backends_skip_holes(batch, group, seed) -> None:
    q, k, v, meta = make_inputs(batch, 2, group, 32, seed)
    scale = 1 / math.sqrt(32)
    want = oracle(q, k.cpu(), v.cpu(), batch, scale)
    for backend in (ReferenceBackend(), CascadeBackend(), AutoBackend()):
        meta.plan = None
        backend.prepare(meta)
        got = backend.forward(q, k, v, meta, scale)
        assert torch.isfinite(got).all(), backend.name
        assert rel_err(got, want) < 1e-5, backend.name


@settings(max_examples=60, deadline=None)
@given(module_batches())
def test_plan_keeps_partial_module_blocks_in_segments(batch) -> None:
    bs, tables, seq_lens, query_lens, module_rows = batch
    meta = build_metadata(bs, query_lens, seq_lens, tables, "cpu", module_rows)
    plan = make_plan(meta)
    seg_blocks = plan.seg_blocks.tolist()
    starts = plan.seg_block_start_host
    for g in range(plan.num_segments):
        blocks = seg_blocks[starts[g] : starts[g + 1]]
        # a partly filled block only ever ends a segment, and the segment's rows count its holes out
        assert all(module_rows[b] in (0, bs) for b in blocks[:-1])
        want = sum(int(module_rows[b]) or bs for b in blocks)
        assert plan.seg_num_tokens_host[g] == want == int(plan.seg_num_tokens[g])
    module_blocks = {b for t in tables for b in t if module_rows[b]}
    partial = {b for b in module_blocks if module_rows[b] < bs}
    assert partial <= set(seg_blocks)  # holes: never in an own part
    own = plan.own_block_tables.tolist()
    owned: set[int] = set()
    for s, n in enumerate(plan.own_seq_lens_host):
        owned |= set(own[s][: -(-n // bs)])
    assert not partial & owned
    # a whole module block is own KV only where one sequence of the batch holds it
    holders = collections.Counter(b for t in tables for b in set(t))
    assert all(holders[b] == 1 for b in module_blocks & owned)
    assert module_blocks <= set(seg_blocks) | owned
    assert plan.has_holes == any(0 < module_rows[b] < bs for b in module_blocks)


def test_plain_paged_backend_refuses_module_blocks() -> None:
    pytest.importorskip("triton")
    from prefixserve.attention.triton_backend import TritonPagedBackend

    rows = np.zeros(8, dtype=np.int32)
    rows[1] = 3
    meta = build_metadata(4, [2], [6], [[1, 2]], "cpu", rows)
    with pytest.raises(ValueError, match="module blocks"):
        TritonPagedBackend().prepare(meta)
