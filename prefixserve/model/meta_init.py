"""Build a model's modules without torch's default init, then give them memory the loader fills.

A checkpoint overwrites every weight, so drawing them first is waste; and on the meta device (where the
loader builds the model, to check that it fits before allocating) several ops run torch's Python
decompositions instead of a kernel: ``nn.Embedding``'s ``normal_`` and an fp64 ``arange`` import
torch._dynamo, ``Module.to_empty``'s ``empty_like`` imports sympy. On a 2-core CPU that was 2-3 s of
a 135M model's start. Dummy weights are drawn explicitly (``loader._init_dummy``).
"""

from __future__ import annotations

import torch
from torch import nn


class LoadedLater:
    """Mixin for layers whose weights a loader fills: built on the meta device they skip torch's
    default init. Built on a real device (a test, a stand-alone layer) they keep it."""

    def reset_parameters(self) -> None:
        if self.weight.is_meta:  # type: ignore[attr-defined]
            return
        super().reset_parameters()  # type: ignore[misc]


def allocate(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to_empty(device=device)`` without ``empty_like`` on meta tensors: every parameter and
    buffer gets uninitialised memory of its shape and dtype; tensors shared by several modules (tied
    embeddings) stay shared."""
    made: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its replacement
    old: list[torch.Tensor] = []  # the meta tensors, alive until the end so that no id is reused

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            old.append(t)
            empty = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return made[id(t)]

    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            module._parameters[name] = fresh(p)  # type: ignore[assignment]
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = fresh(b)
    return model


__all__ = ["LoadedLater", "allocate"]
