"""A decode step's KV splits merged inside the paged kernel (``merge.merge_last``), on the
two paths that relaunch it for every later layer: the eager backend's recorded launches and a decode
graph's. Two layers (other q, K and V, the same step) through each, both against the reference: a
relaunch that wrote its output anywhere but the layer's own would fail the second."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import DEVICE, rel_err

from prefixserve.attention.graph import HeadShape
from prefixserve.attention.graph_attention import PagedGraph, paged_graph_step
from prefixserve.attention.kernels import paged_attention
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.attention.triton_backend import TritonPagedBackend

BS, KV_HEADS, DIM, SCALE = 16, 2, 64, 0.1
LENS = [70, 3, 130, 41]


def _layers(group: int, seed: int = 0) -> tuple[list[tuple[torch.Tensor, ...]], object]:
    """Two layers' (q, K, V) over one step's tables, and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(math.ceil(n / BS) for n in LENS) + 2
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in LENS:
        tables.append(perm[at : at + math.ceil(n / BS)])
        at += math.ceil(n / BS)
    meta = build_metadata(BS, [1] * len(LENS), LENS, tables, DEVICE)
    layers = []
    for _ in range(2):
        k, v = (torch.randn(blocks, BS, KV_HEADS, DIM, generator=gen).to(DEVICE) for _ in "kv")
        q = torch.randn(len(LENS), KV_HEADS * group, DIM, generator=gen).to(DEVICE)
        layers.append((q, k, v))
    return layers, meta


@pytest.mark.parametrize("group", [1, 3])
def test_eager_backend_relaunches_the_merged_kernel_per_layer(group: int, monkeypatch) -> None:
    layers, meta = _layers(group)
    monkeypatch.setattr(paged_attention, "choose_split", lambda *a, **k: (4, 48))  # splits, as on a GPU
    be = TritonPagedBackend()
    be.prepare(meta)
    for q, k, v in layers:
        out, lse = be.forward_with_lse(q, k, v, meta, SCALE)
        ref, ref_lse = paged_attention.paged_attention_ref(
            q, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc, SCALE, torch.float64
        )
        assert rel_err(out, ref) < 1e-5
        assert float((lse.double() - ref_lse).abs().max()) < 1e-4
    layout = next(iter(be._step(meta).layouts.values()))
    assert len(layout.launches) == 1  # one kernel: no merge launch


@pytest.mark.parametrize("group", [4, 3])
def test_graph_relaunches_the_merged_kernel_per_layer(group: int) -> None:
    layers, meta = _layers(group, seed=1)
    shape = HeadShape(KV_HEADS * group, KV_HEADS, DIM, torch.float32, torch.device(DEVICE))
    bucket = len(LENS)
    step = paged_graph_step(meta, shape, bucket)
    key = (*step.key[:3], 4, step.key[4])  # four splits whatever this machine's SM count chose
    attn = PagedGraph(key, shape)
    attn.load(step.arrays)
    for q, k, v in layers:
        out = attn.forward(q, k, v, meta, SCALE)
        ref = ReferenceBackend().forward(q, k, v, meta, SCALE)
        assert rel_err(out, ref) < 1e-5
    assert len(attn.launches) == 1 and int(attn.counts.count_nonzero()) == 0
