"""An activation carrying its per-token e4m3 codes: made by the kernel that made the activation
(RMSNorm, SiLU-and-mul), taken by the FP8 product that reads it (``fp8.linear``) in place of its own
quantize pass. Its own module so that ``fused`` (which attaches) and ``fp8`` (which reads) import it
and not each other.
"""

from __future__ import annotations

import torch

ROWS_ATTR = "fp8_rows"  # a 16-bit activation's (e4m3 codes [M, K], fp32 scales [M, 1]), set by its producer


def attach_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] carrying its per-token e4m3 codes and scales (equal to ``fp8.quantize_tokens(x)``),
    which ``fp8.linear`` takes instead of quantizing x again. Only this tensor object carries them: a
    view or any op's result is a new tensor without them."""
    setattr(x, ROWS_ATTR, (codes, scales))
    return x


def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The codes and scales ``attach_rows`` gave x, or None."""
    return getattr(x, ROWS_ATTR, None)


__all__ = ["ROWS_ATTR", "attach_rows", "rows_of"]
