"""Split-K partials of the decode products (``skinny_partials``, ``fp8_partials``): each of the S
planes is its slice of K's product, so their sum is the whole product (fp64 reference), scales
applied in each plane for FP8. The next kernel (an add-RMSNorm, the RoPE kernel) sums them; that sum
is tested with those kernels. On a CPU the Triton interpreter runs fp16 (its bf16 dot is wrong)."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.model import fp8
from prefixserve.model.kernels.fp8_matmul import fp8_partials, quantize_rows
from prefixserve.model.kernels.skinny_matmul import skinny_partials

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "splits"), [(1, 40, 512, 2), (17, 72, 768, 3), (64, 33, 1024, 4)])
def test_skinny_partials_are_the_slices_products(dtype, m: int, n: int, k: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    parts = skinny_partials(x, w, splits)
    assert parts.shape == (splits, m, n) and parts.dtype == torch.float32
    width = k // splits
    for s in range(splits):
        want = x[:, s * width : (s + 1) * width].double() @ w[:, s * width : (s + 1) * width].double().T
        torch.testing.assert_close(parts[s].double(), want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(parts.sum(0).double(), x.double() @ w.double().T, rtol=1e-3, atol=1e-3)


def test_skinny_partials_refuse_a_k_the_slices_do_not_divide() -> None:
    x = torch.randn(2, 384).to(DEVICE, torch.float16)
    w = torch.randn(8, 384).to(DEVICE, torch.float16)
    with pytest.raises(ValueError, match="multiple of 2 x 128"):
        skinny_partials(x, w, 2)


@pytest.mark.parametrize(("m", "n", "k", "splits"), [(1, 40, 512, 2), (17, 100, 1536, 3), (64, 33, 1024, 2)])
@pytest.mark.parametrize("form", ["w8a16", "w8a8", "grouped"])
def test_fp8_partials_sum_to_the_product(m: int, n: int, k: int, splits: int, form: str) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if form == "grouped":
        scale = torch.rand(n, k // 128, generator=gen) / 100 + 1e-3
        codes = fp8.to_codes(w, scale)
    else:
        codes, scale = fp8.quantize_rows(w)
    codes, scale = codes.to(DEVICE), scale.to(DEVICE)
    x_codes = quantize_rows(x) if form == "w8a8" else None
    parts = fp8_partials(x, codes, scale, splits, x_codes=x_codes)
    assert parts.shape == (splits, m, n) and parts.dtype == torch.float32
    xs = x.float() if x_codes is None else x_codes[0].float() * x_codes[1]
    want = xs.double() @ fp8.dequantize(codes, scale).double().T
    torch.testing.assert_close(parts.sum(0).double(), want, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="multiple of"):
        fp8_partials(x, codes, scale, 7)
