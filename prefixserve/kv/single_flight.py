"""One load per key at a time: callers that ask for a key while its load runs wait for that load.

Two requests needing the same stored module at once must not read and copy it twice (twice the disk
and PCIe traffic, for the same bytes). The first caller runs the load; the others attach to it and
get its result, or its exception (so on failure every one of them falls back, e.g. to recompute).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Flight(Generic[T]):
    __slots__ = ("done", "error", "result", "waiters")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.waiters = 0  # callers that attached to this load rather than running it


class SingleFlight(Generic[T]):
    """Deduplicates concurrent calls by key (like Go's ``singleflight``); nothing is cached after."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, _Flight[T]] = {}
        self.shared = 0  # calls answered by another caller's load

    def run(self, key: Hashable, load: Callable[[], T]) -> T:
        """``load()``'s result, run once for all callers of ``key`` that overlap it."""
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
            else:
                flight.waiters += 1
                self.shared += 1
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.result  # type: ignore[return-value]
        try:
            flight.result = load()
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()
        return flight.result

    def in_flight(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._flights
