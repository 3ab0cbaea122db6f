"""The token-mask kernel (``prefixserve/sampling/token_mask.py``) against the plain-PyTorch reference
(``structured/bitmask.apply_bitmask_reference``): every row or some rows by a device index, padded
mask words, bit 31 set and clear, strided logits rows, fp32/bf16/fp16, and the recorded relaunch
taking new tensors of the same shape. On a CPU it runs in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.sampling.token_mask import kernel_token_mask
from prefixserve.structured.bitmask import apply_bitmask_reference

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if DEVICE.type == "cuda" else [])


def _case(
    rows: int, vocab: int, pad: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32) + pad
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
    mask[0, 0] = -(2**31)  # only bit 31 allowed
    if rows > 1:
        mask[1] = 0  # nothing allowed
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    return logits, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, vocab, pad", [(3, 5000, 0), (5, 70, 1), (1, 32, 0), (4, 2049, 2), (7, 4096, 0)]
)
@pytest.mark.parametrize("some", [False, True])
def test_kernel_token_mask_equals_the_reference(
    rows: int, vocab: int, pad: int, dtype: torch.dtype, some: bool
) -> None:
    logits, mask = _case(rows, vocab, pad, rows * vocab + pad, dtype)
    picked = [r for r in range(rows) if r % 2 == 0] if some else list(range(rows))
    want = logits.clone()
    apply_bitmask_reference(want, mask, picked)
    for _ in range(2):  # the second call relaunches the recorded launch with new tensors
        got = logits.clone().to(DEVICE)
        index = torch.tensor(picked, dtype=torch.int64, device=DEVICE) if some else None
        kernel_token_mask(got, mask.to(DEVICE), index)
        assert torch.equal(got.cpu(), want)


def test_kernel_token_mask_strided_rows() -> None:
    logits, mask = _case(3, 3000, 0, 7, torch.float32)
    wide = torch.full((3, 3100), 5.0, device=DEVICE)
    wide[:, :3000] = logits.to(DEVICE)
    view = wide[:, :3000]
    want = logits.clone()
    apply_bitmask_reference(want, mask, [0, 1, 2])
    kernel_token_mask(view, mask.to(DEVICE), None)
    assert torch.equal(view.cpu(), want)
    assert torch.all(wide[:, 3000:] == 5.0)  # nothing past a row's vocabulary written


def test_kernel_token_mask_reads_pinned_host_memory() -> None:
    """The mask read straight from pinned host memory (a gated step's slot, on a GPU): the same result."""
    logits, mask = _case(4, 3000, 1, 11, torch.float32)
    want = logits.clone()
    apply_bitmask_reference(want, mask, [0, 1, 2, 3])
    got = logits.clone().to(DEVICE)
    source = mask.pin_memory() if DEVICE.type == "cuda" else mask
    kernel_token_mask(got, source, None)
    assert torch.equal(got.cpu(), want)
