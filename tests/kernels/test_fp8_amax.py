"""The FP8 down product's codes made on load (``X_AMAX``) from the fused gate-up's amax partials
(``AMAX_OUT``): the partials' max is the quantize kernel's row amax of the gate-up's output as
rounded, and the product over them equals, bit for bit, the product over ``quantize_rows``' codes
(the same amax, the same ``e4m3`` rule, so the same codes), plain and in K slices; through
``fp8.gated`` then ``fp8.linear`` / ``fp8.partials``, the switch (``fused.down_codes_on_load``)
changes no bit. On a CPU the Triton interpreter runs fp16 (its bf16 dot is wrong)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.model import fp8, fused
from prefixserve.model.kernels import fp8_matmul
from prefixserve.model.kernels.fp8_matmul import fp8_gated, fp8_linear, fp8_partials, quantize_rows

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
ROWS = [1, 3, 16, 40, 64]


def _weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = fp8.quantize_rows(torch.randn(n, k, generator=gen) / k**0.5)
    return codes.to(DEVICE), scale.to(DEVICE)


def _x(m: int, k: int, dtype: torch.dtype, gen: torch.Generator, top: float = 2) -> torch.Tensor:
    """Rows of magnitudes 1e-2 to 10^top, the first all zeros (scale ``MIN_SCALE``, codes 0)."""
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, top, m)[:, None]
    x[0] = 0
    return x.to(DEVICE, dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
def test_gated_amax_partials_are_the_quantize_kernels_amax(dtype, m: int) -> None:
    """n = 200: not a multiple of the gated tile's 64 columns (the last tile masked)."""
    gen = torch.Generator().manual_seed(m)
    n, k = 200, 256
    x = _x(m, k, dtype, gen, top=1)  # the act within fp16's range
    codes, scale = _weight(2 * n, k, gen)
    x_codes = quantize_rows(x)
    amax = fp8_matmul.amax_partials(m, n, DEVICE)
    act = fp8_gated(x, codes, scale, x_codes, amax=amax)
    _same(act, fp8_gated(x, codes, scale, x_codes))  # the output unchanged
    assert amax.shape == (4, m)
    row_amax = amax.max(0).values
    assert torch.equal(row_amax, act.float().abs().amax(1)) and row_amax[0] == 0
    scales = quantize_rows(act)[1]  # the quantize kernel's rule over the same amax
    assert torch.equal(scales[:, 0], torch.clamp(row_amax / fp8.FP8_MAX, min=fp8.MIN_SCALE))


def _partials_of(x: torch.Tensor, parts: int) -> torch.Tensor:
    """fp32 [parts, M]: each column slice's max |x| per row (as the gated kernel writes them)."""
    m, k = x.shape
    return x.float().abs().view(m, parts, k // parts).amax(2).T.contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
def test_x_amax_product_equals_the_x_codes_product(dtype, m: int) -> None:
    """Plain and split (2 slices) products: N = 40 (not a multiple of BLOCK_N), K a multiple of
    2 x the stage's 256 columns; K / 8 partials (past one BLOCK_P at 40-64 rows) or 4."""
    gen = torch.Generator().manual_seed(100 + m)
    n, k = 40, 1024 if m >= 40 else 512
    x = _x(m, k, dtype, gen)
    codes, scale = _weight(n, k, gen)
    x_codes = quantize_rows(x)
    for parts in (4, k // 8):
        amax = _partials_of(x, parts)
        _same(fp8_linear(x, codes, scale, x_amax=amax), fp8_linear(x, codes, scale, x_codes=x_codes))
        got = fp8_partials(x, codes, scale, 2, x_amax=amax)
        _same(got, fp8_partials(x, codes, scale, 2, x_codes=x_codes))
    assert (fp8_linear(x, codes, scale, x_amax=amax)[0] == 0).all()


def test_amax_launches_refuse_what_they_cannot_take() -> None:
    gen = torch.Generator().manual_seed(0)
    x = _x(2, 256, torch.float16, gen)
    codes, scale = _weight(64, 256, gen)
    amax = _partials_of(x, 2)
    with pytest.raises(ValueError, match="no x codes"):
        fp8_linear(x, codes, scale, x_codes=quantize_rows(x), x_amax=amax)
    with pytest.raises(ValueError, match="per-channel"):
        fp8_linear(x, codes, scale.repeat(1, 2), x_amax=amax)
    with pytest.raises(ValueError, match=r"fp32 \[P, 2\]"):
        fp8_linear(x, codes, scale, x_amax=amax[:, :1])
    with pytest.raises(ValueError, match="amax_out"):
        fp8_gated(x, codes, scale, amax=torch.empty(2, 2, device=DEVICE))
    with pytest.raises(ValueError, match="read by a plain one"):
        fp8_matmul.launch(x, codes, scale, gated=True, x_amax=amax)


def _layer(n: int, k: int, gen: torch.Generator) -> SimpleNamespace:
    codes, scale = _weight(n, k, gen)
    return SimpleNamespace(weight=codes, weight_scale=scale, bias=None, act_quant="dynamic", input_scale=None)


@pytest.mark.parametrize("m", [1, 40])
def test_the_switch_changes_no_bit_of_the_chain(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fp8.gated(quantize=True)`` then the down product (``fp8.linear``, ``fp8.partials``): with
    the switch on the act carries amax partials, off the quantize kernel's codes; the same bits.
    A CPU tensor takes the GPU paths here only by the two stand-ins (else ``reference``)."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(fused, "_use_triton", lambda x: True)
        monkeypatch.setattr(fp8, "_fp8_device", lambda x: True)
    gen = torch.Generator().manual_seed(m)
    hidden, inter = 128, 512
    gate_up, down = _layer(2 * inter, hidden, gen), _layer(72, inter, gen)
    x = _x(m, hidden, torch.float16, gen, top=1)  # its zero row makes a zero row of the act
    bound, flags = fp8_matmul._fp8, []
    monkeypatch.setattr(fp8_matmul, "_fp8", lambda *a, **kw: flags.append(kw) or bound(*a, **kw))
    outs = {}
    for on in (False, True):
        flags.clear()
        with fused.down_codes_on_load(on):
            act = fp8.gated(gate_up, x, quantize=True)
        assert (fp8.amax_of(act) is not None) == on and (fp8.rows_of(act) is None) == on
        outs[on] = act, fp8.linear(down, act), fp8.partials(down, act, 2)
        # the gate-up, the down product whole and in slices: each took the path the switch says
        assert [(kw["AMAX_OUT"], kw["X_AMAX"], kw["X_CODES"]) for kw in flags] == [
            (on, False, True),
            (False, on, not on),
            (False, on, not on),
        ]
    for a, b in zip(outs[False], outs[True], strict=True):
        _same(a, b)
    monkeypatch.undo()
    if DEVICE.type == "cpu":  # the CPU's own path: the attached partials ignored, nothing changes
        plain = outs[True][0].clone()
        _same(fp8.linear(down, outs[True][0]), fp8.linear(down, plain))
