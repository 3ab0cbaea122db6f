"""FP8 (e4m3) weights of the dense linear layers: how they are held, made, and multiplied.

A quantized layer keeps its ``weight`` as float8_e4m3fn codes [N, K] and ``weight_scale`` fp32 [N, G]:
G = 1 is one scale per output channel (``quantization="fp8"``, a compressed-tensors checkpoint's
channel or tensor scale, the latter repeated down the rows), G = ceil(K / 128) one per row and
128-column group (a block-scaled 128x128 checkpoint's scales repeated down each block's rows). Rows
own their scales, so stacking q/k/v or gate/up (``MergedLinear``) and cutting tensor-parallel shards
keep them exact. The weight is ``codes * scale``.

The product, by rows M of x (``linear``):

- Per-channel scales, x quantized per token (amax / 448; a checkpoint's static ``input_scale`` where
  it has one), on sm_89+: W8A8. Past ``MAX_ROWS`` rows through cuBLASLt (``torch._scaled_mm``, the
  scales in the GEMM's epilogue: the tensor cores' FP8 rate, twice bf16's: prefill), except up to
  ``fp8_matmul.MID_ROWS`` (a batched decode step) the products ``decode_split`` cuts into K slices
  and the gated gate-up (``gated``), on the Triton kernel's ``MID_TILE``; up to it (a
  decode step) the Triton kernel on x's codes (``kernels/fp8_matmul.py``: e4m3 wgmma products at
  33-64 rows; at 1-32 Triton 3.6 widens both tiles to fp16 for the older mma), which beat both the
  weight-only form and cuBLASLt there
  (``benchmarks/probes/fp8_gemm.py``, docs/kernels.md §10).
- Block-scaled weights at every M, and weight-only checkpoints: W8A16 in the same kernel, x
  unquantized, the codes converted to x's dtype after they are loaded.
- CPU, or a GPU without FP8 (before sm_89): ``reference``, dequantize then matmul in fp32, with the
  activation quantization the GPU would apply at that M (so CPU tests see the GPU's numerics).

An input quantized per token may arrive with its codes already made: the RMSNorm or SiLU-and-mul
kernel before the product emits them beside its 16-bit output (``takes_rows`` says when the model
asks), one pass over the row fewer (``rows_of``).

The LM head, the embedding, routers and MoE experts stay in the model's dtype
(``linear.quantize_model``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.fp8_rows import ROWS_ATTR, attach_rows, rows_of

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
GROUP = 128  # a block-scaled checkpoint's block edge (``weight_block_size`` [128, 128])
MAX_ROWS = 64  # rows up to which the Triton kernel runs (a decode step), as the skinny kernel's
MIN_SCALE = 1e-12  # an all-zero row's scale: its codes are zeros whatever it is
ACT_MODES = ("dynamic", "static", "none")  # per-token scales; a checkpoint's one scale; weight-only


SCALE_STEPS = 16  # candidate scales a row tries, over one octave above amax / 448
SEARCH_ROWS_CPU = 256  # rows whose candidates a CPU tries at once (``quantize_rows``)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] and per-output-channel scales [N, 1] fp32 of ``w``.

    Each row takes, of the scales ``amax / 448 * 2^(i/16)``, i < 16, the one whose codes are nearest
    w in squared error: e4m3's error is relative (<= 2^-4 of each value, none clipped: amax maps at
    or below 448), but where a row's values fall between the grid's points depends on the scale.
    On the default model this cut the weights' squared error 13% and the logits' mean KL to the
    unquantized model 0.021 -> 0.014 against amax / 448 alone (tests/test_fp8_weights.py)."""
    wf = w.float()
    base = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    if w.is_meta:  # shapes only (the size check before allocation)
        return to_codes(wf, base), base
    steps = 2.0 ** (torch.arange(SCALE_STEPS, device=w.device) / SCALE_STEPS)
    # on a CPU a few hundred rows at a time, so the candidates' temporaries stay in cache (the
    # default model's load: 1.5x faster); on a GPU the whole matrix, one launch per operation
    chunk = SEARCH_ROWS_CPU if wf.device.type == "cpu" else wf.shape[0]
    errors = torch.cat(
        [_scale_errors(wf[r : r + chunk], base[r : r + chunk], steps) for r in range(0, wf.shape[0], chunk)],
        dim=1,
    )  # [steps, N]
    scale = base * steps[errors.argmin(0)].view(-1, 1)
    return to_codes(wf, scale), scale


