"""MXFP4 (OCP microscaling FP4), as gpt-oss publishes its expert weights: dequantized once at load.

A block of 32 values shares one scale: 16 bytes of E2M1 codes (two per byte, the low nibble first)
and one E8M0 byte (the power of two 2^(s - 127); 0xFF is NaN, so a checkpoint holding it is refused
at load). An E2M1 code is a sign bit, two exponent bits (bias 1) and one mantissa bit: 0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives.

The checkpoint names them ``{tensor}_blocks`` [..., rows, G, 16] and ``{tensor}_scales``
[..., rows, G]; the dequantized tensor is [..., G 32, rows] (the two last dims swapped), the layout
HF's unquantized gpt-oss holds, so one conversion (``moe.MoE.stacked_pieces``) serves both forms.
Native MXFP4 matmuls are not done: the experts cost bf16's bytes once loaded (README).
"""

from __future__ import annotations

from pathlib import Path

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NAN_SCALE = 0xFF  # E8M0 has no zero and no infinity; its one special value, 0xFF, is NaN (OCP MX v1.0)
_SUFFIXES = ("_blocks", "_scales")


def _names(name: str) -> tuple[str, str]:
    """The checkpoint's names of a packed tensor's two parts (``name``: the tensor's, if known)."""
    return (f"{name}_blocks", f"{name}_scales") if name else ("blocks", "scales")


def check_shapes(blocks: torch.Tensor, scales: torch.Tensor, name: str = "") -> None:
    """Refuse blocks and scales that do not pair before any reshape: a reshape would fail first, with
    a view error that names neither tensor."""
    blocks_name, scales_name = _names(name)
    if blocks.dim() < 2 or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 {blocks_name} has shape {tuple(blocks.shape)}: want [..., G, 16] (16 bytes a block)"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 {blocks_name} {tuple(blocks.shape)} and {scales_name} {tuple(scales.shape)} do not "
            f"match: want {scales_name} of shape {tuple(blocks.shape[:-1])} (one byte a block)"
        )


def check_scales(scales: torch.Tensor, name: str = "") -> None:
    """Refuse a NaN scale at load: its block's 32 weights would be NaN, and every token routed to the
    expert would turn NaN far from the checkpoint that caused it."""
    nans = int((scales == NAN_SCALE).sum())
    if nans:
        raise ValueError(
            f"MXFP4 {_names(name)[1]} holds scale 0xFF (NaN in the MX format) in {nans} of its "
            f"{scales.numel()} blocks: the checkpoint is damaged"
        )


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G 32] values in ``dtype``; a
    block whose scale is 0xFF is NaN, as the format defines it (loading refuses those: ``check_scales``)."""
    check_shapes(blocks, scales)
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    pairs = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)  # low first
    values = pairs.flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent[..., None])
    values.masked_fill_((scales == NAN_SCALE)[..., None], float("nan"))
    return values.flatten(-2).to(dtype)


def checkpoint_tensor(blocks: torch.Tensor, scales: torch.Tensor, name: str = "") -> torch.Tensor:
    """The unquantized checkpoint tensor: dequantized, the last two dims swapped (fp32); ``name`` (the
    packed tensor's) for the errors. An expert at a time: the whole tensor's temporaries (codes
    widened, the value pairs) would double the host memory a load peaks at (gpt-oss-120b's
    gate_up_proj is 17 GB in fp32)."""
    check_shapes(blocks, scales, name)
    check_scales(scales, name)
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
        return base, checkpoint_tensor(parts["blocks"], parts["scales"], base)

    def check_complete(self, directory: Path) -> None:
        if self.waiting:
            lone = {f"{base}_{next(iter(parts))}" for base, parts in self.waiting.items()}
            raise ValueError(f"{directory}: MXFP4 tensors without their pair: {sorted(lone)[:5]}")


__all__ = [
    "E2M1",
    "NAN_SCALE",
    "Pairs",
    "check_scales",
    "check_shapes",
    "checkpoint_tensor",
    "dequantize",
    "is_packed",
]
