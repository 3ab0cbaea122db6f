"""The FP8 weight kernel (W8A16: e4m3 codes, fp32 scales per row or per row and 128-column group)
against the dequantize-and-matmul reference (``fp8.reference``).

Tiny sizes: on a CPU the Triton interpreter runs it in fp16 (its bf16 dot is wrong; the kernel path is
the same); with a GPU the same tests run compiled, in bf16 too. Both sides use the same codes and
scales, so the only difference is the output's rounding and the summation order: fp16's 2^-11
relative (bf16's 2^-8), checked at 2e-3 (2e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _kernel_helpers import DEVICE

from prefixserve.model import fp8
from prefixserve.model.kernels.fp8_matmul import LARGE_TILE, fp8_linear, supported, tiles

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _operands(m: int, n: int, k: int, grouped: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if grouped:  # a block-scaled checkpoint's scales as rows: [N, ceil(K/128)]
        scale = torch.rand(n, -(-k // 128), generator=gen) / 100 + 1e-3
        codes = fp8.to_codes(w, scale)
    else:
        codes, scale = fp8.quantize_rows(w)
    return x, codes.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, k",
    [(1, 40, 256), (5, 72, 200), (17, 100, 384), (64, 33, 128), (70, 130, 256)],  # the last: LARGE_TILE
)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_matches_reference(dtype, m, n, k, grouped, with_bias) -> None:
    """Masked rows, columns and K (200: not a multiple of 128), per-row and per-group scales, bias."""
    x, codes, scale = _operands(m, n, k, grouped, dtype, m * n + k)
    bias = torch.randn(n).to(DEVICE, dtype) if with_bias else None
    assert supported(x, codes, scale, bias)
    out = fp8_linear(x, codes, scale, bias)
    ref = fp8.reference(x.float(), codes, scale, None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_fp8_linear_into_a_buffer_view_and_tiles() -> None:
    """``out``: a [M, N] view with a row stride of its own (a peer buffer); the tile rule."""
    x, codes, scale = _operands(3, 48, 128, False, torch.float16, 0)
    buf = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    written = fp8_linear(x, codes, scale, out=buf[:, :48])
    torch.testing.assert_close(written.float(), fp8.reference(x.float(), codes, scale), rtol=2e-3, atol=2e-3)
    assert buf[:, 48:].abs().sum() == 0
    assert tiles(65, 4096) == LARGE_TILE and tiles(1, 4096)[0] == 16 and tiles(40, 1024)[0] == 64
    assert not supported(x.float(), codes, scale)  # 16-bit x only
    assert not supported(x, codes, scale[:, :0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), [(1, 64), (3, 1500), (70, 2048), (2, 17000)])  # the last: two passes
def test_quantize_rows_kernel_matches_torch(dtype, m: int, k: int) -> None:
    """The per-token activation quantization kernel gives ``fp8.quantize_tokens``' codes and scales
    (dynamic, and a static scale); a zero row gets zeros."""
    from prefixserve.model.kernels.fp8_matmul import quantize_rows

    x = (torch.randn(m, k) * torch.logspace(-3, 3, m)[:, None]).to(DEVICE, dtype)
    x[0] = 0
    static = torch.tensor([0.05], device=DEVICE)
    for s in (None, static):
        codes, scale = quantize_rows(x, s)
        want_codes, want_scale = fp8.quantize_tokens(x, s)
        torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
        got, want = codes.float(), want_codes.float()
        # equal but where the GPU's fp32 division rounds across a code boundary: one e4m3 step
        off = (got - want).abs() > 2.0**-3 * want.abs() + 2.0**-9
        if DEVICE.type == "cpu":  # the interpreter's cast to e4m3 drops the carry of a mantissa that
            off &= want.abs().log2() != want.abs().log2().round()  # rounds up to a power of two
        assert off.float().mean() < 1e-3 and (got[0] == 0).all()


@pytest.mark.parametrize("m, n, k", [(1, 40, 256), (17, 100, 384), (64, 33, 200), (2, 40, 8200)])  # LONG_K
def test_fp8_codes_of_x_match_the_w8a8_reference(m: int, n: int, k: int) -> None:
    """``x_codes`` (W8A8: x's e4m3 codes and row scales from ``quantize_rows``, FP8 tensor-core
    products) against the dequantize-both reference: the same codes on both sides, so only the
    summation order and the output's rounding differ."""
    from prefixserve.model.kernels.fp8_matmul import quantize_rows

    x, codes, scale = _operands(m, n, k, False, torch.float16, m + n + k)
    xq, sx = quantize_rows(x)
    out = fp8_linear(x, codes, scale, x_codes=(xq, sx))
    ref = (xq.float() * sx) @ fp8.dequantize(codes, scale).T
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="per-channel"):
        fp8_linear(x, codes, scale.repeat(1, 2), x_codes=(xq, sx))


