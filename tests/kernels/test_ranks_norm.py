"""The fused all-reduce + residual add + RMSNorm past two ranks against its torch reference.

One process plays one rank of N: the other ranks' products and counts are ordinary tensors whose
addresses go in the tables, their counts already showing their call, as after their programs ran
first. (N real ranks over NVLink: ``tests/test_peer_norm_gpu.py``.)"""

from __future__ import annotations

import functools

import pytest
import torch
from _kernel_helpers import DEVICE, compiled_for_hopper

from prefixserve.model.kernels.peer_norm import MAX_PROGRAMS
from prefixserve.model.kernels.ranks_norm import MAX_RANKS, ranks_add_rms_norm, ranks_add_rms_norm_ref

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
EPS = 1e-5


def _addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=DEVICE)


def _as_rank(
    rank: int, products: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One rank's call, the others having made theirs: (out, sum, every rank's counts, this rank's calls)."""
    ranks = len(products)
    counts = [torch.zeros(MAX_RANKS * MAX_PROGRAMS, dtype=torch.int64, device=DEVICE) for _ in range(ranks)]
    counts[rank].view(MAX_RANKS, MAX_PROGRAMS)[:ranks] = 1  # every other rank's first call
    calls = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=DEVICE)
    abort = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out, summed = ranks_add_rms_norm(
        _addresses(products),
        rank,
        products[rank],
        residual,
        weight,
        EPS,
        counts[rank],
        _addresses(counts),
        calls,
        abort,
    )
    return out, summed, counts, calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("ranks", "rank", "rows", "hidden"),
    [(3, 0, 1, 64), (3, 2, 7, 96), (4, 1, 9, 40), (4, 3, 4, 64), (8, 5, 30, 32), (5, 4, 13, 48)],
)
def test_ranks_add_rms_norm_matches_reference(
    dtype: torch.dtype, ranks: int, rank: int, rows: int, hidden: int
) -> None:
    gen = torch.Generator().manual_seed(rows * hidden + ranks)
    products = [torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) for _ in range(ranks)]
    residual = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    out, summed, counts, calls = _as_rank(rank, products, residual, weight)
    ref, ref_summed = ranks_add_rms_norm_ref(products, residual, weight, EPS)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(summed, ref_summed, **tol)
    torch.testing.assert_close(out, ref, **tol)
    programs = min(rows, MAX_PROGRAMS)
    assert calls[:programs].eq(1).all() and calls[programs:].eq(0).all()
    for q in range(ranks):  # each program told every other rank of its call, at [rank, program]
        if q != rank:
            told = counts[q].view(MAX_RANKS, MAX_PROGRAMS)
            assert told[rank, :programs].eq(1).all() and told[rank, programs:].eq(0).all()
            assert told[torch.arange(MAX_RANKS) != rank].eq(0).all()


def test_every_rank_gets_the_same_stream_bit_for_bit() -> None:
    """Each rank sums the products in rank order: the replicated residual streams must come out
    identical, or the ranks drift apart."""
    gen = torch.Generator().manual_seed(11)
    products = [torch.randn(6, 64, generator=gen).to(DEVICE) * 10 ** (i % 3) for i in range(4)]
    residual = torch.randn(6, 64, generator=gen).to(DEVICE)
    weight = torch.ones(64, device=DEVICE)
    results = [_as_rank(rank, products, residual, weight)[:2] for rank in range(4)]
    for out, summed in results[1:]:
        assert torch.equal(summed, results[0][1]) and torch.equal(out, results[0][0])


def test_the_embeddings_sum_has_no_residual() -> None:
    gen = torch.Generator().manual_seed(5)
    products = [torch.randn(3, 32, generator=gen).to(DEVICE) for _ in range(3)]
    weight = torch.ones(32, device=DEVICE)
    out, summed, _, _ = _as_rank(1, products, None, weight)
    ref, ref_summed = ranks_add_rms_norm_ref(products, None, weight, EPS)
    torch.testing.assert_close(summed, ref_summed)
    torch.testing.assert_close(out, ref)


