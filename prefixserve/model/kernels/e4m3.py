"""Per-row e4m3 quantization inside a kernel: the one rule every FP8 activation path applies.

A row's scale is amax / 448 (never below ``MIN_SCALE``: an all-zero row), its codes the values over
the scale clamped to e4m3's range and rounded to nearest even. The quantize kernel
(``fp8_matmul.quantize_rows``) and the kernels that emit codes beside their own output (RMSNorm,
SiLU-and-mul) call these, so their codes are equal bit for bit.
"""

from __future__ import annotations

from prefixserve.triton_support import require_triton

triton, tl = require_triton()

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # fp8.FP8_MAX: e4m3's largest finite value
MIN_SCALE: tl.constexpr = tl.constexpr(1e-12)  # fp8.MIN_SCALE: an all-zero row's


@triton.jit
def row_scale(amax):
    """The scale of a row whose largest magnitude is ``amax`` (fp32 scalar)."""
    return tl.maximum(amax / FP8_MAX, MIN_SCALE)


@triton.jit
def to_codes(x, scale, codes_dtype: tl.constexpr):
    """fp32 values ``x`` of a row over its ``scale``, as e4m3 codes."""
    return tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX).to(codes_dtype)


ROW_MAX = 16384  # a row up to this long is held whole in one program's registers (one read)


def row_launch(n: int) -> tuple[int, bool, int]:
    """(BLOCK, WHOLE, num_warps) of a kernel that quantizes rows of ``n`` values, one program a row:
    up to ``ROW_MAX`` the whole row in registers, read once (a decode step's few rows are then one
    short wave: a program walking 1,024 values at a time twice, latency after latency, took most of
    the quantization's time at one row); past it 1,024 values a step, the row read twice."""
    if n <= ROW_MAX:
        block = triton.next_power_of_2(n)
        return block, True, min(16, max(4, block // 512))
    return 1024, False, 4


__all__ = ["FP8_MAX", "MIN_SCALE", "ROW_MAX", "row_launch", "row_scale", "to_codes"]
