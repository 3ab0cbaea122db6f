"""Triton launches bound once per shape: Triton's Python launch cost paid once, not per layer.

``kernel[grid](*args)`` binds, specialises and hashes every argument on each call: tens of
microseconds. An eager step (a prefill, a Prompt Cache first token) launches each dense kernel once
a layer with the same grid, integers and strides; only the tensors change (the layer's weights, its
activations, its KV cache). ``BoundKernel`` launches the first call of a signature through Triton
and records it (``triton_support/launch.py``); later calls with the same signature swap their
tensors in and call the compiled kernel's launcher directly. Decode steps replay CUDA graphs and
never get here after capture.

The signature is everything the compiled kernel was specialised on: the grid, every non-tensor
argument as it is (integers, floats, constexprs, launch options), and each tensor's dtype, device
and 16-byte alignment. Where the fast path is not available (the interpreter, a profiler's launch
hook) ``relaunch`` takes Triton's normal path, which is always correct.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from prefixserve.triton_support.launch import Launch, record, relaunch

MAX_SIGNATURES = 64  # per kernel: prefill lengths vary, so the cache is an LRU


class BoundKernel:
    """A Triton kernel called as ``bound(grid, *args, **kw)`` instead of ``kernel[grid](*args, **kw)``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: OrderedDict[Hashable, Launch] = OrderedDict()

    def __call__(self, grid: tuple[int, ...], *args: Any, **kw: Any) -> None:
        key = _signature(grid, args, kw)
        launch = self.launches.get(key)
        if launch is None:
            compiled = self.kernel[grid](*args, **kw)
            launch = record(self.kernel, grid, args, kw, compiled)
            if launch.compiled is not None:  # only a launch the fast path can repeat is kept
                _forget(launch, [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)])
                self.launches[key] = launch
                if len(self.launches) > MAX_SIGNATURES:
                    self.launches.popitem(last=False)
            return
        self.launches.move_to_end(key)
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        relaunch(launch, [(i, args[i]) for i in tensors])
        _forget(launch, tensors)


def _forget(launch: Launch, tensors: list[int]) -> None:
    """Drop a record's tensors (every call swaps all of them in): a cached launch must not keep a
    step's activations alive."""
    for i in tensors:
        launch.args[i] = None


def _signature(grid: tuple[int, ...], args: Sequence[Any], kw: dict[str, Any]) -> Hashable:
    parts: list[Hashable] = [tuple(int(g) for g in grid)]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
        else:
            parts.append((type(a), a))
    parts.append(tuple(sorted(kw.items())))
    return tuple(parts)


__all__ = ["BoundKernel"]