# 64 rows over four 256-column steps of K, the last masked (a gated launch takes GATED_TILES' stages
# at any K, past LONG_K too); 96 rows: past the decode tiles, on MID_GATED_TILE
@pytest.mark.parametrize(
    "m, n, k", [(1, 40, 256), (5, 33, 200), (17, 64, 384), (64, 48, 1000), (96, 72, 640)]
)
@pytest.mark.parametrize("gelu", [False, True])
def test_fp8_gated_matches_the_unfused_pair(m: int, n: int, k: int, gelu: bool) -> None:
    """The fused gate-up form (``fp8_gated``: [2n, K] codes, the activation in the epilogue) against
    the unfused pair (``fp8_linear``, then the activation and the multiply rounded as the SiLU-and-mul
    kernel rounds them), and against the fp32 product of the same codes (FP8 tensor cores sum with
    fewer bits than fp32: 1e-2 of the largest value); masked rows, columns and K; W8A16 (no x codes)
    too."""
    from prefixserve.model.kernels.fp8_matmul import fp8_gated, quantize_rows

    x, codes, scale = _operands(m, 2 * n, k, False, torch.float16, 7 * m + n + k)
    xq, sx = quantize_rows(x)

    def activation(product: torch.Tensor) -> torch.Tensor:  # [M, 2n] in x's dtype -> fp32 [M, n]
        gate = product[:, :n].float()
        act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        return act.to(x.dtype).float() * product[:, n:].float()

    for x_codes, xf in (((xq, sx), xq.float() * sx), (None, x.float())):
        out = fp8_gated(x, codes, scale, x_codes, gelu=gelu)
        assert out.shape == (m, n) and out.dtype == x.dtype
        pair = activation(fp8_linear(x, codes, scale, x_codes=x_codes))
        torch.testing.assert_close(out.float(), pair, rtol=4e-3, atol=4e-3)
        ref = activation((xf @ fp8.dequantize(codes, scale).T).to(x.dtype))
        assert float((out.float() - ref).abs().max()) <= 1e-2 * float(ref.abs().max())
    with pytest.raises(ValueError, match="per-channel"):
        fp8_gated(x, codes, scale.repeat(1, 2), (xq, sx))
    with pytest.raises(ValueError, match="even row count"):
        fp8_gated(x, codes[1:], scale[1:], (xq, sx))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_pdl_chain_in_a_graph_equals_the_chain_without(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graphed chain of the kernels launched as dependents (norm with codes, W8A8 products,
    SiLU-and-mul with codes, the quantize kernel, the bf16 skinny product) gives the same bits with
    programmatic dependent launch on and off: each kernel's wait orders it after the one before."""
    from prefixserve.model.kernels import fp8_matmul, rms_norm, silu_mul, skinny_matmul
    from prefixserve.triton_support import pdl

    gen = torch.Generator().manual_seed(m)
    hidden, inter = 256, 512
    w_up = fp8.quantize_rows(torch.randn(2 * inter, hidden, generator=gen).to(DEVICE, torch.bfloat16))
    w_down = fp8.quantize_rows(torch.randn(hidden, inter, generator=gen).to(DEVICE, torch.bfloat16))
    w_o = (torch.randn(hidden, hidden, generator=gen) / 16).to(DEVICE, torch.bfloat16)
    norm = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(m, hidden, generator=gen).to(DEVICE, torch.bfloat16)

    def chain(t: torch.Tensor) -> torch.Tensor:
        resid = torch.zeros_like(t)
        for _ in range(3):
            h, resid, codes, scales = rms_norm.add_rms_norm(t, norm, 1e-5, resid, quantize=True)
            act, codes, scales = silu_mul.silu_and_mul_quantize(
                fp8_matmul.launch(h, *w_up, None, None, (codes, scales))
            )
            y = fp8_matmul.launch(act, *w_down, None, None, (codes, scales))
            t = skinny_matmul.skinny_linear(y, w_o)
            t = fp8_matmul.launch(t, *w_up, None, None, fp8_matmul.quantize_rows(t))[:, :hidden]
        return t + resid

    outs, graphs = {}, {}
    for flag in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", flag)
        chain(x)  # compiles outside the capture
        graphs[flag] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[flag]):
            outs[flag] = chain(x)
    for _ in range(4):  # new inputs each round: a read before a wait would show as a difference
        x.copy_(torch.randn(m, hidden, generator=gen).to(DEVICE, torch.bfloat16))
        for flag in (False, True):
            graphs[flag].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[False], outs[True])
    # the bound launches relaunched inside the captures kept the launch attribute
    chained = [launch for launch in fp8_matmul._fp8.launches.values() if launch.options.get("launch_pdl")]
    assert chained and all(launch.compiled.metadata.launch_pdl for launch in chained)
