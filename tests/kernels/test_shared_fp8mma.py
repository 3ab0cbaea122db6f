"""The shared-segment kernel on FP8 tensor cores (``shared_gluon_fp8``, Hopper): its products against
fp64 with q rounded the way the kernel rounds it, within the bound e4m3's rounding of P sets; in the
engine's decode step (on by default). Its sm_90 build is checked on any machine by
test_shared_gluon.py's compile test; the GPU cases passed on an H200 at f0da0d1 (docs/kernels.md
§2.13), and tests/test_fp8_kv_gpu.py runs it inside an engine under decode graphs."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import CountedCalls, rel_err
from test_shared_gluon import HOPPER, SEGMENT_CASES, _segments, prefix_decode_step

from prefixserve.attention.kernels import shared_gluon_fp8
from prefixserve.attention.kernels.shared_attention import (
    shared_segment_attention,
    shared_segment_attention_ref,
)
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.attention.triton_backend import TritonBackend

E4M3 = torch.float8_e4m3fn
needs_hopper = pytest.mark.skipif(
    not (HOPPER and shared_gluon_fp8.GLUON), reason="needs a Hopper GPU and Gluon"
)


def rounded_query(q: torch.Tensor) -> torch.Tensor:
    """q as the kernel takes it: each (row, head) over its scale (amax / 448) rounded to e4m3, back in
    fp32."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (qf / scale).to(E4M3).float() * scale


def test_products_switch() -> None:
    """The A/B switch sets and restores whether the kernel is taken; it is on by default, and off a
    Hopper GPU the kernel is never taken."""
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    k8 = torch.zeros(2, 16, 2, 128, dtype=E4M3)
    assert shared_gluon_fp8._TAKEN["on"] is shared_gluon_fp8.DEFAULT_ON is True
    assert not shared_gluon_fp8.taken(q, k8, k8, 128)  # a CPU tensor
    with shared_gluon_fp8.products(False):
        assert shared_gluon_fp8._TAKEN["on"] is False
    assert shared_gluon_fp8._TAKEN["on"] is True


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("group", "dim", "lengths", "rows", "split"), SEGMENT_CASES)
def test_fp8_products_against_fp64(dtype, group, dim, lengths, rows, split) -> None:
    """Against fp64 attention with q rounded as the kernel rounds it, the other error is P's rounding
    to e4m3 (relative 2^-4 an element; P x 448 is normal down to 2^-15): a row's output moves by at
    most 2^-4 of the largest |v| it reads. Its RMS, 2^-4 / sqrt 3 = 0.036 of each term, is about
    the output's relative error over V of mean 0 (0.023 measured, H200). The lse comes from the
    unrounded P: it differs only where the kernel rounds an element of q a step apart from torch (it
    divides by the scale approximately) and by the tensor cores' sums, which keep about 14 bits."""
    q, k, v, seg = _segments(lengths, rows, group, dim, dtype, seed=group * dim + len(lengths))
    k8, v8 = k.to(E4M3), v.to(E4M3)
    kw = {"block_m": 128} | ({"min_chunk": 128, "target_programs": 4096} if split else {})
    with pytest.MonkeyPatch.context() as mp, shared_gluon_fp8.products(True):
        counter = CountedCalls(mp, shared_gluon_fp8, "launch")
        o, lse = shared_segment_attention(q, k8, v8, *seg, 0.09, **kw)
    assert counter.calls == 1
    q_hat = rounded_query(q).to(q.device)
    ref_o, ref_lse = shared_segment_attention_ref(q_hat, k8.float(), v8.float(), *seg, 0.09, torch.float64)
    assert torch.isfinite(o).all()
    assert float((o.double() - ref_o).abs().max()) <= 2.0**-4 * v8.float().abs().max().item()
    assert rel_err(o, ref_o) < 0.05
    assert float((lse.double() - ref_lse).abs().max() / ref_lse.abs().max()) < 2.0**-8
    exact_o, _ = shared_segment_attention_ref(q, k8.float(), v8.float(), *seg, 0.09, torch.float64)
    assert rel_err(o, exact_o) < 0.08  # q's rounding on top: 0.030-0.036 measured (H200)


@pytest.mark.gpu
@needs_hopper
def test_engine_decode_step_takes_the_fp8_kernel(monkeypatch) -> None:
    """96 sequences on a 2,048-token prefix over an e4m3 cache, switched on: the decode step's shared
    part runs on FP8 tensor cores, a later layer replays the recorded launch, and the step is within
    e4m3's error of the reference backend: q's and P's rounding, 0.035 of the output measured (H200)."""
    q, k, v, meta = prefix_decode_step(E4M3)
    dim = q.shape[-1]
    counter = CountedCalls(monkeypatch, shared_gluon_fp8, "launch")
    with shared_gluon_fp8.products(True):
        be = TritonBackend()
        be.prepare(meta)
        out = be.forward(q, k, v, meta, dim**-0.5)
        again = be.forward(q, k, v, meta, dim**-0.5)  # a later layer: the recorded launch, replayed
    ref = ReferenceBackend().forward(q, k, v, meta, dim**-0.5)
    assert counter.calls
    assert rel_err(out, ref) < 0.05
    assert rel_err(again, out) < 1e-6
