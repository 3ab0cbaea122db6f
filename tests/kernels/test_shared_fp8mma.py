"""The shared-segment kernel on FP8 tensor cores (``shared_gluon_fp8``, Hopper): its products against
fp64 with q rounded the way the kernel rounds it, within the bound e4m3's rounding of P sets; in the
engine's decode step when switched on. Its sm_90 build is checked on any machine by
test_shared_gluon.py's compile test."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import rel_err
from test_shared_gluon import HOPPER, _segments

from prefixserve.attention.kernels import shared_gluon_fp8
from prefixserve.attention.kernels.shared_attention import (
    shared_segment_attention,
    shared_segment_attention_ref,
)
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.attention.triton_backend import TritonBackend

E4M3 = torch.float8_e4m3fn
needs_hopper = pytest.mark.skipif(
    not (HOPPER and shared_gluon_fp8.GLUON), reason="needs a Hopper GPU and Gluon"
)


def rounded_query(q: torch.Tensor, terms: int) -> torch.Tensor:
    """q as the kernel takes it: each (row, head) over its scale (amax / 448) as ``terms`` e4m3 terms
    (the second the first's rounding residual), back in fp32."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    scaled = qf / scale
    got = scaled.to(E4M3).float()
    if terms == 2:
        got = got + (scaled - got).to(E4M3).float()
    return got * scale


def test_products_switch_takes_only_its_values() -> None:
    """The A/B switch takes 0, 1 or 2 terms and restores what was set before; off a Hopper GPU the
    kernel is never taken."""
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    k8 = torch.zeros(2, 16, 2, 128, dtype=E4M3)
    with shared_gluon_fp8.products(2):
        assert shared_gluon_fp8._Q_TERMS["taken"] == 2
        assert shared_gluon_fp8.taken(q, k8, k8, 128) == 0  # a CPU tensor
    assert shared_gluon_fp8._Q_TERMS["taken"] == 0
    with pytest.raises(ValueError, match="q_terms must be 0, 1 or 2"), shared_gluon_fp8.products(3):
        pass


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("group", "dim", "lengths", "rows", "split"),
    [
        (4, 128, [4096], [96], False),
        (4, 128, [1000, 48, 2100], [40, 33, 70], False),  # ragged tails, a segment under one tile
        (8, 64, [777, 1536], [17, 50], True),
        (8, 128, [2048], [40], False),  # the last tile's last warpgroup has no rows
    ],
)
def test_fp8_products_against_fp64(terms, dtype, group, dim, lengths, rows, split) -> None:
    """Against fp64 attention with q rounded as the kernel rounds it, the only other error is P's
    rounding to e4m3 (relative 2^-4 an element, P x 448 in the normal range down to 2^-15): a row's
    output moves by at most 2^-4 of the largest |v| it reads, and its lse (from the unrounded P) not
    at all, but for fp32 sums."""
    q, k, v, seg = _segments(lengths, rows, group, dim, dtype, seed=group * dim + len(lengths) + terms)
    k8, v8 = k.to(E4M3), v.to(E4M3)
    kw = {"block_m": 128} | ({"min_chunk": 128, "target_programs": 4096} if split else {})
    calls = []
    original = shared_gluon_fp8.launch

    def counted(*args, **kwargs):
        calls.append(kwargs["q_terms"])
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, shared_gluon_fp8.products(terms):
        mp.setattr(shared_gluon_fp8, "launch", counted)
        o, lse = shared_segment_attention(q, k8, v8, *seg, 0.09, **kw)
    assert calls == [terms]
    q_hat = rounded_query(q, terms).to(q.device)
    ref_o, ref_lse = shared_segment_attention_ref(q_hat, k8.float(), v8.float(), *seg, 0.09, torch.float64)
    bound = 2.0**-4 * v8.float().abs().max().item()
    assert torch.isfinite(o).all()
    assert float((o.double() - ref_o).abs().max()) <= bound
    # each rounding is uniform within +-2^-4 of its P (RMS 2^-4 / sqrt 3 = 0.036); over V of mean 0 the
    # output is itself such a sum, so its relative error is about that RMS, not smaller
    assert rel_err(o, ref_o) < 0.05
    # the FP8 tensor cores add a product's terms keeping about 14 bits (not fp32's 24), so a score
    # carries up to 2^-13 of its terms' magnitude
    assert float((lse.double() - ref_lse).abs().max() / ref_lse.abs().max()) < 2.0**-12
    exact_o, _ = shared_segment_attention_ref(q, k8.float(), v8.float(), *seg, 0.09, torch.float64)
    print(f"terms {terms}: rel err {rel_err(o, exact_o):.2e} (exact q), {rel_err(o, ref_o):.2e} (rounded q)")


@pytest.mark.gpu
@needs_hopper
def test_engine_decode_step_takes_the_fp8_kernel(monkeypatch) -> None:
    """96 sequences on a 2,048-token prefix over an e4m3 cache, switched on: the decode step's shared
    part runs on FP8 tensor cores, a later layer replays the recorded launch, and the step is within
    e4m3's error of the reference backend."""
    gen = torch.Generator().manual_seed(11)
    batch, prefix, bs, hq, hkv, dim = 96, 2048, 16, 16, 4, 128
    own = torch.randint(1, 90, (batch,), generator=gen).tolist()
    n_prefix = prefix // bs
    need = n_prefix + sum(-(-(o + 1) // bs) for o in own) + 1
    k = torch.randn(need, bs, hkv, dim, generator=gen).cuda().to(E4M3)
    v = torch.randn(need, bs, hkv, dim, generator=gen).cuda().to(E4M3)
    perm = (n_prefix + torch.randperm(need - n_prefix, generator=gen)).tolist()
    tables, seq_lens, at = [], [], 0
    for o in own:
        n = -(-(o + 1) // bs)
        tables.append(list(range(n_prefix)) + perm[at : at + n])
        at += n
        seq_lens.append(prefix + o + 1)
    meta = build_metadata(bs, [1] * batch, seq_lens, tables, "cuda")
    q = torch.randn(batch, hq, dim, generator=gen).cuda().bfloat16()
    calls = []
    original = shared_gluon_fp8.launch
    monkeypatch.setattr(shared_gluon_fp8, "launch", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    with shared_gluon_fp8.products(2):
        be = TritonBackend()
        be.prepare(meta)
        out = be.forward(q, k, v, meta, dim**-0.5)
        again = be.forward(q, k, v, meta, dim**-0.5)  # a later layer: the recorded launch, replayed
    ref = ReferenceBackend().forward(q, k, v, meta, dim**-0.5)
    assert calls
    assert rel_err(out, ref) < 2e-2
    assert rel_err(again, out) < 1e-6
