"""The shared kernel's TMA path (contiguous segments, 16-bit KV) vs the pointer path and the reference.

Under the CPU interpreter the descriptor loads run too, so CI checks the path's indexing: the first
cache row of each work item, whole tiles by TMA and the ragged tail by pointers, KV splits, and the
descriptors remade for each layer's cache when a recorded launch is replayed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _kernel_helpers import DEVICE, rel_err

from prefixserve.attention.graph import HeadShape
from prefixserve.attention.kernels.shared_attention import (
    shared_segment_attention,
    shared_segment_attention_ref,
)
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning.shared_plan import contiguous_first_rows, plan_shared_work
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.attention.triton_backend import TritonBackend

KV_HEADS = 2
I32 = {"dtype": torch.int32, "device": DEVICE}


def test_contiguous_first_rows() -> None:
    blocks = np.array([4, 5, 6, 9, 2, 3, 7, 7, 8])
    starts = [0, 3, 4, 6, 6, 7, 9]  # [4 5 6] [9] [2 3] [] [7] [7 8]
    first = contiguous_first_rows(blocks, starts, 16)
    assert first.tolist() == [64, 144, 32, -1, 112, 112]
    first = contiguous_first_rows(np.array([4, 6, 7]), [0, 3], 16)  # a gap: pointer path
    assert first.tolist() == [-1]


def _contiguous_segments(block_size: int, dim: int, dtype: torch.dtype, gen: torch.Generator, tail: int):
    """Three segments in consecutive blocks (one ragged: ``tail`` tokens short of its last block)."""
    k = torch.randn(32, block_size, KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(32, block_size, KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
    segs = [[5, 6, 7, 8, 9], [20, 21], [12]]
    rows = [[0, 2, 4, 5, 6], [1, 2], [3, 0, 5]]
    tokens = [len(s) * block_size for s in segs]
    tokens[0] -= tail
    seg_blocks = torch.tensor([b for s in segs for b in s], **I32)
    seg_block_start = torch.tensor([0, *np.cumsum([len(s) for s in segs]).tolist()], **I32)
    seg_rows = torch.tensor([r for rs in rows for r in rs], **I32)
    seg_row_start = torch.tensor([0, *np.cumsum([len(r) for r in rows]).tolist()], **I32)
    return k, v, (seg_blocks, seg_block_start, torch.tensor(tokens, **I32), seg_rows, seg_row_start)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("group", "dim", "block_size", "split", "tail"),
    [(4, 64, 16, False, 0), (1, 64, 16, True, 5), (4, 128, 32, True, 0), (8, 64, 32, False, 9)],
)
def test_tma_path_matches_pointer_path_and_reference(dtype, group, dim, block_size, split, tail) -> None:
    gen = torch.Generator().manual_seed(group * dim + block_size + tail)
    k, v, seg = _contiguous_segments(block_size, dim, dtype, gen, tail)
    q = torch.randn(7, KV_HEADS * group, dim, generator=gen).to(DEVICE, dtype)
    kw = {"min_chunk": 16, "block_n": 16, "target_programs": 10_000} if split else {"block_n": 32}
    work = plan_shared_work(
        seg[4].tolist(),
        seg[2].tolist(),
        KV_HEADS,
        group,
        q.device,
        head_dim=dim,
        dtype=dtype,
        seg_blocks=seg[0].cpu().numpy(),
        seg_block_start=seg[1].tolist(),
        block_size=block_size,
    )
    assert work.tma
    o_tma, lse_tma = shared_segment_attention(q, k, v, *seg, 0.1, **kw)
    o_ptr, _ = shared_segment_attention(q, k, v, *seg, 0.1, use_tma=False, **kw)
    ref_o, ref_lse = shared_segment_attention_ref(q, k, v, *seg, 0.1, torch.float64)
    assert rel_err(o_tma, o_ptr) < 1e-5  # same tiles, same order: only the loads differ
    assert rel_err(o_tma, ref_o) < 1.5e-2
    assert float((lse_tma.double() - ref_lse).abs().max()) < 2e-2


def test_one_scattered_segment_takes_the_pointer_path() -> None:
    work = plan_shared_work(
        [0, 2, 4],
        [32, 32],
        KV_HEADS,
        4,
        DEVICE,
        seg_blocks=np.array([3, 4, 9, 7]),
        seg_block_start=[0, 2, 4],
        block_size=16,
    )
    assert not work.tma
    fp32 = plan_shared_work(
        [0, 2],
        [32],
        KV_HEADS,
        4,
        DEVICE,
        dtype=torch.float32,
        seg_blocks=np.array([3, 4]),
        seg_block_start=[0, 2],
    )
    assert not fp32.tma  # the exactness path stays on pointer loads


def _prefix_batch(dtype: torch.dtype, gen: torch.Generator, bs: int = 16, group: int = 4, dim: int = 64):
    """Three decoding sequences on a contiguous 4-block prefix, each with scattered own blocks."""
    tables = [[2, 3, 4, 5, 17, 11], [2, 3, 4, 5, 9], [2, 3, 4, 5, 14, 8]]
    lens = [5 * bs + 3, 4 * bs + 7, 5 * bs + bs]
    meta = build_metadata(bs, [1, 1, 1], lens, tables, DEVICE)
    q = torch.randn(3, KV_HEADS * group, dim, generator=gen).to(DEVICE, dtype)
    return q, meta


def test_relaunch_remakes_descriptors_for_each_layer() -> None:
    """Layer 2 replays layer 1's recorded launch with its own caches: its descriptors must follow."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16
    q, meta = _prefix_batch(dtype, gen)
    caches = [
        tuple(torch.randn(20, 16, KV_HEADS, 64, generator=gen).to(DEVICE, dtype) for _ in range(2))
        for _layer in range(2)
    ]
    be = TritonBackend()
    be.prepare(meta)
    outs = [be.forward(q, k, v, meta, 0.1) for k, v in caches]
    lay = next(iter(meta.plan.layouts.values()))
    assert lay.work.tma
    shared_launch = lay.launches[0][0]
    assert [d[:2] for d in shared_launch.derived] == [(3, 1), (4, 2)]
    for out, (k, v) in zip(outs, caches, strict=True):
        ref = ReferenceBackend().forward(q, k, v, meta, 0.1)
        assert rel_err(out, ref) < 1.5e-2
    assert rel_err(outs[0], outs[1]) > 0.1  # the second layer did not read the first one's cache


