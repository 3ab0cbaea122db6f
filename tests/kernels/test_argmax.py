"""The greedy argmax kernels (``prefixserve/sampling/argmax.py``) against ``torch.argmax``.

Exact equality on every row: the first index of the maximum, ties across and within chunks, rows of
-inf only, and a NaN (torch takes it as the largest value, so its first index wins). On a CPU the
kernels run in the Triton interpreter; with a GPU compiled, in fp32, fp16 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.sampling.argmax import BLOCK, argmax_rows, kernel_argmax, splits_for

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if DEVICE.type == "cuda" else [])


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    x = (x * 4).round() / 4  # coarse values: many ties
    x[0] = float("-inf")
    if rows > 1:
        x[1, vocab // 3] = 100.0
        x[1, vocab - 1] = 100.0  # a tie in another chunk: the first wins
    if rows > 2:
        x[2, vocab // 2] = float("nan")
        x[2, 0] = float("inf")
        x[2, vocab - 1] = float("nan")
    if rows > 3:
        x[3] = 0.5  # every index ties
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, vocab, programs",
    [(5, 5000, 16), (4, BLOCK, 4), (6, 3 * BLOCK + 1, 1), (4, 70, 8), (9, 2049, 40), (1, 4097, 3)],
)
def test_kernel_argmax_equals_torch(dtype: torch.dtype, rows: int, vocab: int, programs: int) -> None:
    x = _logits(rows, vocab, dtype, seed=rows * vocab)
    assert torch.equal(kernel_argmax(x, programs).cpu(), x.argmax(-1).cpu())


def test_kernel_argmax_strided_rows_and_empty() -> None:
    x = _logits(4, 3000, torch.float32, seed=1)
    wide = torch.full((4, 3100), 1e9, device=DEVICE)
    wide[:, :3000] = x
    view = wide[:, :3000]  # rows 3100 apart; the 1e9 past each row must not be read
    assert torch.equal(kernel_argmax(view, 8).cpu(), x.argmax(-1).cpu())
    assert kernel_argmax(x[:0], 8).shape == (0,)


def test_splits_cover_the_grid() -> None:
    assert splits_for(1024, 128_256, 528) == 1  # enough rows: one program a row
    assert splits_for(64, 128_256, 528) == 9
    assert splits_for(1, 500, 528) == 1  # never shorter than a block
    assert splits_for(2, 10 * BLOCK, 528) == 10


def test_argmax_rows_is_torch_off_cuda() -> None:
    x = torch.randn(3, 50)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@pytest.mark.gpu
def test_argmax_rows_at_the_real_vocabulary() -> None:
    """Three draws a shape: the first launches through Triton, later ones relaunch the recorded pair."""
    for rows in (1, 64, 256, 1024):
        for _ in range(3):
            x = torch.randn(rows, 128_256, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(argmax_rows(x), x.argmax(-1))
        view = torch.randn(rows, 128_300, device="cuda", dtype=torch.bfloat16)[:, :128_256]  # another stride
        assert torch.equal(argmax_rows(view), view.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_relaunched_argmax_keeps_exactness_and_no_tensors(dtype: torch.dtype) -> None:
    """Edge-case logits (ties across chunks, -inf rows, NaN, all ties) through the recorded launches of
    a shape (a random first call records them), and the records hold neither call's logits nor output."""
    import gc
    import weakref

    rows, vocab, programs = 6, 5000 + 3 * DTYPES.index(dtype), 24  # a shape of its own per dtype
    first = torch.randn(rows, vocab).to(DEVICE, dtype)
    assert torch.equal(kernel_argmax(first, programs).cpu(), first.argmax(-1).cpu())
    edge = _logits(rows, vocab, dtype, seed=3)
    got = kernel_argmax(edge, programs)
    assert torch.equal(got.cpu(), edge.argmax(-1).cpu())
    refs = [weakref.ref(t) for t in (first, edge, got)]
    del first, edge, got
    gc.collect()
    assert all(r() is None for r in refs), "a recorded launch keeps a step's logits or output alive"


@pytest.mark.gpu
def test_argmax_rows_leaves_float64_to_torch() -> None:
    f64 = torch.randn(3, 1000, device="cuda", dtype=torch.float64)
    f64[0, 10] = f64[0, 11] = 100.0  # equal in fp64, and fp32 could not tell close values apart
    assert torch.equal(argmax_rows(f64), f64.argmax(-1))
