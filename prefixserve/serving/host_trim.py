"""A server process gives the heap memory a burst freed back to the OS once it goes idle (glibc).

glibc keeps freed memory in its arenas, one per thread that allocated it (up to 8 per core): a
document burst's 128 prompts of 8K tokens tokenized on the HTTP process's worker threads leaves every
worker's arena as large as its share of the burst was, though nothing in it is live any more (on a
2-core VM, 128 x 8K tokens tokenized on 20 threads: 171 MiB of 271 MiB of heap free after the burst,
RSS 425 MiB; trimmed after each burst, RSS 324-333 MiB). The resident memory then tracks the largest
burst each arena has seen (on this VM the level was reached at the first burst; with more cores,
more arenas reach theirs one burst at a time), not what is live. ``malloc_trim(0)`` hands every
arena's free pages back (madvise); it walks the free chunks (15 ms for those 171 MiB) and the next
burst faults its pages in again, so it runs only when the process has nothing in flight, after work,
at most once per ``MIN_INTERVAL_S``. In ``benchmarks/soak.py --device cpu`` (engine process on,
128-request bursts of 3.5K-token documents and chats, 2-core VM) the HTTP process's RSS was 330 MiB
(median of bursts 4-29) instead of 355, tokens/s unchanged.

Before the trim, a full pass of Python's cyclic GC: a finished request and its sequences reference
each other, so they are freed only by a cyclic pass, and ``gc_tuning.tune_gc`` makes those rare (no
pass stalls a decode step). On an H100 soak (``benchmarks/soak.py``, 100 bursts) the engine process's
RSS rose about 20 MiB a burst for about 12 bursts and fell back 200-250 MiB when a full pass ran:
RSS between 2.05 and 2.37 GiB with no trend, but the first and last bursts' medians 7% apart. Idle
is when a pass costs no step anything.

Not where ``cpu_malloc.keep_freed_memory`` holds freed memory on purpose (a CPU engine in this
process keeps its activations in the heap between steps), and nowhere but glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import math
import sys
import time
from collections.abc import Callable

from prefixserve.worker import cpu_malloc

MIN_INTERVAL_S = 1.0  # a process trims at most this often
POLL_S = 1.0  # how often the HTTP process's task looks whether it is idle


def glibc_trim() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of this process's C library, or None where it has none (not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's malloc_trim does nothing useful)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class IdleTrim:
    """Trims when told the process is idle, if it was busy since the last trim and ``min_interval_s``
    has passed. ``busy`` and ``idle`` may be called from any thread (a trim racing another costs a
    second walk, nothing more)."""

    def __init__(
        self,
        min_interval_s: float = MIN_INTERVAL_S,
        trim: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        collect: Callable[[], object] = gc.collect,
    ) -> None:
        self.min_interval_s, self.clock, self._collect = min_interval_s, clock, collect
        self._trim = trim if trim is not None else glibc_trim()
        self._last = -math.inf
        self._worked = False
        self.trims = 0

    def busy(self) -> None:
        """Work was done (requests came or ran): the next idle moment may trim."""
        self._worked = True

    def idle(self) -> bool:
        """The process has nothing in flight: collect cyclic garbage and trim, if due. True when it did."""
        if not self._worked or cpu_malloc.holds_freed_memory():
            return False
        now = self.clock()
        if now - self._last < self.min_interval_s:
            return False
        self._last, self._worked = now, False
        self._collect()  # the finished requests' cycles first: their memory is then free to trim
        if self._trim is not None:
            self._trim()
        self.trims += 1
        return True


async def trim_when_idle(
    in_flight: Callable[[], int],
    requests: Callable[[], float],
    trim: IdleTrim,
    period: float = POLL_S,
    observe: Callable[[float], object] | None = None,
) -> None:
    """The HTTP process's side (run as a task for the app's lifetime): every ``period`` seconds, a
        process that took requests since the last look (``requests``: a count that grows with them) or
        has some in flight is busy; one with none in flight is idle. The trim runs on a worker thread;
    ``observe`` gets each trim's seconds."""
    seen = requests()
    while True:
        await asyncio.sleep(period)
        count = requests()
        if count != seen or in_flight():
            seen = count
            trim.busy()
        if not in_flight():
            began = time.perf_counter()
            if await asyncio.to_thread(trim.idle) and observe is not None:
                observe(time.perf_counter() - began)  # seconds it took (its GC pass held the GIL)


__all__ = ["MIN_INTERVAL_S", "POLL_S", "IdleTrim", "glibc_trim", "trim_when_idle"]
