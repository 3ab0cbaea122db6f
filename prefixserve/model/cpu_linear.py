"""Linear layers on the CPU through oneDNN with a weight packed once, instead of torch's fp32 sgemm.

On the 2-core AMD EPYC (Zen 4) VM of ``docs/benchmarks/llamacpp_cpu.md``, the default model's fp32
matmuls through ``F.linear`` (MKL) read their weights at 4-9 GB/s: a B=32 decode step spent 70 ms in
the layers' matmuls and 28 ms in the lm_head. oneDNN's matmul over weights reordered once into its
blocked layout took 44 ms and 10 ms, and prefill-sized products 10-15% less (bf16 too: 35 -> 23 ms).
The products are the same fp32 products with fp32 accumulation (only the summation order differs, as
between any two GEMM libraries), so this is not an approximation.

The packed copy is extra memory: one more copy of every linear weight (tied embeddings included). It is
made once (``pack_linear_weights``, called by the engine's runner on the CPU) and used only while the
layer's weight is the very tensor it was packed from, unmodified; anything else takes ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
PACK_BATCH_HINT = 32  # the row count oneDNN's layout is chosen for (any count works; measured 1-2048)
_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Does this torch have oneDNN's linear ops (an x86 CPU build with mkldnn)?"""
    return _LINEAR is not None and _REORDER is not None and torch.backends.mkldnn.is_available()


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """Does oneDNN pack weights of ``dtype`` on this CPU? bf16 needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT: on an AVX2-only CPU the reorder raises, and those layers keep ``F.linear``."""
    if not available() or dtype not in _DTYPES:
        return False
    try:
        with torch.no_grad():
            _REORDER(torch.zeros(8, 8, dtype=dtype), PACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


class PackedWeight:
    """A oneDNN-packed copy of one weight, valid while the weight is the same unmodified tensor."""

    __slots__ = ("key", "packed")

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = _REORDER(weight.detach(), PACK_BATCH_HINT)
        self.key = _key(weight)

    def matches(self, weight: torch.Tensor) -> bool:
        return self.key == _key(weight)


def _key(weight: torch.Tensor) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    """What identifies a weight's values: its storage, its in-place version, dtype and shape."""
    version = 0 if weight.is_inference() else weight._version  # inference tensors keep no version
    return weight.data_ptr(), version, weight.dtype, tuple(weight.shape)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``: through the packed weight when it is current and x is a CPU tensor of its dtype."""
    packed: PackedWeight | None = layer.__dict__.get("_packed_weight")
    if (
        packed is not None
        and x.device.type == "cpu"
        and x.dtype == layer.weight.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad))
        and packed.matches(layer.weight)
    ):
        return _LINEAR(x, packed.packed, layer.bias, "none", [], "")
    return F.linear(x, layer.weight, layer.bias)


def pack_linear_weights(model: nn.Module, enabled: bool = True) -> int:
    """Give every CPU ``nn.Linear`` of ``model`` whose dtype oneDNN packs here (``can_pack``: fp32, and
    bf16 on AVX-512 CPUs) a packed weight (``enabled=False``: drop them); returns how many layers have
    one. Layers only use it through ``linear``."""
    if not isinstance(model, nn.Module):  # a stand-in model (host-overhead benchmarks) has no layers
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        module.__dict__.pop("_packed_weight", None)
        w = module.weight
        if enabled and w.device.type == "cpu" and w.dim() == 2 and can_pack(w.dtype):
            module.__dict__["_packed_weight"] = PackedWeight(w)
            count += 1
    return count
