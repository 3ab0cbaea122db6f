"""e4m3 codes made beside a kernel's own output (``kernels/e4m3.py``'s rule): RMSNorm's and
SiLU-and-mul's codes and row scales equal the quantize kernel's of the same 16-bit output, bit for
bit (one rule, the same ops), and the output itself is unchanged; on a GPU, an FP8 product takes the
codes it is handed (``fp8.attach_rows``) instead of quantizing its input again."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.model import fp8
from prefixserve.model.kernels import rms_norm, silu_mul
from prefixserve.model.kernels.fp8_matmul import quantize_rows

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


def _same_codes(codes, scales, dense) -> None:
    want_codes, want_scales = quantize_rows(dense)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (5, 200), (3, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_codes_equal_the_quantize_kernels(tokens: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(DEVICE, DTYPE)
    res = torch.randn(tokens, hidden, generator=gen).to(DEVICE, DTYPE) if with_residual else None
    w = torch.rand(hidden, generator=gen).to(DEVICE, DTYPE) + 0.5
    out, summed, codes, scales = rms_norm.add_rms_norm(x, w, 1e-6, res, quantize=True)
    plain_out, plain_summed = rms_norm.add_rms_norm(x, w, 1e-6, res)
    assert torch.equal(out, plain_out) and torch.equal(summed, plain_summed)
    assert codes.dtype == fp8.FP8 and scales.shape == (tokens, 1)
    _same_codes(codes, scales, out)


def test_rms_norm_codes_of_split_k_partials() -> None:
    gen = torch.Generator().manual_seed(7)
    parts = torch.randn(2, 4, 96, generator=gen).to(DEVICE)
    res = torch.randn(4, 96, generator=gen).to(DEVICE, DTYPE)
    w = torch.ones(96, device=DEVICE, dtype=DTYPE)
    out, _, codes, scales = rms_norm.add_rms_norm(parts, w, 1e-6, res, quantize=True)
    _same_codes(codes, scales, out)


@pytest.mark.parametrize(
    ("tokens", "inter"), [(1, 64), (4, 1500), (2, 2048), (2, 17000)]
)  # 17000: two passes
@pytest.mark.parametrize("gelu", [False, True])
def test_silu_and_mul_codes_equal_the_quantize_kernels(tokens: int, inter: int, gelu: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * inter)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 2).to(DEVICE, DTYPE)
    x[0, inter:] = 0  # a row whose product is all zeros: scale MIN_SCALE, codes 0
    out, codes, scales = silu_mul.silu_and_mul_quantize(x, gelu)
    assert torch.equal(out, silu_mul.silu_and_mul(x, gelu))
    _same_codes(codes, scales, out)
    assert (codes[0].float() == 0).all()


@pytest.mark.gpu
def test_an_fp8_product_takes_the_codes_it_is_handed() -> None:
    """Handed codes that are not x's (zeros), the product is zero at decode (the Triton kernel) and
    prefill (cuBLASLt) rows alike: it used them, and quantized nothing itself."""
    from torch import nn

    layer = nn.Linear(256, 128, bias=False).to(DEVICE, torch.bfloat16)
    fp8.quantize_layer(layer)
    assert fp8.takes_rows(layer)
    for m in (3, 200):
        x = torch.randn(m, 256, device=DEVICE, dtype=torch.bfloat16)
        assert fp8.linear(layer, x).abs().max() > 0
        zeros = torch.zeros(m, 256, device=DEVICE, dtype=fp8.FP8)
        fp8.attach_rows(x, zeros, torch.ones(m, 1, device=DEVICE))
        assert fp8.linear(layer, x).abs().max() == 0