def _scale_errors(wf: torch.Tensor, base: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[steps, rows]: each candidate scale's squared error of the rows' e4m3 codes."""
    errors = torch.empty(steps.numel(), wf.shape[0], device=wf.device)
    for i, a in enumerate(steps):
        scale = base * a
        rounded = (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).float()
        errors[i] = rounded.mul_(scale).sub_(wf).square_().sum(1)
    return errors


def to_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w / scale`` rounded to e4m3 (round to nearest even; clamped: e4m3fn has no infinity)."""
    return (w.float() / expand_scale(scale, w.shape[1])).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def expand_scale(scale: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G] scales as [N, 1] (G = 1) or [N, K] (each 128-column group's scale repeated)."""
    if scale.shape[1] == 1:
        return scale
    return scale.repeat_interleave(GROUP, dim=1)[:, :k]


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight the codes stand for, fp32 [N, K]."""
    return codes.float() * expand_scale(scale.float(), codes.shape[1])


def quantize_tokens(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 codes and fp32 scales [M, 1]: per token (amax / 448), or the one ``static``
    scale of a checkpoint's activations repeated. Torch ops (graph-safe): at the rows that take this
    path the GEMM dwarfs them."""
    xf = x.float()
    if static is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = static.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def takes_rows(layer: nn.Module) -> bool:
    """Whether ``layer``'s products quantize their input per token with amax / 448 (W8A8 over
    per-channel weight scales): then its producer may hand it the codes (``attach_rows``)."""
    return is_fp8(layer) and layer.act_quant == "dynamic" and layer.weight_scale.shape[1] == 1


def is_fp8(layer: nn.Module) -> bool:
    """Whether a linear layer holds FP8 codes (``install`` made it so)."""
    w = getattr(layer, "weight", None)
    return isinstance(w, torch.Tensor) and w.dtype == FP8


def install(
    layer: nn.Module,
    codes: torch.Tensor,
    scale: torch.Tensor,
    act: str = "dynamic",
    input_scale: torch.Tensor | None = None,
) -> None:
    """Make ``layer`` (an ``nn.Linear``) hold ``codes`` [N, K] e4m3 and ``scale`` [N, G] fp32 in place
    of its weight; ``act``: how its input is quantized where the GPU runs W8A8 (``ACT_MODES``)."""
    if act not in ACT_MODES:
        raise ValueError(f"activation mode {act!r} is not one of {ACT_MODES}")
    if act == "static" and input_scale is None:
        raise ValueError("static activation quantization needs the checkpoint's input_scale")
    out_features, in_features = layer.weight.shape
    groups = -(-in_features // GROUP)
    if tuple(codes.shape) != (out_features, in_features) or scale.shape[0] != out_features:
        raise ValueError(f"FP8 codes {tuple(codes.shape)} / scales {tuple(scale.shape)} do not fit the layer")
    if scale.dim() != 2 or scale.shape[1] not in (1, groups):
        raise ValueError(f"FP8 scales must be [N, 1] or [N, {groups}], got {tuple(scale.shape)}")
    layer.weight = nn.Parameter(codes.to(FP8).contiguous(), requires_grad=False)
    layer.register_buffer("weight_scale", scale.float().contiguous())
    layer.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
    layer.act_quant = act
    layer.__dict__.pop("_packed_weight", None)  # a oneDNN copy of the old weight (cpu_linear)


def quantize_layer(layer: nn.Module, act: str = "dynamic") -> None:
    """Quantize a layer's current weight per output channel (``quantization="fp8"``; ``act`` as
    ``install``'s); works on the meta device, so the model's size is checked at FP8 before any byte
    is allocated."""
    with torch.no_grad():
        codes, scale = quantize_rows(layer.weight)
    install(layer, codes, scale, act)


def refill(layer: nn.Module, dense: torch.Tensor) -> None:
    """Quantize ``dense`` [N, K] into an already-FP8 layer's codes and scales (dummy weights)."""
    with torch.no_grad():
        codes, scale = quantize_rows(dense)
        layer.weight.copy_(codes)
        layer.weight_scale.copy_(scale)


def linear(layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` of an FP8 layer (the module docstring says which path at which M); ``out``:
    a [M, N] tensor to write into (a peer all-reduce buffer)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    codes, scale, bias = layer.weight, layer.weight_scale, layer.bias
    act = None if weight_only(layer) else layer.act_quant
    y = None
    if x2.is_cuda and fp8_gpu(x2.device):
        from prefixserve.model.kernels import fp8_matmul

        static = layer.input_scale if act == "static" else None
        triton_ok = _triton_takes(x2) and fp8_matmul.supported(x2, codes, scale, bias)
        if act is not None and triton_ok and x2.shape[0] <= MAX_ROWS:  # W8A8 on the Triton kernel
            return fp8_matmul.launch(x2, codes, scale, bias, out, _x_codes(layer, x, x2)).view(*lead, -1)
        if act is not None and scaled_mm_takes(x2, codes):
            rows = rows_of(x) if act == "dynamic" else None  # made by the kernel before, amax / 448
            y = scaled_mm(x2, codes, scale, bias, static, rows)
        elif triton_ok:  # W8A16
            return fp8_matmul.launch(x2, codes, scale, bias, out).view(*lead, -1)
    if y is None:
        y = reference(x2, codes, scale, bias, act, layer.input_scale)
    if out is not None:
        return out.copy_(y)
    return y.view(*lead, -1)


def partials(layer: nn.Module, x: torch.Tensor, splits: int) -> torch.Tensor | None:
    """fp32 split-K partials [splits, M, N] of ``linear(layer, x)`` on its W8A8 Triton path (a decode
    step's rows, up to ``fp8_matmul.MID_ROWS`` where ``decode_split`` asks past ``MAX_ROWS``;
    per-channel weights, x quantized per token or by its static scale, no bias), for a kernel next
    that sums them (``decode_split.partials``); None where that path does not take it."""
    from prefixserve.model.kernels import fp8_matmul

    codes, scale = layer.weight, layer.weight_scale
    if weight_only(layer) or layer.bias is not None or x.dim() != 2:
        return None
    if not 0 < x.shape[0] <= fp8_matmul.MID_ROWS:
        return None
    if (x.is_cuda and not fp8_gpu(x.device)) or not fp8_matmul.supported(x, codes, scale):
        return None
    if x.shape[1] % (splits * fp8_matmul.block_k_for(x.shape[0], False)):
        return None
    return fp8_matmul.fp8_partials(x, codes, scale, splits, _x_codes(layer, x))


def gated(
    layer: nn.Module, x: torch.Tensor, gelu: bool = False, quantize: bool = False
) -> torch.Tensor | None:
    """``silu(gate) * up`` of a fused gate-up FP8 layer's product in one kernel (``fp8_matmul.fp8_gated``,
    its activation in the epilogue: the [M, 2I] product and the SiLU-and-mul kernel go) on the W8A8
    Triton path (a decode step's rows on a GPU, up to ``fp8_matmul.MID_ROWS`` with ``MID_GATED_TILE``;
    per-channel weights, x quantized per token, no bias);
    ``quantize``: its per-token codes attached for an FP8 product next (``attach_rows``). None where
    that path does not take it, or the fused gate-up kernels are switched off (``fused.gate_up_kernels``)."""
    from prefixserve.model import fused

    if not takes_rows(layer) or layer.bias is not None or not fused.gate_up_taken(x):
        return None
    from prefixserve.model.kernels import fp8_matmul

    codes, scale = layer.weight, layer.weight_scale
    rows = x.shape[0] if x.dim() == 2 else 0
    mid = fp8_matmul.mid_rows(rows) and fp8_matmul.MID_GATED_TILE is not None and fused.fp8_mid_taken()
    if not (0 < rows <= MAX_ROWS or mid) or not fp8_gpu(x.device):
        return None

    if not fp8_matmul.supported(x, codes, scale):  # (16-bit x: ``gate_up_taken`` said Triton)
        return None
    act = fp8_matmul.fp8_gated(x, codes, scale, _x_codes(layer, x), gelu)
    return attach_rows(act, *fp8_matmul.quantize_rows(act)) if quantize else act


def _x_codes(
    layer: nn.Module, x: torch.Tensor, flat: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x's e4m3 codes and row scales for a W8A8 product of ``layer``: those the kernel before made
    (``attach_rows``: per token, amax / 448), else the quantize kernel's over ``flat`` (x as [M, K],
    by default x itself), per token or by the layer's static input scale."""
    made = rows_of(x) if layer.act_quant == "dynamic" else None
    if made is not None:
        return made
    from prefixserve.model.kernels import fp8_matmul

    static = layer.input_scale if layer.act_quant == "static" else None
    return fp8_matmul.quantize_rows(x if flat is None else flat, static)


def weight_only(layer: nn.Module) -> bool:
    """Whether the layer's products run W8A16 (x unquantized): block-scaled weights (no FP8 tensor-core
    route for their scales here) or a weight-only checkpoint."""
    return layer.weight_scale.shape[1] > 1 or layer.act_quant == "none"


def reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize and multiply in fp32, x quantized first as ``act`` says (None: not at all)."""
    xf = x.float()
    if act is not None:
        xq, sx = quantize_tokens(x, input_scale if act == "static" else None)
        xf = xq.float() * sx
    y = F.linear(xf, dequantize(codes, scale), None if bias is None else bias.float())
    return y.to(x.dtype)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_gpu(device: torch.device) -> bool:
    """Whether a CUDA device multiplies FP8 (sm_89 and later: Ada, Hopper, Blackwell)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


def _triton_takes(x: torch.Tensor) -> bool:
    from prefixserve.model import fused

    return fused._use_triton(x) and x.dtype in (torch.bfloat16, torch.float16)


def scaled_mm_takes(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """cuBLASLt's FP8 GEMM with row-wise scales: bf16 out, K and N multiples of 16."""
    return x.dtype == torch.bfloat16 and x.shape[1] % 16 == 0 and codes.shape[0] % 16 == 0


def scaled_mm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """W8A8 through ``torch._scaled_mm``: x's per-token scales [M, 1] and the weight's per-channel
    [1, N] applied in the epilogue. The second operand column-major: ``codes.t()`` of row-major codes.

    Fast accumulation (the tensor cores' own accumulator, no periodic promotion to fp32), as vLLM's
    Hopper FP8 kernels run: 2-13% faster at prefill's 8,192 rows, its relative error 2-3e-3 against
    the exact product, a tenth of x's own e4m3 rounding (docs/kernels.md §10)."""
    if rows is not None:  # x's codes, made by the kernel before (``attach_rows``)
        xq, sx = rows
    elif _triton_takes(x) and x.stride(1) == 1:
        from prefixserve.model.kernels import fp8_matmul

        xq, sx = fp8_matmul.quantize_rows(x, input_scale)
    else:
        xq, sx = quantize_tokens(x, input_scale)
    y = torch._scaled_mm(
        xq, codes.t(), scale_a=sx, scale_b=scale.view(1, -1), out_dtype=x.dtype, use_fast_accum=True
    )
    return y if bias is None else y + bias


__all__ = [
    "ACT_MODES",
    "FP8",
    "FP8_MAX",
    "GROUP",
    "MAX_ROWS",
    "ROWS_ATTR",
    "attach_rows",
    "dequantize",
    "expand_scale",
    "fp8_gpu",
    "install",
    "is_fp8",
    "linear",
    "partials",
    "quantize_layer",
    "quantize_rows",
    "quantize_tokens",
    "reference",
    "refill",
    "rows_of",
    "scaled_mm",
    "scaled_mm_takes",
    "takes_rows",
    "to_codes",
    "weight_only",
]
