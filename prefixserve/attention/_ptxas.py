"""The ptxas that builds the mixed kernel (``mixed_gluon.py``) for Hopper.

Triton 3.6 bundles two: CUDA 12.8's ``ptxas`` (what it uses for sm_90) and CUDA 12.9's
``ptxas-blackwell``. 12.8 miscompiles the mixed kernel with 128-row own tiles: on a process's first
launch the P V products leave out P^T k-steps 2, 3, 6 and 7, with every operand right in shared
memory, and its SASS reloads two 64-bit spill slots on a path that never stored them (docs/kernels.md §2.5).
12.9 builds the same PTX right, with no such reload. So where a ptxas of at least 12.9 is at hand,
a compile-stage hook builds the mixed kernel's cubin with it (that kernel only), and the 128-row own
tile is used only then.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

MIN_VERSION = (12, 9)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@functools.cache
def newer_ptxas() -> tuple[str, str] | None:
    """(path, version) of a ptxas of at least ``MIN_VERSION`` that compiles for sm_90 (the one
    ``TRITON_PTXAS_PATH`` names, else Triton's ``ptxas-blackwell``), or None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    for tool in (knobs.nvidia.ptxas, knobs.nvidia.ptxas_blackwell):
        if tool is None or not re.fullmatch(r"\d+\.\d+", tool.version):
            continue
        if _version(tool.version) >= MIN_VERSION:
            return tool.path, tool.version
    return None


_KERNELS: set[str] = set()
BUILT: list[str] = []  # kernels whose cubins the hook built, in order (tests read it)


def build_with_newer(kernel_name: str) -> bool:
    """Have ``kernel_name``'s cubin built by ``newer_ptxas()`` from now on (a Triton compile-stage
    hook, chained after any other). False where there is no such ptxas."""
    found = newer_ptxas()
    if found is None:
        return False
    if not _KERNELS:
        from triton import knobs

        knobs.runtime.add_stages_inspection_hook = _chain(knobs.runtime.add_stages_inspection_hook, found[0])
    _KERNELS.add(kernel_name)
    return True


def _chain(previous: Callable[..., Any] | None, path: str) -> Callable[..., Any]:
    def hook(backend: Any, stages: dict[str, Callable], options: Any, language: Any, capability: Any) -> None:
        if previous is not None:
            previous(backend, stages, options, language, capability)
        build = stages.get("cubin")
        if build is None:
            return

        def make_cubin(src: str, metadata: dict[str, Any]) -> bytes:
            if metadata.get("name") not in _KERNELS:
                return build(src, metadata)
            from triton import knobs

            with knobs.nvidia.scope():
                knobs.nvidia.ptxas = path
                cubin = build(src, metadata)
            BUILT.append(metadata["name"])
            return cubin

        stages["cubin"] = make_cubin

    return hook