def test_graph_step_takes_the_tma_path() -> None:
    from prefixserve.attention.graph import GraphAttention  # noqa: F401 (the built attention's type)

    gen = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16
    q, meta = _prefix_batch(dtype, gen)
    k = torch.randn(20, 16, KV_HEADS, 64, generator=gen).to(DEVICE, dtype)
    v = torch.randn(20, 16, KV_HEADS, 64, generator=gen).to(DEVICE, dtype)
    host = build_metadata(16, [1, 1, 1], meta.seq_lens_host, meta.block_tables.tolist(), "cpu")
    shape = HeadShape(KV_HEADS * 4, KV_HEADS, 64, dtype, DEVICE)
    step = TritonBackend().graph_step(host, shape, 4)
    assert step.key[0] == "shared" and step.key[4][3] is True
    attn = step.build()
    attn.load(step.arrays)
    pad = torch.randn(1, *q.shape[1:], generator=gen).to(DEVICE, dtype)
    out = attn.forward(torch.cat([q, pad]), k, v, None, 0.1)[:3]
    ref = ReferenceBackend().forward(q, k, v, meta, 0.1)
    assert rel_err(out, ref) < 1.5e-2
    # its pointer-load twin: the same step without TMA tiles (what scattered blocks take), the same
    # attention, and a key the graph of scattered steps shares
    plain = step.plain()
    assert plain.key[4][3] is False and plain.key[:2] == step.key[:2] and plain.plain is None
    twin = plain.build()
    twin.load(plain.arrays)
    assert rel_err(twin.forward(torch.cat([q, pad]), k, v, None, 0.1)[:3], ref) < 1.5e-2
