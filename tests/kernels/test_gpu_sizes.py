"""Real sizes on a GPU: bf16 shared path vs fp64, no worse than the plain paged path's own error."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import rel_err

from prefixserve.attention.kernels.paged_attention import paged_attention_ref
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.triton_backend import TritonBackend, TritonPagedBackend

pytestmark = pytest.mark.gpu


def _fp64_reference(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
    o, _ = paged_attention_ref(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, torch.float64
    )
    return o


@pytest.mark.parametrize(("batch", "prefix", "query_len"), [(64, 2048, 1), (16, 4096, 1), (8, 1024, 37)])
def test_shared_bf16_error_no_worse_than_paged(batch: int, prefix: int, query_len: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    hq, hkv, dim, bs = 32, 8, 128, 16
    own = torch.randint(1, 300, (batch,), generator=gen).tolist()  # ragged own suffixes
    n_prefix = prefix // bs
    num_blocks = n_prefix + sum(-(-(o + query_len) // bs) for o in own) + 1
    k = torch.randn(num_blocks, bs, hkv, dim, generator=gen).cuda().bfloat16()
    v = torch.randn(num_blocks, bs, hkv, dim, generator=gen).cuda().bfloat16()
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared, at, tables, seq_lens = perm[:n_prefix], n_prefix, [], []
    for o in own:
        n = -(-(o + query_len) // bs)
        tables.append(shared + perm[at : at + n])
        at += n
        seq_lens.append(prefix + o + query_len)
    meta = build_metadata(bs, [query_len] * batch, seq_lens, tables, "cuda")
    q = torch.randn(batch * query_len, hq, dim, generator=gen).cuda().bfloat16()
    ref = _fp64_reference(q, k, v, meta, dim**-0.5)
    errs = {}
    for cls in (TritonBackend, TritonPagedBackend):
        be = cls()
        be.prepare(meta)
        errs[cls.name] = rel_err(be.forward(q, k, v, meta, dim**-0.5), ref)
    assert errs["triton"] < 1e-2
    assert errs["triton"] <= 1.25 * errs["triton_paged"] + 1e-4, errs


def test_fp32_d128_shared_segment_fits_and_matches_reference() -> None:
    """fp32 at Llama-3-8B head shapes with tall shared tiles: once OutOfResources in the shared kernel.

    32 holders x 4 heads = 128 stacked rows pick the tall tile, whose bf16 shape (128 x 128, 2 stages)
    needs 256 KiB of shared memory in fp32; the tiles must be fitted and the result stay exact.
    """
    from prefixserve.attention.reference import ReferenceBackend

    gen = torch.Generator().manual_seed(7)
    hq, hkv, dim, bs, batch, prefix = 32, 8, 128, 16, 32, 1024
    query_lens = [1] * (batch // 2) + [5] * (batch // 2)  # decode rows and prefill-chunk rows
    own = torch.randint(1, 100, (batch,), generator=gen).tolist()
    n_prefix = prefix // bs
    num_blocks = n_prefix + sum(-(-(o + 5) // bs) for o in own) + 1
    k = torch.randn(num_blocks, bs, hkv, dim, generator=gen).cuda()
    v = torch.randn(num_blocks, bs, hkv, dim, generator=gen).cuda()
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared, at, tables, seq_lens = perm[:n_prefix], n_prefix, [], []
    for o, ql in zip(own, query_lens, strict=True):
        n = -(-(o + ql) // bs)
        tables.append(shared + perm[at : at + n])
        at += n
        seq_lens.append(prefix + o + ql)
    meta = build_metadata(bs, query_lens, seq_lens, tables, "cuda")
    q = torch.randn(sum(query_lens), hq, dim, generator=gen).cuda()
    ref = ReferenceBackend().forward(q, k, v, meta, dim**-0.5)
    for cls in (TritonBackend, TritonPagedBackend):
        be = cls()
        be.prepare(meta)
        out = be.forward(q, k, v, meta, dim**-0.5)
        assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5, cls.name
    TritonBackend().prepare(meta)
    assert meta.stats["shared_segments"] >= 1