def test_ranks_add_rms_norm_refuses_bad_tables() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    counts = torch.zeros(MAX_RANKS * MAX_PROGRAMS, dtype=torch.int64, device=DEVICE)
    calls = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=DEVICE)
    abort = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    table = _addresses([x, x, x])
    with pytest.raises(ValueError, match="rank 3 of 3"):
        ranks_add_rms_norm(table, 3, x, x, x[0], EPS, counts, _addresses([counts] * 3), calls, abort)
    with pytest.raises(ValueError, match="counts_table"):
        ranks_add_rms_norm(table, 0, x, x, x[0], EPS, counts, _addresses([counts] * 2), calls, abort)
    with pytest.raises(ValueError, match="my_counts"):
        ranks_add_rms_norm(table, 0, x, x, x[0], EPS, counts[:8], _addresses([counts] * 3), calls, abort)


def test_peer_sum_past_two_ranks_takes_the_ranks_kernel() -> None:
    """The engine's call site at four ranks: the norm sums through ``ranks_add_rms_norm``."""
    from types import SimpleNamespace

    from prefixserve.model.peer_allreduce import PeerSum, _FusedSlots

    ranks, rank, rows, cols = 4, 2, 3, 32
    gen = torch.Generator().manual_seed(rows)
    products = [torch.randn(rows, cols, generator=gen).to(DEVICE) for _ in range(ranks)]
    residual, weight = torch.randn(rows, cols, generator=gen).to(DEVICE), torch.ones(cols, device=DEVICE)
    counts = [torch.zeros(MAX_RANKS * MAX_PROGRAMS, dtype=torch.int64, device=DEVICE) for _ in range(ranks)]
    counts[rank].view(MAX_RANKS, MAX_PROGRAMS)[:ranks] = 1
    slots = SimpleNamespace(
        size=ranks,
        rank=rank,
        tables=[_addresses(products)],
        counts=counts[rank],
        counts_table=_addresses(counts),
        calls=torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=DEVICE),
        abort=torch.zeros(1, dtype=torch.int32, device=DEVICE),
    )
    slots.ranks_norm = functools.partial(_FusedSlots.ranks_norm, slots)  # the slots' own call, unchanged
    out, summed = PeerSum(slots, 0, products[rank]).add_rms_norm(residual, weight, EPS)  # type: ignore[arg-type]
    ref, ref_summed = ranks_add_rms_norm_ref(products, residual, weight, EPS)
    torch.testing.assert_close(summed, ref_summed)
    torch.testing.assert_close(out, ref)
    assert slots.calls[:rows].eq(1).all() and slots.calls[rows:].eq(0).all()


@pytest.mark.parametrize(
    ("ranks", "rows", "fused"), [(2, 512, True), (4, 32, True), (4, 33, False), (8, 1, True)]
)
def test_product_slots_past_two_ranks_stop_at_a_few_rows(ranks: int, rows: int, fused: bool) -> None:
    """Above ``RANKS_MAX_ROWS`` rows at more than two ranks there is no product slot: the layer
    takes the two-shot all-reduce, then the norm (fewer bytes across NVLink at those sizes)."""
    from types import SimpleNamespace

    from prefixserve.model.peer_allreduce import RANKS_MAX_ROWS, PeerAllReduce

    assert RANKS_MAX_ROWS == 32
    peer = object.__new__(PeerAllReduce)
    mine = torch.zeros(rows, 64)
    peer.fused = SimpleNamespace(size=ranks, mine=lambda *shape: mine)  # type: ignore[attr-defined]
    pending = peer.product_slot(0, rows, 64, torch.bfloat16)
    assert (pending is not None) is fused


def test_compiles_for_hopper_with_whole_vector_loads() -> None:
    """The real compiler (sm_90, no GPU needed): both ways compile, and the products' addresses from
    the table keep their alignment, so a row's loads go 16 bytes at a time, not an element at a time."""
    results = compiled_for_hopper("_ranks_norm_compile.py")
    assert len(results) == 4
    for r in results:
        assert r["v4_loads"] > 0 and r["b16_loads"] == 0, r
