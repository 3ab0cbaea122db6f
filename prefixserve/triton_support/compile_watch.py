"""Triton compiles, counted and timed: a compile met while serving stalls every stream for its length.

Triton compiles a kernel the first time it meets a new specialisation of it: new constexprs (tile
sizes), and new properties of its integer and pointer arguments (an int equal to 1, an int or a
pointer divisible by 16). A compile takes 0.2-3 s on the host, and the engine's thread waits for it
with every running request. ``watch()`` installs Triton's compile hooks once a process and counts
each compile with its seconds; after ``serving()`` each is also logged with the kernel and the
specialisation that caused it, which is what a server log needs to show when a step stalled.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class CompileWatch:
    """The process's Triton compiles: how many, how long, and which were met after start-up."""

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0
        self.serving_compiles = 0
        self.serving_seconds = 0.0
        self.is_serving = False
        self._began: dict[Any, float] = {}
        self._lock = threading.Lock()

    def began(self, key: Any) -> None:
        with self._lock:
            self._began[_hashable(key)] = time.perf_counter()

    def ended(self, key: Any, name: str, spec: str) -> None:
        now = time.perf_counter()
        with self._lock:
            took = now - self._began.pop(_hashable(key), now)
            self.compiles += 1
            self.seconds += took
            if not self.is_serving:
                return
            self.serving_compiles += 1
            self.serving_seconds += took
        log.info("compiled kernel %s while serving in %.2f s: %s", name, took, spec[:400])

    def serving(self) -> None:
        """From now on compiles are serve-time stalls: logged one by one and counted apart."""
        self.is_serving = True

    def metrics(self) -> dict[str, float]:
        return {
            "kernel_compiles_total": self.compiles,
            "kernel_compile_seconds_total": self.seconds,
            "kernel_compiles_serving_total": self.serving_compiles,
            "kernel_compile_serving_seconds_total": self.serving_seconds,
        }


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        return repr(key)
    return key


WATCH = CompileWatch()
_installed = False


def watch() -> CompileWatch:
    """Install the compile hooks (once; a hook already set by someone else is still called)."""
    global _installed
    if _installed:
        return WATCH
    try:
        from triton import knobs
    except ImportError:  # no Triton (or an older one without knobs): nothing compiles to watch
        _installed = True
        return WATCH
    runtime = knobs.runtime
    if not (hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")):
        _installed = True  # a Triton without compile hooks: compiles go uncounted
        return WATCH
    before_cache, before_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_compile(*, key: Any, **kw: Any) -> bool | None:
        WATCH.began(key)
        return before_cache(key=key, **kw) if before_cache else None

    def on_compiled(*, key: Any, repr: str, fn: Any, **kw: Any) -> bool | None:
        WATCH.ended(key, getattr(fn, "name", "?"), repr)
        return before_post(key=key, repr=repr, fn=fn, **kw) if before_post else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_compile, on_compiled
    _installed = True
    return WATCH


__all__ = ["WATCH", "CompileWatch", "watch"]
