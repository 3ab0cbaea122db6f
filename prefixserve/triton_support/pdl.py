"""Programmatic dependent launch (PDL): a kernel's programs start before the kernel it depends on ends.

A decode step at a few rows is a chain of one-wave kernels: each product pays its launch and its first
loads' latency after the kernel before has drained. Launched as that kernel's dependent
(``launch_pdl=True``), a kernel's programs are placed on the SMs while the kernel before still runs
and block in ``wait`` (``griddepcontrol.wait``: the kernel before has finished and its writes are
visible) before they read or write anything; the kernel before lets them start with
``launch_dependents`` (the norms and quantizers at once, a product after its main loop). The wait
orders every access after the writes before it, so a chain's results do not change (tested bit for
bit); only the launch gaps shrink (``docs/kernels.md`` §10).

``enabled`` says whether a launch may ask for it: a Hopper or newer GPU (the ``griddepcontrol``
instructions and the launch attribute), not the CPU interpreter, and ``ENABLED`` (a module switch:
tests and ``benchmarks/probes/pdl_chain.py`` turn it off to compare; decided, so no environment
variable, ``docs/kernels.md`` §3).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from prefixserve.triton_support import require_triton

require_triton()  # the install check and the interpreter's fixes
_gdc = importlib.import_module("triton.language.extra.cuda")
wait = _gdc.gdc_wait  # griddepcontrol.wait: the kernel before has finished, its writes visible
launch_dependents = _gdc.gdc_launch_dependents  # griddepcontrol.launch_dependents
ENABLED = True


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` may use PDL (see the module's docstring)."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False  # (the cheap tests first: every chained launch asks)
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(dependent: bool) -> dict[str, bool]:
    """The launch keywords of a kernel launched as a dependent (``dependent``), else none."""
    return {"launch_pdl": True} if dependent else {}


def chained(device: torch.device) -> dict[str, bool]:
    """A chained kernel's launch keywords on ``device``: its ``PDL`` constexpr and, when true, the
    launch attribute, taken together so the compiled variant and the launch never disagree."""
    dependent = enabled(device)
    return {"PDL": dependent, **launch_options(dependent)}


__all__ = ["ENABLED", "chained", "enabled", "launch_dependents", "launch_options", "wait"]
