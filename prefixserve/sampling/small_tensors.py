"""Small per-step tensors (row indices, token ids, per-row parameters) put on the sampling's device."""

from __future__ import annotations

import torch


def small_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without a blocking copy: on a GPU through pinned memory, as a
    pageable copy would first wait for the work already queued (launch-ahead's step among it)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


__all__ = ["small_tensor"]
