"""Bound kernel launches: pay Triton's Python launch cost once per step, not once per layer.

``kernel[grid](*args)`` binds and specialises every argument, hashes a cache key and looks the compiled
kernel up on each call: tens of microseconds, which an eager 32-layer decode step pays per launch and
per layer (docs/kernels.md §2.7). Every layer of a step launches the same
kernels with the same grid, integers and strides; only the tensors of the layer (q, the layer's K/V
cache, the output) change. So the first launch of a step goes through Triton's normal path and is
recorded as a ``Launch``; later layers call ``relaunch``, which swaps those tensors into the recorded
argument list and calls the compiled kernel's launcher directly (a few microseconds).

Safety: a swapped tensor must keep what the compiled kernel was specialised on. Pointers are
specialised on 16-byte alignment only, so ``relaunch`` checks that (and dtype/strides are the caller's
promise: the same model layer shape). Whenever the fast path is not available (the CPU interpreter, a
Triton without ``CompiledKernel.run``, a launch hook installed by a profiler) it falls back to the
normal launch, which is always correct.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# keywords of ``kernel[grid](...)`` that are compile options, not kernel parameters
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "launch_pdl")


@dataclass(slots=True)
class Launch:
    """One recorded launch: the kernel, its grid, and every parameter in signature order."""

    kernel: Any  # triton JITFunction (or the interpreter's wrapper)
    grid: tuple[int, int, int]
    args: list[Any]  # every kernel parameter, constexprs included, in signature order
    num_positional: int  # the first ones are passed positionally on the slow path
    keywords: list[str]  # names of the rest (the constexprs), in the order they sit in ``args``
    options: dict[str, Any]  # num_warps, num_stages, maxnreg, launch_pdl
    compiled: Any  # triton CompiledKernel, or None when the fast path is not available
    # (dst, src, make): args[dst] is made from args[src] (a TMA descriptor of a layer's KV cache), so
    # a swap of args[src] remakes it
    derived: list[tuple[int, int, Callable[[Any], Any]]] = field(default_factory=list)


def record(
    kernel: Any, grid: tuple[int, ...], args: Sequence[Any], kw: dict[str, Any], compiled: Any
) -> Launch:
    """Make a ``Launch`` from a call ``kernel[grid](*args, **kw)`` that returned ``compiled``."""
    names = list(getattr(kernel, "arg_names", []))
    constexprs = {k: v for k, v in kw.items() if k not in LAUNCH_OPTIONS}
    full = list(args)
    fast = (
        compiled is not None
        and hasattr(compiled, "run")
        and hasattr(compiled, "packed_metadata")
        and len(names) == len(args) + len(constexprs)
        and all(n in constexprs for n in names[len(args) :])
    )
    order = names[len(args) :] if fast else list(constexprs)
    full += [constexprs[n] for n in order]
    g = (*grid, 1, 1)[:3]
    options = {k: kw[k] for k in LAUNCH_OPTIONS if k in kw}
    grid3 = (int(g[0]), int(g[1]), int(g[2]))
    return Launch(kernel, grid3, full, len(args), order, options, compiled if fast else None)


@functools.cache
def _knobs() -> Any:
    """Triton's ``knobs`` module, imported once (every relaunch asks for its hooks), or None."""
    try:
        return importlib.import_module("triton.knobs")
    except ImportError:  # pragma: no cover
        return None


def _hooked() -> bool:
    """True when a launch hook (a profiler's) is installed: then take Triton's path, which calls it.

    Triton 3.6 keeps the hooks as ``HookChain`` objects that are never None; an empty chain is no hook.
    """
    knobs = _knobs()
    if knobs is None:  # pragma: no cover - older Triton: always take the normal path
        return True
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def raw_stream(device_index: int) -> int:
    """The current CUDA stream's handle: the call Triton's own launcher makes (``current_stream(device)``
    builds a device object and a Stream a call, ~10 us of a relaunch's host time)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def relaunch(launch: Launch, swaps: Sequence[tuple[int, torch.Tensor]], stream: Any = None) -> None:
    """Launch again with ``args[i] = tensor`` for each swap; fast when the recorded kernel allows it.
    ``stream``: a ``torch.cuda.Stream`` to launch on instead of the current one (the fast path takes
    its handle; the normal path makes it current for the call)."""
    args = launch.args
    ck = launch.compiled
    fast = ck is not None
    swapped = set()
    for i, t in swaps:
        args[i] = t
        swapped.add(i)
        if t.data_ptr() % 16:
            fast = False
    for dst, src, make in launch.derived:
        if src in swapped:
            args[dst] = make(args[src])
    if fast and not _hooked():
        g = launch.grid
        handle = raw_stream(args[0].get_device()) if stream is None else stream.cuda_stream
        ck.run(g[0], g[1], g[2], handle, ck.function, ck.packed_metadata, None, None, None, *args)
        return
    n = launch.num_positional
    kw = dict(zip(launch.keywords, args[n:], strict=True))
    if stream is None:
        launch.kernel[launch.grid](*args[:n], **kw, **launch.options)
        return
    with torch.cuda.stream(stream):
        launch.kernel[launch.grid](*args[:n], **kw, **launch.options)


__all__ = ["Launch", "raw_stream", "record", "relaunch"]
