"""Small per-step tensors (row indices, token ids, per-row parameters) put on the sampling's device."""

from __future__ import annotations

import torch

from prefixserve.host_copy import list_to_device


def small_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without a blocking copy: on a GPU through page-locked memory,
    as a pageable copy would first wait for the work already queued (launch-ahead's step among it)."""
    return list_to_device(values, device, dtype)


__all__ = ["small_tensor"]
