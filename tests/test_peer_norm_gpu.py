"""The fused all-reduce + norm over NVLink at real widths: two GPUs (and four), one process each.

Each meeting protocol (call counts, pulled and pushed; compare-and-swap) runs 200 graphed calls with
fresh products in alternating slots, at decode sizes and with every program several warps wide (the
8B's hidden size: a count that the warps of one program disagree on deadlocks or reads a stale
product). Every output must equal the sum computed apart. Needs 2 CUDA GPUs (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

ROWS = (1, 64, 256, 512)
HIDDEN = 4096


def _worker(rank: int, size: int, init: str, queue) -> None:
    import torch.distributed as dist

    from benchmarks.harness.ranks import join_group, leave_group
    from benchmarks.probes.peer_signal import VARIANTS, Meeting, wrong_outputs
    from prefixserve.model.peer_allreduce import PeerAllReduce

    join_group(rank, size, init)
    meet = Meeting(PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "test-peer-norm"))
    wrong = {}
    for name, variant in {**VARIANTS, "engine": {"engine": True}}.items():
        for rows in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                if rows * HIDDEN * dtype.itemsize <= 8 << 20:
                    wrong[f"{name} {rows} {dtype}"] = wrong_outputs(meet, variant, rows, HIDDEN, dtype, rank)
    leave_group(queue, rank, wrong)


def test_every_meeting_protocol_sums_fresh_products() -> None:
    from benchmarks.harness.ranks import run_ranks

    results = run_ranks(_worker, timeout=240)
    for rank, wrong in enumerate(results):
        assert not any(wrong.values()), f"rank {rank}: {wrong}"
    assert len(results[0]) == len(results[1]) > 0


def _ranks_worker(rank: int, size: int, init: str, queue) -> None:
    import torch.distributed as dist

    from benchmarks.harness.ranks import join_group, leave_group
    from benchmarks.probes.peer_signal import Meeting, wrong_outputs
    from prefixserve.model.peer_allreduce import RANKS_MAX_ROWS, PeerAllReduce

    join_group(rank, size, init)
    meet = Meeting(PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "test-ranks-norm"))
    wrong = {}
    variants = {"ranks kernel": {"ranks": True}, "engine": {"engine": True}}
    for name, variant in variants.items():
        for rows in (*ROWS, 3, 33):
            if name == "engine" and rows > RANKS_MAX_ROWS:  # the engine's is PyTorch's two-shot there
                continue
            for dtype in (torch.float32, torch.bfloat16):
                if rows * HIDDEN * dtype.itemsize <= 8 << 20:
                    wrong[f"{name} {rows} {dtype}"] = wrong_outputs(meet, variant, rows, HIDDEN, dtype, rank)
    leave_group(queue, rank, wrong)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_four_ranks_sum_fresh_products() -> None:
    """``kernels/ranks_norm.py`` over 4 GPUs: every rank's output of 200 graphed calls with fresh
    products equals the rank-order sum of the gathered products (so every rank's is the same), the
    kernel forced at every size and as the engine calls it up to ``RANKS_MAX_ROWS`` (above, the engine
    sums with PyTorch's two-shot all-reduce, which adds in the model dtype: the four-GPU greedy test in
    ``test_tensor_parallel_gpu.py`` covers that path)."""
    from benchmarks.harness.ranks import run_ranks

    results = run_ranks(_ranks_worker, size=4, timeout=300)
    for rank, wrong in enumerate(results):
        assert not any(wrong.values()), f"rank {rank}: {wrong}"
    assert len(results[0]) > 0


def _argmax_worker(rank: int, size: int, init: str, queue) -> None:
    import torch.distributed as dist

    from benchmarks.harness.ranks import join_group, leave_group
    from prefixserve.model.peer_allreduce import PeerAllReduce

    join_group(rank, size, init)
    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "test-peer-argmax")
    vocab = 50_000  # per rank
    wrong = {}
    for rows in (1, 64, 256, 1000):
        bad = 0
        for call in range(20):
            gen = torch.Generator(device="cuda").manual_seed(rows * 100 + call)  # the same on both ranks
            full = torch.randn(rows, 2 * vocab, device="cuda", generator=gen).to(torch.bfloat16)
            if call % 2:  # every third row's maximum on both ranks exactly: rank 0's column must win
                top = full.float().amax(-1).to(torch.bfloat16) + 1
                full[::3, 7] = top[::3]
                full[::3, vocab + 7] = top[::3]
            mine = full[:, rank * vocab : (rank + 1) * vocab].contiguous()
            local = mine.argmax(-1)
            tokens = peer.argmax(mine, local, rank * vocab)
            bad += int((tokens != full.argmax(-1)).sum())
        wrong[rows] = bad
    leave_group(queue, rank, wrong)


def test_the_sharded_argmax_exchange_picks_the_whole_vocabulary_argmax() -> None:
    """Each rank's best column over NVLink (``kernels/peer_argmax.py``): the tokens equal the argmax
    over both ranks' columns, ties going to the first rank's, 20 calls with fresh logits a size."""
    from benchmarks.harness.ranks import run_ranks

    results = run_ranks(_argmax_worker, timeout=240)
    for rank, wrong in enumerate(results):
        assert not any(wrong.values()), f"rank {rank}: {wrong}"
