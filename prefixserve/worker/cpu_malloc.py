"""glibc malloc settings for the CPU engine: freed activations stay in the heap for the next step.

A CPU step allocates and frees many large tensors (a 1.5K-token prefill chunk of the default model has
9 MB MLP activations; decode gathers a few MB of KV per layer). glibc serves blocks above its mmap
threshold (128 KiB at start, raised only as such blocks are freed) with fresh mappings and trims free
heap memory back to the OS, so the same memory is page-faulted in again, step after step. Fixing the
threshold at 32 MiB (glibc's maximum for the adaptive one) and trimming only above 2 GiB keeps it.
On the 2-core VM of ``docs/benchmarks/llamacpp_cpu.md`` (32 chats sharing a 1.4K-token prompt, fp32)
the run took 16.1-16.9 s instead of 17.3-18.7 s; the first prompt's prefill step 2.6 s instead of 3.5 s.

The settings are process-wide (the same as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in
the environment); the price is that memory freed below the top of the heap is not returned to the OS
until it exceeds 2 GiB. Applied once, by the first CPU engine of the process; elsewhere (not glibc,
not Linux) nothing happens.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes a C int
_applied: bool | None = None


def holds_freed_memory() -> bool:
    """Did ``keep_freed_memory`` take effect in this process (so nothing should trim its heap)?"""
    return bool(_applied)


def keep_freed_memory() -> bool:
    """Set the thresholds above (once per process); True when glibc took them."""
    global _applied
    if _applied is None:
        _applied = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL("libc.so.6")
                libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no mallopt thresholds)
            except (OSError, AttributeError):
                return False
            mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            _applied = mmap_ok and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _applied
