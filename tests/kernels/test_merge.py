"""LSE merge kernel vs its torch reference: any number of parts per row, -inf parts, empty rows."""

from __future__ import annotations

import math

import pytest
import torch
import triton
from _kernel_helpers import DEVICE

from prefixserve.attention.kernels.merge import MERGE_ELEMENTS, merge_partials, merge_partials_ref


def _parts(num_parts: int, rows: int, heads: int, dim: int, gen: torch.Generator):
    o = torch.randn(num_parts, rows, heads, dim, generator=gen)
    lse = torch.randn(num_parts, rows, heads, generator=gen) * 4
    lse[torch.rand(num_parts, rows, heads, generator=gen) < 0.3] = -math.inf  # empty parts
    lse[:, 0] = -math.inf  # row 0: every part empty -> zeros and -inf
    return o, lse


@pytest.mark.parametrize("num_parts", [1, 3, 9])
def test_regular_merge_matches_reference(num_parts: int) -> None:
    gen = torch.Generator().manual_seed(num_parts)
    o, lse = _parts(num_parts, 5, 4, 64, gen)
    out = torch.full((5, 4, 64), math.nan, device=DEVICE)
    got, got_lse = merge_partials(
        o.flatten(0, 1).to(DEVICE), lse.flatten(0, 1).to(DEVICE), 5, num_parts=num_parts, out=out
    )
    ref, ref_lse = merge_partials_ref(list(o), list(lse))
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-6)
    assert (got[0] == 0).all() and (got_lse[0] == -math.inf).all()


def test_csr_merge_rows_with_varying_part_counts() -> None:
    gen = torch.Generator().manual_seed(1)
    heads, dim = 3, 32  # heads not a power of two: masked head lanes
    counts = [0, 1, 4, 2, 3, 9]  # row 0 has no part at all
    total = sum(counts)
    o = torch.randn(total, heads, dim, generator=gen)
    lse = torch.randn(total, heads, generator=gen) * 3
    lse[2, 1] = -math.inf
    perm = torch.randperm(total, generator=gen)  # a row's parts lie anywhere in the buffer
    row_ptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full((6, heads, dim), math.nan, device=DEVICE)
    got, got_lse = merge_partials(
        o.to(DEVICE),
        lse.to(DEVICE),
        6,
        row_ptr=row_ptr.to(DEVICE),
        part_idx=perm.to(torch.int32).to(DEVICE),
        out=out,
    )
    for r in range(6):
        idx = perm[row_ptr[r] : row_ptr[r + 1]].long()
        if len(idx) == 0:
            assert (got[r] == 0).all() and (got_lse[r] == -math.inf).all()
            continue
        ref, ref_lse = merge_partials_ref(list(o[idx, None]), list(lse[idx, None]))
        torch.testing.assert_close(got[r].cpu().double(), ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_lse[r].cpu().double(), ref_lse[0], rtol=1e-5, atol=1e-6)


def test_merge_of_split_attention_is_exact() -> None:
    """Attention over two halves of the keys, merged, equals attention over all of them."""
    from prefixserve.attention.reference import attention_with_lse

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, 4, 64, generator=gen)
    k = torch.randn(30, 2, 64, generator=gen)
    v = torch.randn(30, 2, 64, generator=gen)
    full, full_lse = attention_with_lse(q, k, v, 0.125)
    a, la = attention_with_lse(q, k[:11], v[:11], 0.125)
    b, lb = attention_with_lse(q, k[11:], v[11:], 0.125)
    o = torch.cat([a, b]).to(DEVICE)
    lse = torch.cat([la, lb]).to(DEVICE)
    got, got_lse = merge_partials(o, lse, 4, num_parts=2)
    torch.testing.assert_close(got.cpu(), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse.cpu(), full_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("heads", "dim"), [(20, 64), (32, 128), (5, 256)])
def test_head_blocks_cover_every_head(heads: int, dim: int) -> None:
    """Programs take a block of heads each (several per row, the last one partly masked)."""
    gen = torch.Generator().manual_seed(heads)
    o, lse = _parts(2, 4, heads, dim, gen)
    out = torch.full((4, heads, dim), math.nan, device=DEVICE)
    rec: list = []
    got, got_lse = merge_partials(
        o.flatten(0, 1).to(DEVICE), lse.flatten(0, 1).to(DEVICE), 4, num_parts=2, out=out, launches=rec
    )
    ref, ref_lse = merge_partials_ref(list(o), list(lse))
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-6)
    block_h = min(triton.next_power_of_2(heads), max(1, MERGE_ELEMENTS // dim))
    assert rec[0].grid[:2] == (4, -(-heads // block_h))
