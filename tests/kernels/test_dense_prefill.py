"""Long prefills through SDPA (``attention/dense_prefill.py``): the gathers and causal alignments against
the fp64 oracle on random paged caches (CPU: SDPA's math kernel; GPU: cuDNN's or FlashAttention-2's),
which steps take the path, and the paged backend running it."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import DEVICE, paged_cache, rel_err

from prefixserve.attention import dense_prefill
from prefixserve.attention.kernels.paged_attention import paged_attention_ref
from prefixserve.attention.metadata import build_metadata

BS = 16


def _step(q_lens: list[int], seq_lens: list[int], q_heads: int, kv_heads: int, dim: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k, v, tables = paged_cache(seq_lens, BS, kv_heads, dim, dtype, gen)
    meta = build_metadata(BS, q_lens, seq_lens, tables, DEVICE)
    q = torch.randn(sum(q_lens), q_heads, dim, generator=gen).to(DEVICE, dtype)
    return q, k, v, meta


def _reference(q, k, v, meta, scale: float) -> torch.Tensor:
    return paged_attention_ref(
        q, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, torch.float64
    )[0]


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "heads", "dim"),
    [
        ([37], [37], (4, 4), 64),  # a fresh prefill: causal from the top left
        ([40, 23], [40, 61], (8, 2), 64),  # the second a chunk after 38 tokens of context
        ([17], [100], (12, 4), 128),  # a chunk after a prefix hit, GQA 3
        ([33, 50], [33, 50], (4, 1), 32),  # two fresh prefills, one KV head
    ],
)
def test_dense_attention_equals_the_oracle(q_lens, seq_lens, heads, dim) -> None:
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    q, k, v, meta = _step(q_lens, seq_lens, *heads, dim, dtype, seed=len(q_lens) + dim)
    scale = 1 / math.sqrt(dim)
    seqs = tuple(
        dense_prefill.DenseSequence(i, sum(q_lens[:i]), ql, sl)
        for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True))
    )
    out = torch.full_like(q, math.nan)  # poison: a row left unwritten fails
    dense_prefill.attend(q, k, v, meta, seqs, scale, out)
    assert rel_err(out, _reference(q, k, v, meta, scale)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_an_fp8_cache_is_widened_as_the_paged_kernel_widens_it() -> None:
    """e4m3 K/V gathered and widened to q's dtype (exact): the same attention as over the widened cache."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    q, k, v, meta = _step([21], [45], 4, 2, 64, dtype, seed=5)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    seqs = (dense_prefill.DenseSequence(0, 0, 21, 45),)
    out = dense_prefill.attend(q, k8, v8, meta, seqs, 0.125, torch.empty_like(q))
    ref = _reference(q, k8.to(dtype), v8.to(dtype), meta, 0.125)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_which_steps_take_the_dense_path(monkeypatch) -> None:
    monkeypatch.setattr(dense_prefill, "MIN_ROWS", 8)
    monkeypatch.setattr(dense_prefill, "MAX_SEQS", 2)
    tables = [[0, 1], [2, 3]]
    plan = dense_prefill.plan(build_metadata(BS, [9, 20], [9, 30], tables, DEVICE))
    assert plan == (dense_prefill.DenseSequence(0, 0, 9, 9), dense_prefill.DenseSequence(1, 9, 20, 30))
    assert dense_prefill.plan(build_metadata(BS, [9, 1], [9, 30], tables, DEVICE)) is None  # a decode row
    three = build_metadata(BS, [9, 9, 9], [9, 9, 9], [[0], [1], [2]], DEVICE)
    assert dense_prefill.plan(three) is None  # more sequences than MAX_SEQS


def test_dense_path_takes_only_shapes_sdpa_runs() -> None:
    q = torch.empty(4, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(2, BS, 2, 128, dtype=torch.bfloat16)
    assert dense_prefill.takes(q, k)
    assert dense_prefill.takes(q, k.to(torch.float8_e4m3fn))  # an FP8 cache: widened as gathered
    assert not dense_prefill.takes(q.float(), k.float())
    wide = torch.empty(4, 8, 512, dtype=torch.bfloat16)  # Gemma 4's global heads
    assert not dense_prefill.takes(wide, torch.empty(2, BS, 2, 512, dtype=torch.bfloat16))


def test_steps_the_dense_path_leaves_to_the_paged_kernel(monkeypatch) -> None:
    """A sliding group's view, a step over Prompt Cache module blocks, a context past MAX_CONTEXT."""
    import numpy as np

    monkeypatch.setattr(dense_prefill, "MIN_ROWS", 8)
    meta = build_metadata(BS, [9], [9], [[0]], DEVICE)
    assert dense_prefill.plan(meta) is not None
    meta.table_base = torch.zeros(1, dtype=torch.int32)
    assert dense_prefill.plan(meta) is None
    modules = build_metadata(BS, [9], [9], [[1]], DEVICE)
    modules.module_rows = np.array([0, 16])  # block 1 is a module's
    assert dense_prefill.plan(modules) is None
    modules.module_rows = np.array([0, 0])  # Prompt Cache on, no module block in this step
    assert dense_prefill.plan(modules) is not None
    monkeypatch.setattr(dense_prefill, "MAX_CONTEXT", 8)
    assert dense_prefill.plan(build_metadata(BS, [9], [9], [[0]], DEVICE)) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the backend sends steps to SDPA on a GPU only")
@pytest.mark.parametrize("backend", ["triton_paged", "triton"])
def test_backend_runs_long_prefills_through_sdpa(backend: str, monkeypatch) -> None:
    """Above ``MIN_WORK`` (64 query heads) the backend's output is SDPA's: ``attend`` ran."""
    from prefixserve.attention.backend import make_backend

    ran = []
    attend = dense_prefill.attend
    monkeypatch.setattr(dense_prefill, "attend", lambda *a: ran.append(1) or attend(*a))
    q_lens, seq_lens = [2100, 2500], [2100, 3000]
    q, k, v, meta = _step(q_lens, seq_lens, 64, 8, 128, torch.bfloat16, seed=3)
    be = make_backend(backend)
    be.prepare(meta)
    assert meta.plan.dense is not None
    out = be.forward(q, k, v, meta, 0.088)
    assert ran and rel_err(out, _reference(q, k, v, meta, 0.088)) < 1e-2
