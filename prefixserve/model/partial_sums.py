"""Partials [S, T, N] that a kernel after a product sums: a product's fp32 split-K partials, or a
mixture of experts' weighted expert rows in the model's dtype (``fused_moe.hand_parts``). The norms
and the routing sum them in fp32 in order and round once; the torch path here does the same. Its own
module: both ``fused`` and the norm kernel's wrapper need it, and neither may import the other."""

from __future__ import annotations

import torch


def check_partials_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Partials [S, T, N] for a norm to sum: fp32 or the model's ``dtype`` (the residual's, else the
    one named), which must be known."""
    if dtype is None or x.dtype not in (torch.float32, dtype):
        raise ValueError(
            f"partials must be fp32 or the model's dtype ({x.dtype}) and come with the residual or a dtype"
        )


def summed_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Partials [S, T, N] (fp32 split-K ones, or parts in the model dtype) summed in order in fp32 and
    rounded to ``dtype``: as the kernels that take them sum them."""
    total = partials[0].to(torch.float32, copy=True)
    for part in partials[1:]:
        total += part.float()
    return total.to(dtype)


__all__ = ["check_partials_dtype", "summed_partials"]
