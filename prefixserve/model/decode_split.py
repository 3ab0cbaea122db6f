"""Which decode products hand the next norm split-K partials instead of their product.

A decode step's products (1-64 rows, the skinny and FP8 kernels) whose output goes to the next norm
can be cut into K slices whose fp32 partials that norm sums (``fused.add_rms_norm`` takes [S, T, N]):
each program is then a (column tile, slice), where one column tile a program leaves SMs idle
(``benchmarks/probes/skinny_split.py``, H200, the product then the add-RMSNorm, 2 slices against one;
docs/kernels.md §7): bf16 up to ``MAX_N`` columns (Qwen3-30B-A3B's o, 64 tiles); FP8 W8A8 up to
``FP8_ROWS`` rows, and past them the products of K and N at most ``FP8_MAX_SIDE`` (the 8B's o); past
64 rows, up to ``fp8_matmul.MID_ROWS``, FP8 W8A8 in ``MID_SPLITS`` slices on the Triton kernel's
``MID_TILE``, where cuBLASLt's one GEMM leaves SMs idle (``benchmarks/probes/fp8_mid_rows.py``). K at
least ``MIN_K`` (the products measured: 4,096 and 14,336; a short K's programs are short). A
direct MoE step's router (``router_partials``) in ``ROUTER_SPLITS`` slices, which the up kernel
sums where it routes (``fused_moe.routed_forward``). Its own module: the rule needs both the fused
path's switches and the FP8 layers, which import the former.
"""

from __future__ import annotations

import torch

from prefixserve.model import fp8, fused

SPLITS = 2
MIN_K = 4096
MAX_N = 2048
FP8_ROWS = 16
FP8_MAX_SIDE = 4096
MID_SPLITS = 2  # FP8 W8A8 past 64 rows up to ``fp8_matmul.MID_ROWS`` (``fp8_mid_rows.py``, H200)
MID_QKV_SPLITS = 2  # the same for an FP8 qkv product, summed by the RoPE kernel; 0: one product
ROUTER_SPLITS = 8  # Qwen3-30B-A3B's router at 1-2 rows: 5.0 -> 2.3 us (skinny_split.py, H200)


def partials(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor | None:
    """fp32 split-K partials [S, T, N] of ``layer(x)`` (a replicated, bias-free projection) where the
    rule above takes the product, for the norm after it to sum; None: run the product whole."""
    from prefixserve.model.kernels import fp8_matmul, skinny_matmul

    rows, k = x.shape
    if not fused.split_k_taken(x) or k < MIN_K:
        return None
    if getattr(layer, "bias", None) is not None or not skinny_matmul.hopper(x.device):
        return None
    n = layer.weight.shape[0]
    if layer.weight.dtype == fp8.FP8:
        if rows <= FP8_ROWS or (rows <= skinny_matmul.MAX_ROWS and max(k, n) <= FP8_MAX_SIDE):
            return fp8.partials(layer, x, SPLITS)
        if fp8_matmul.mid_rows(rows) and fused.fp8_mid_taken():
            return fp8.partials(layer, x, MID_SPLITS)
        return None
    if rows > skinny_matmul.MAX_ROWS or n > MAX_N or not skinny_matmul.supported(x, layer.weight):
        return None
    if k % (SPLITS * skinny_matmul.BLOCK_K):
        return None
    return skinny_matmul.skinny_partials(x, layer.weight, SPLITS)


def fp8_qkv(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """An FP8 qkv projection of ``x``: past 64 rows up to ``fp8_matmul.MID_ROWS``, K at least
    ``MIN_K``, its fp32 split-K partials in ``MID_QKV_SPLITS`` slices, which the RoPE kernel sums
    (``fused.rope_qkv``), where that is set; else the product."""
    from prefixserve.model.kernels import fp8_matmul, skinny_matmul

    rows, k = x.shape
    taken = MID_QKV_SPLITS and k >= MIN_K and fused.split_k_taken(x) and fused.fp8_mid_taken()
    if taken and skinny_matmul.hopper(x.device) and fp8_matmul.mid_rows(rows):
        parts = fp8.partials(layer, x, MID_QKV_SPLITS)
        if parts is not None:
            return parts
    return layer(x)


def router_partials(x: torch.Tensor, gate: torch.nn.Module, top_k: int) -> torch.Tensor | None:
    """fp32 split-K partials [S, T, E] of a direct MoE step's router ``gate(x)`` (T k at most
    ``fused_moe.DIRECT_MAX``, routed inside the up kernel, which sums them): its few columns are
    otherwise a few programs, each reading a long slice of the weight. None: run the router whole
    (a bias, a larger step, or a product the skinny kernel does not take)."""
    from prefixserve.model.kernels import fused_moe, skinny_matmul

    rows, k = x.shape
    if not (fused.router_split_taken(x) and rows * top_k <= fused_moe.DIRECT_MAX) or gate.bias is not None:
        return None
    if not skinny_matmul.hopper(x.device) or k % (ROUTER_SPLITS * skinny_matmul.BLOCK_K):
        return None
    if not skinny_matmul.supported(x, gate.weight):
        return None
    return skinny_matmul.skinny_partials(x, gate.weight, ROUTER_SPLITS)


__all__ = [
    "FP8_MAX_SIDE",
    "FP8_ROWS",
    "MAX_N",
    "MID_QKV_SPLITS",
    "MID_SPLITS",
    "MIN_K",
    "ROUTER_SPLITS",
    "SPLITS",
    "fp8_qkv",
    "partials",
    "router_partials",
]
