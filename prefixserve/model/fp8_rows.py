"""An activation carrying its per-token e4m3 codes: made by the kernel that made the activation
(RMSNorm, SiLU-and-mul), taken by the FP8 product that reads it (``fp8.linear``) in place of its own
quantize pass. Or carrying only its rows' amax partials (the fused gate-up kernel's, ``attach_amax``):
the product's kernel then makes the codes as it loads the activation, and a consumer that cannot
(``rows_of`` says None) quantizes it as before, to the same codes. Its own module so that ``fused``
(which attaches) and ``fp8`` (which reads) import it and not each other.
"""

from __future__ import annotations

import torch

ROWS_ATTR = "fp8_rows"  # a 16-bit activation's (e4m3 codes [M, K], fp32 scales [M, 1]), set by its producer
AMAX_ATTR = "fp8_amax"  # its fp32 amax partials [P, M] (max over P: each row's amax), set by its producer


def attach_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] carrying its per-token e4m3 codes and scales (equal to ``fp8.quantize_tokens(x)``),
    which ``fp8.linear`` takes instead of quantizing x again. Only this tensor object carries them: a
    view or any op's result is a new tensor without them."""
    setattr(x, ROWS_ATTR, (codes, scales))
    return x


def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The codes and scales ``attach_rows`` gave x, or None."""
    return getattr(x, ROWS_ATTR, None)


def attach_amax(x: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] carrying fp32 ``partials`` [P, M] whose max over P is each row's max |value|
    (``fp8_matmul.fp8_gated``'s ``amax``), which ``fp8.linear`` hands its W8A8 kernel to make x's
    codes on load (``fp8_matmul.fp8_linear``'s ``x_amax``); as ``attach_rows``, this object only."""
    setattr(x, AMAX_ATTR, partials)
    return x


def amax_of(x: torch.Tensor) -> torch.Tensor | None:
    """The amax partials ``attach_amax`` gave x, or None."""
    return getattr(x, AMAX_ATTR, None)


__all__ = ["AMAX_ATTR", "ROWS_ATTR", "amax_of", "attach_amax", "attach_rows", "rows_of"]
