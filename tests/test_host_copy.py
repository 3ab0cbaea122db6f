"""The step's host-to-device copies (``prefixserve/host_copy.py``): values, dtypes and shapes kept,
each packed array 16-byte aligned (Triton specialises pointers on it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixserve.attention.planning.step_plan import to_device_packed as int32_packed
from prefixserve.host_copy import list_to_device, to_device, to_device_packed


@pytest.mark.parametrize("seed", range(5))
def test_packed_arrays_keep_their_values_dtypes_and_shapes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(-(2**15), 2**15 - 1, size=tuple(rng.integers(0, 7, size=rng.integers(1, 4))), dtype=dt)
        for dt in rng.choice([np.int32, np.int64, np.int16], size=rng.integers(1, 6))
    ]
    moved = to_device_packed(arrays, "cpu")
    base = moved[0].untyped_storage().data_ptr()
    for a, t in zip(arrays, moved, strict=True):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
        assert (t.data_ptr() - base) % 16 == 0


def test_int32_packing_for_the_kernels_casts_and_flattens() -> None:
    arrays = [np.arange(6, dtype=np.int64).reshape(2, 3), np.array([7, 8, 9], dtype=np.int32), np.zeros(0)]
    moved = int32_packed(arrays, torch.device("cpu"))
    assert [t.dtype for t in moved] == [torch.int32] * 3
    assert [t.tolist() for t in moved] == [[0, 1, 2, 3, 4, 5], [7, 8, 9], []]


def test_a_cpu_copy_is_the_array_itself_and_lists_keep_their_dtype() -> None:
    a = np.arange(5, dtype=np.int64)
    t = to_device(a, "cpu")
    a[0] = 42
    assert t[0].item() == 42  # no copy on the CPU, as torch.from_numpy
    assert list_to_device([1.5, 2.0], torch.device("cpu")).dtype == torch.float32
    assert list_to_device([1, 2], torch.device("cpu"), torch.long).tolist() == [1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ring_reuses_its_buffers_and_every_copy_lands() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 1000, size=int(rng.integers(1, 70_000)), dtype=np.int32) for _ in range(200)]
    moved = [to_device(a, "cuda") for a in arrays]  # more copies than the ring holds, sizes growing
    for a, t in zip(arrays, moved, strict=True):
        assert np.array_equal(t.cpu().numpy(), a)
