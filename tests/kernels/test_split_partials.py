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


@pytest.mark.parametrize(  # 96 rows: past the decode tiles, W8A8 on ``MID_TILE``
    ("m", "n", "k", "splits"), [(1, 40, 512, 2), (17, 100, 1536, 3), (64, 33, 1024, 2), (96, 136, 1024, 2)]
)
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
    xs = (x.float() if x_codes is None else x_codes[0].float() * x_codes[1]).double()
    wd = fp8.dequantize(codes, scale).double()
    width = k // splits
    for s in range(splits):  # each plane its own slice: a kernel summing all K in one would fail here
        cols = slice(s * width, (s + 1) * width)
        torch.testing.assert_close(parts[s].double(), xs[:, cols] @ wd[:, cols].T, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(parts.sum(0).double(), xs @ wd.T, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="multiple of"):
        fp8_partials(x, codes, scale, 7)


class _Recorder:
    """Stands in for a module's bound kernel: keeps each call's (grid, args, kw), then launches."""

    def __init__(self, bound) -> None:
        self.bound, self.calls = bound, []

    def __call__(self, grid, *args, **kw) -> None:
        self.calls.append((grid, args, kw))
        self.bound(grid, *args, **kw)


def test_every_launch_of_the_products_keeps_the_fast_relaunch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch.record`` keeps a launch for the fast path only when every argument past the
    positional ones comes by keyword: the split arguments must be passed on unsplit launches too,
    or every eager product of a few rows pays Triton's whole launch."""
    from types import SimpleNamespace

    from prefixserve.model.kernels import fp8_matmul, skinny_matmul
    from prefixserve.triton_support.launch import record

    skinny, fp8_bound = _Recorder(skinny_matmul._skinny), _Recorder(fp8_matmul._fp8)
    monkeypatch.setattr(skinny_matmul, "_skinny", skinny)
    monkeypatch.setattr(fp8_matmul, "_fp8", fp8_bound)
    x = torch.randn(2, 512).to(DEVICE, torch.float16)
    w = torch.randn(8, 512).to(DEVICE, torch.float16)
    skinny_matmul.skinny_linear(x, w)
    skinny_matmul.skinny_partials(x, w, 2)
    codes, scale = (t.to(DEVICE) for t in fp8.quantize_rows(torch.randn(8, 512)))
    fp8_matmul.fp8_linear(x, codes, scale)
    fp8_partials(x, codes, scale, 2, x_codes=quantize_rows(x))
    fake = SimpleNamespace(run=None, packed_metadata=None)
    for recorder, kernel in ((skinny, skinny_matmul._skinny_kernel), (fp8_bound, fp8_matmul._fp8_kernel)):
        assert len(recorder.calls) == 2
        for grid, args, kw in recorder.calls:
            assert record(kernel, grid, args, kw, fake).compiled is fake, kw


def test_split_launches_refuse_a_bias_and_a_wrong_out() -> None:
    from prefixserve.model.kernels import fp8_matmul, skinny_matmul

    x = torch.randn(2, 512).to(DEVICE, torch.float16)
    w = torch.randn(8, 512).to(DEVICE, torch.float16)
    parts = torch.empty(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="no bias"):
        skinny_matmul._launch(x, w, torch.zeros(8).to(DEVICE, torch.float16), (32, 2), out=parts, splits=2)
    with pytest.raises(ValueError, match="contiguous fp32 out"):
        skinny_matmul._launch(x, w, None, (32, 2), out=None, splits=2)
    codes, scale = (t.to(DEVICE) for t in fp8.quantize_rows(torch.randn(8, 512)))
    with pytest.raises(ValueError, match="contiguous fp32 out"):
        fp8_matmul.launch(x, codes, scale, None, parts[:1], splits=2)
    with pytest.raises(ValueError, match="per-channel"):
        fp8_partials(x, codes, scale.repeat(1, 4), 2, x_codes=quantize_rows(x))


def test_the_decode_rule_takes_the_products_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode_split.partials`` at small stand-ins for its thresholds (the interpreter's sizes): a
    narrow bf16 product and an FP8 one at a few rows come back as 2 planes summing to the product;
    wider, shorter-K, biased, many-row FP8 and too-many-row products come back None (one product)."""
    from types import SimpleNamespace

    from prefixserve.model import decode_split, fused
    from prefixserve.model.kernels import skinny_matmul

    monkeypatch.setattr(fused, "split_k_taken", lambda x: True)  # CUDA-only switches: the rule alone
    monkeypatch.setattr(skinny_matmul, "hopper", lambda device: True)
    monkeypatch.setattr(decode_split, "MIN_K", 512)
    monkeypatch.setattr(decode_split, "MAX_N", 64)
    monkeypatch.setattr(decode_split, "FP8_ROWS", 4)
    monkeypatch.setattr(decode_split, "FP8_MAX_SIDE", 512)

    def dense(n: int, k: int, bias: bool = False) -> SimpleNamespace:
        w = (torch.randn(n, k) / k**0.5).to(DEVICE, torch.float16)
        return SimpleNamespace(weight=w, bias=torch.zeros(n).to(DEVICE, torch.float16) if bias else None)

    def quantized(n: int, k: int) -> SimpleNamespace:
        codes, scale = fp8.quantize_rows(torch.randn(n, k) / k**0.5)
        return SimpleNamespace(
            weight=codes.to(DEVICE),
            weight_scale=scale.to(DEVICE),
            bias=None,
            act_quant="dynamic",
            input_scale=None,
        )

    def x(rows: int, k: int) -> torch.Tensor:
        return torch.randn(rows, k).to(DEVICE, torch.float16)

    layer = dense(64, 512)
    inp = x(3, 512)
    parts = decode_split.partials(inp, layer)
    assert parts.shape == (2, 3, 64)
    torch.testing.assert_close(
        parts.sum(0).double(), inp.double() @ layer.weight.double().T, rtol=1e-3, atol=1e-3
    )
    assert decode_split.partials(x(3, 512), dense(96, 512)) is None  # wider than MAX_N
    assert decode_split.partials(x(3, 256), dense(64, 256)) is None  # K under MIN_K
    assert decode_split.partials(x(3, 512), dense(64, 512, bias=True)) is None
    assert decode_split.partials(x(65, 512), dense(64, 512)) is None  # past the decode kernels' rows
    assert decode_split.partials(x(3, 512), quantized(128, 512)).shape == (2, 3, 128)  # FP8, a few rows
    assert decode_split.partials(x(8, 512), quantized(128, 512)).shape == (2, 8, 128)  # both sides small
    assert decode_split.partials(x(8, 1024), quantized(128, 1024)) is None  # more rows, K too long
    # past the decode kernels' 64 rows up to MID_ROWS: FP8 W8A8 in MID_SPLITS planes, unless switched off
    from prefixserve.model.kernels import fp8_matmul

    monkeypatch.setattr(fp8_matmul, "MID_ROWS", 80)
    inp, layer = x(72, 1024), quantized(128, 1024)
    parts = decode_split.partials(inp, layer)
    assert parts.shape == (decode_split.MID_SPLITS, 72, 128)
    codes, scales = quantize_rows(inp)  # the kernel's codes (the interpreter's e4m3 cast is not torch's)
    want = (codes.double() * scales.double()) @ fp8.dequantize(layer.weight, layer.weight_scale).double().T
    torch.testing.assert_close(parts.sum(0).double(), want, rtol=2e-3, atol=2e-3)
    assert decode_split.partials(x(81, 1024), quantized(128, 1024)) is None  # past MID_ROWS: cuBLASLt
    assert decode_split.partials(x(72, 1024), dense(64, 1024)) is None  # bf16 past 64 rows: not here
    with fused.fp8_mid_products(False):
        assert decode_split.partials(inp, layer) is None
