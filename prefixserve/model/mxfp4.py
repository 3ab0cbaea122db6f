"""MXFP4 (OCP microscaling FP4), as gpt-oss publishes its expert weights: dequantized once at load.

A block of 32 values shares one scale: 16 bytes of E2M1 codes (two per byte, the low nibble first)
and one E8M0 byte (the power of two 2^(s - 127)). An E2M1 code is a sign bit, two exponent bits
(bias 1) and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.

The checkpoint names them ``{tensor}_blocks`` [..., rows, G, 16] and ``{tensor}_scales``
[..., rows, G]; the dequantized tensor is [..., G 32, rows] (the two last dims swapped), the layout
HF's unquantized gpt-oss holds, so one conversion (``moe.MoE.stacked_pieces``) serves both forms.
Native MXFP4 matmuls are not done: the experts cost bf16's bytes once loaded (README).
"""

from __future__ import annotations

from pathlib import Path

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SUFFIXES = ("_blocks", "_scales")


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G 32] values in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    pairs = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)  # low first
    values = pairs.flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent[..., None]).flatten(-2).to(dtype)


def checkpoint_tensor(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The unquantized checkpoint tensor: dequantized, the last two dims swapped (fp32). An expert at
    a time: the whole tensor's temporaries (codes widened, the value pairs) would double the host
    memory a load peaks at (gpt-oss-120b's gate_up_proj is 17 GB in fp32)."""
    if blocks.dim() < 4:
        return dequantize(blocks, scales).transpose(-2, -1).contiguous()
    rows, groups = blocks.shape[-3], blocks.shape[-2]
    out = torch.empty(*blocks.shape[:-3], groups * 32, rows, dtype=torch.float32)
    flat_out, flat_blocks = out.view(-1, groups * 32, rows), blocks.reshape(-1, rows, groups, 16)
    flat_scales = scales.reshape(-1, rows, groups)
    for i in range(flat_out.shape[0]):
        flat_out[i] = dequantize(flat_blocks[i], flat_scales[i]).transpose(0, 1)
    return out


def is_packed(name: str) -> bool:
    return name.endswith(_SUFFIXES)


class Pairs:
    """Collects each packed tensor's blocks and scales as the loader meets them (any file, any
    order); ``add`` returns (the tensor's name, its dequantized value) once both are in."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        base, suffix = name.rsplit("_", 1)
        parts = self.waiting.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) < 2:
            return None
        del self.waiting[base]
        return base, checkpoint_tensor(parts["blocks"], parts["scales"])

    def check_complete(self, directory: Path) -> None:
        if self.waiting:
            lone = {f"{base}_{next(iter(parts))}" for base, parts in self.waiting.items()}
            raise ValueError(f"{directory}: MXFP4 tensors without their pair: {sorted(lone)[:5]}")


__all__ = ["E2M1", "Pairs", "checkpoint_tensor", "dequantize", "is_packed"]
