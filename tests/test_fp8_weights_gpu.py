"""FP8 weights on a GPU (sm_89+): the cuBLASLt W8A8 path (``torch._scaled_mm``) and the W8A16 Triton
kernel against the dequantize-and-matmul reference, eager and replayed from a CUDA graph; each
published checkpoint format (tiny checkpoints written from the formats' definitions,
``tests/fp8_checkpoints.py``) loads and generates the greedy tokens of its dequantized bf16 model;
a dummy model with ``quantization="fp8"`` runs under CUDA graphs. Skipped without CUDA.

Tolerances: both sides multiply the same codes and scales (and, on the W8A8 path, the same
per-token activation codes: ``fp8.quantize_tokens`` feeds both), so they differ by bf16's output
rounding (2^-8 relative) and the summation order: 2e-2 of the output's largest value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.model import fp8, linear
from prefixserve.model.linear import MergedLinear
from tests import fp8_checkpoints as ckpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 (sm_89+)",
    ),
]

SHAPES = [(4096, 6144), (14336, 4096), (4096, 4096)]  # (K, N): Llama-3.1-8B's qkv, down, o


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    scale = float(ref.abs().max()) + 1e-6
    err = float((out.float() - ref.float()).abs().max())
    assert bool(torch.isfinite(out).all()) and err <= 2e-2 * scale, (err, scale)


def _layer(k: int, n: int, grouped: bool = False, act: str = "dynamic", seed: int = 0) -> MergedLinear:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    layer = MergedLinear(k, [("a", (0, n), n)], bias=False).cuda().to(torch.bfloat16)
    if grouped:
        scale = (w.abs().view(n, -1, 128).amax(-1) / fp8.FP8_MAX).clamp(min=1e-12)
        codes = fp8.to_codes(w, scale)
    else:
        codes, scale = fp8.quantize_rows(w)
    static = (torch.tensor([8.0 / fp8.FP8_MAX], device="cuda")) if act == "static" else None
    fp8.install(layer, codes, scale, act, static)
    return layer


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64, 65, 512, 8192])
def test_each_path_equals_the_reference(k: int, n: int, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """x per token at every M: up to 64 rows the Triton kernel on its codes, past them cuBLASLt."""
    layer = _layer(k, n, seed=m)
    calls = []
    real = fp8.scaled_mm
    monkeypatch.setattr(fp8, "scaled_mm", lambda *a: calls.append(1) or real(*a))
    x = _x(m, k)
    with torch.no_grad():
        out = layer(x)
    assert bool(calls) == (m > fp8.MAX_ROWS)
    _close(out, fp8.reference(x, layer.weight, layer.weight_scale, None, "dynamic"))


@pytest.mark.parametrize("m", [1, 64, 300])
def test_block_scaled_and_static_layers(m: int) -> None:
    """Block scales: the Triton kernel (W8A16) at every M; a static input scale: W8A8 at every M."""
    grouped = _layer(4096, 2048, grouped=True)
    x = _x(m, 4096)
    with torch.no_grad():
        _close(grouped(x), fp8.reference(x, grouped.weight, grouped.weight_scale))
        static = _layer(4096, 2048, act="static")
        want = fp8.reference(x, static.weight, static.weight_scale, None, "static", static.input_scale)
        _close(static(x), want)


@pytest.mark.parametrize("m", [4, 128])
def test_replayed_from_a_cuda_graph(m: int) -> None:
    layer = _layer(4096, 6144)
    x = _x(m, 4096)
    with torch.no_grad():
        for _ in range(2):  # compile and warm outside the capture
            layer(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        x.copy_(_x(m, 4096))
        graph.replay()
        eager = layer(x)
    _close(out, eager)


def _greedy(model: str, device: str = "cuda", prompt_len: int = 5, **kw) -> list[list[int]]:
    prompts = [
        {"prompt_token_ids": [3 + i, 17, 41 + 2 * i, 9, 100 + i] * (prompt_len // 5)} for i in range(4)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(
        model=model, device=device, num_kv_blocks=128, max_num_batched_tokens=256, progress=False, **kw
    ) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("fmt", ckpt.FORMATS)
def test_published_formats_generate_the_dequantized_models_tokens(fmt: str, tmp_path: Path) -> None:
    """Each format loads as FP8 (no flag) and its greedy tokens, in fp32, equal its reference's: for a
    weight-only format, its dequantized model's (the dequantized weights' products); for a format that
    quantizes each product's input too (per token or by the checkpoint's scale: W8A8 on the GPU), the
    same checkpoint on the CPU, whose reference product quantizes the input as the format says. In bf16
    the kernels' rounding and cuBLAS's differ enough to flip a near tie of this random tiny model after
    about 11 tokens (H200); the kernels are held to the reference product in ``test_fp8_matmul``."""
    quant, dense = ckpt.write(tmp_path, fmt)
    with LLM(model=str(quant), device="cuda", num_kv_blocks=64, progress=False) as llm:
        layers = linear.quantized_layers(llm.engine.runner.model)
        assert layers and all(fp8.is_fp8(layer) for _, layer in layers)
        w8a8 = any(not fp8.weight_only(layer) for _, layer in layers)
    if not w8a8:
        assert _greedy(str(quant), dtype="float32") == _greedy(str(dense), dtype="float32")
        return
    # FP8 tensor cores accumulate with fewer mantissa bits than fp32: near ties of this random model
    # may flip later tokens, so the first step is held to the CPU's within FP8's accumulation error
    got, want = _first_step(str(quant), "cuda"), _first_step(str(quant), "cpu")
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g[1] - w[1]) < 2e-2, (g, w)


def _first_step(model: str, device: str) -> list[tuple[int, float]]:
    """Each prompt's first greedy token and its logprob, in fp32."""
    prompts = [{"prompt_token_ids": [3 + i, 17, 41 + 2 * i, 9, 100 + i]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    with LLM(model=model, device=device, dtype="float32", num_kv_blocks=64, progress=False) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(c.token_ids[0], c.token_logprobs[0]) for c in outs]


def test_dummy_model_with_the_flag_under_cuda_graphs(tiny_config_path: Path) -> None:
    """quantization='fp8': the same tokens replayed from CUDA graphs as eager."""
    model = f"dummy:{tiny_config_path}"
    graphs = _greedy(model, quantization="fp8")
    assert graphs == _greedy(model, quantization="fp8", enforce_eager=True)


def test_codes_made_by_the_norms_change_no_token(
    tiny_config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RMSNorm and SiLU-and-mul hand the FP8 products their inputs' codes (``fp8.attach_rows``): the
    same codes the products made themselves, so the same greedy tokens as with every product
    quantizing its own input, prefill (cuBLASLt) and decode (the Triton kernel, under graphs)."""
    model = f"dummy:{tiny_config_path}"
    found, rows_of = [], fp8.rows_of
    monkeypatch.setattr(fp8, "rows_of", lambda x: found.append(rows_of(x) is not None) or rows_of(x))
    handed = _greedy(model, prompt_len=40, quantization="fp8")  # a prefill of 160 rows: cuBLASLt
    assert any(found) and not all(found)  # codes handed to q/k/v, gate-up and down; o quantizes its own
    monkeypatch.setattr(fp8, "takes_rows", lambda layer: False)
    assert handed == _greedy(model, prompt_len=40, quantization="fp8")


@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_fused_gate_up_equals_the_product_then_silu_and_mul(m: int) -> None:
    """The FP8 gate-up product with SiLU-and-mul in its epilogue (``fp8.gated``, Llama-3.1-8B's
    shape) against the product then the SiLU-and-mul kernel: the same codes in, rounded alike; the
    codes it hands the down product equal the quantize kernel's of its output."""
    from prefixserve.model import fused
    from prefixserve.model.kernels import fp8_matmul

    layer = _layer(4096, 2 * 14336)
    x = _x(m, 4096)
    got = fp8.gated(layer, x, quantize=True)
    assert got is not None and got.shape == (m, 14336)
    with fused.gate_up_kernels(False):
        assert fp8.gated(layer, x) is None
    want = fused.silu_and_mul(fp8.linear(layer, x))
    _close(got, want)
    codes, scales = fp8.rows_of(got)
    want_codes, want_scales = fp8_matmul.quantize_rows(got)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)


@pytest.mark.parametrize("m", [96, 128])
@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (14336, 4096), (4096, 6144)])
def test_mid_row_partials_sum_to_the_product(k: int, n: int, m: int) -> None:
    """Past 64 rows up to ``MID_ROWS`` the 8B's o, down and qkv products come as the Triton kernel's
    split-K partials (``decode_split``), whose sum is cuBLASLt's product of the same codes; with the
    switch off, the product whole."""
    from prefixserve.model import decode_split, fused

    layer, x = _layer(k, n, seed=m + k), _x(m, k)
    want = fp8.linear(layer, x)
    parts = decode_split.fp8_qkv(x, layer) if n == 6144 else decode_split.partials(x, layer)
    assert parts.dim() == 3 and parts.dtype == torch.float32
    _close(parts.sum(0), want)
    with fused.fp8_mid_products(False):
        assert decode_split.fp8_qkv(x, layer).dim() == 2 and decode_split.partials(x, layer) is None


def test_fused_gate_up_changes_no_token(tiny_config_path: Path) -> None:
    """A dummy model with ``quantization="fp8"``: the same greedy tokens with the gate-up's activation
    fused (decode steps under graphs) as with the product then SiLU-and-mul."""
    from prefixserve.model import fused

    model = f"dummy:{tiny_config_path}"
    fused_tokens = _greedy(model, quantization="fp8")
    with fused.gate_up_kernels(False):
        assert fused_tokens == _greedy(model, quantization="fp8")
