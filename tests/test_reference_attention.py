"""The reference backend (SDPA, per sequence) equals the einsum oracle on random paged batches."""

from __future__ import annotations

import pytest
import torch

from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.reference import ReferenceBackend, attention_with_lse, causal_limits, gather_kv


@pytest.mark.parametrize("group", [1, 3])
def test_reference_backend_matches_oracle(group: int) -> None:
    torch.manual_seed(group)
    kv_heads, dim, bs = 2, 16, 4
    k_cache = torch.randn(40, bs, kv_heads, dim, dtype=torch.float64)
    v_cache = torch.randn(40, bs, kv_heads, dim, dtype=torch.float64)
    query_lens, seq_lens = [1, 5, 9, 1], [7, 5, 13, 20]
    perm = torch.randperm(40).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(perm[used : used + n])
        used += n
    meta = build_metadata(bs, query_lens, seq_lens, tables, "cpu")
    q = torch.randn(sum(query_lens), kv_heads * group, dim, dtype=torch.float64)
    out = ReferenceBackend().forward(q, k_cache, v_cache, meta, 0.3)
    start = 0
    for q_len, s_len, table in zip(query_lens, seq_lens, tables, strict=True):
        o, lse = attention_with_lse(
            q[start : start + q_len],
            gather_kv(k_cache, table, s_len),
            gather_kv(v_cache, table, s_len),
            0.3,
            causal_limits(s_len, q_len, q.device),
            torch.float64,
        )
        assert torch.isfinite(lse).all()
        torch.testing.assert_close(out[start : start + q_len], o, rtol=1e-10, atol=1e-10)
        start += q_len


def test_build_metadata_slots_and_padding() -> None:
    from prefixserve.attention.metadata import build_metadata

    meta = build_metadata(4, [1, 3], [6, 3], [[7, 2], [5]], "cpu")
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert meta.block_tables.tolist() == [[7, 2], [5, 0]]
    # seq 0 writes index 5 (block 2, offset 1); seq 1 writes indices 0..2 of block 5
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 20, 21, 22]
    with pytest.raises(ValueError, match="query length"):
        build_metadata(4, [0], [3], [[1]], "cpu")
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata(4, [1], [9], [[1, 2]], "cpu")
