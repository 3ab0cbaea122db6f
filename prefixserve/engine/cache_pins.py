"""Prompt caching with TTLs: the blocks up to a request's cache breakpoints held for a while.

Anthropic's ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` marks where a prompt's
reusable prefix ends. The prefix cache already serves any repeated prefix, but evicts by LRU: under
pressure a breakpoint's prefix can be gone a second later. Here a finished request's breakpoints
(``Request.cache_pins``: prompt tokens, seconds) each hold the full blocks up to them for the TTL;
a later request naming the same breakpoint refreshes it. Pinned blocks stay within a budget
(``EngineConfig.cache_control_fraction`` of the pool): a request whose breakpoints would pass it is
still answered, its breakpoints not honoured (``Request.cache_pins_refused``, checked at intake;
requests finishing together may still find the budget spent, and pin what fits). Expired pins are let
go as requests arrive and leave: an idle engine holds them longer, which costs nobody blocks.

``cache_creation_input_tokens`` (Anthropic's usage) is what a request wrote up to its last honoured
breakpoint: those tokens less the ones it read from the cache.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixserve.sequence import Request

TTLS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's two TTLs
MAX_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control


@dataclass(slots=True)
class _Pin:
    digests: list[bytes]
    blocks: list[int]  # held once per pin: full blocks, then the sliding pages a hit needs
    expires: float


class CachePins:
    """The breakpoints' pins over one engine's block pool."""

    def __init__(self, blocks: Any, budget_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.blocks, self.pool, self.budget = blocks, blocks.pool, budget_blocks
        self.clock = clock
        self._pins: dict[bytes, _Pin] = {}  # by the breakpoint's last block digest
        self._expiry: list[tuple[float, bytes]] = []  # (expiry, key), stale entries skipped
        self._held: dict[bytes, int] = {}  # block digest -> pins covering it

    @property
    def pinned_blocks(self) -> int:
        """Distinct full blocks held by pins."""
        return len(self._held)

    def admit(self, req: Request) -> None:
        """At intake: drop the request's breakpoints if the blocks they would add pass the budget."""
        if not req.cache_pins:
            return
        self.expire()
        seq, bs = req.sequences[0], self.blocks.block_size
        longest = max(tokens for tokens, _ in req.cache_pins) // bs
        digests = self.blocks.digests(seq, min(longest, len(seq.token_ids) // bs))
        new = sum(1 for d in digests if d not in self._held)
        if self.pinned_blocks + new > self.budget:
            req.cache_pins, req.cache_pins_refused = [], True

    def retire(self, req: Request) -> None:
        """A finished request: hold (or refresh) the blocks up to each breakpoint its prompt filled."""
        self.expire()
        if not req.cache_pins or req.error is not None:
            return
        seq, bs, now = req.sequences[0], self.blocks.block_size, self.clock()
        written = 0
        for tokens, ttl in sorted(req.cache_pins):
            n = min(tokens, req.num_prompt_tokens) // bs
            if n == 0:
                continue
            digests = self.blocks.digests(seq, n)
            if not self._pin(digests, now + ttl):
                break  # evicted already, or the budget is spent: the longer ones cannot hold either
            written = n * bs
        req.cache_written_tokens = max(0, written - req.num_cached_tokens)

    def _pin(self, digests: list[bytes], expires: float) -> bool:
        key = digests[-1]
        pin = self._pins.get(key)
        if pin is not None:  # the same breakpoint again: refreshed
            pin.expires = max(pin.expires, expires)
            heapq.heappush(self._expiry, (pin.expires, key))
            return True
        new = [d for d in digests if d not in self._held]
        if self.pinned_blocks + len(new) > self.budget:
            return False
        found = self.pool.lookup(digests)
        if len(found) != len(digests):
            return False
        try:
            tail = self.blocks.hold_sliding_tail(digests)
        except RuntimeError:  # a sliding model's pages a hit needs are gone: no pin
            return False
        self.pool.acquire(found)
        for d in digests:
            self._held[d] = self._held.get(d, 0) + 1
        self._pins[key] = _Pin(digests, found + tail, expires)
        heapq.heappush(self._expiry, (expires, key))
        return True

    def expire(self) -> int:
        """Let go of the pins past their time; returns how many."""
        now, count = self.clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            when, key = heapq.heappop(self._expiry)
            pin = self._pins.get(key)
            if pin is None or pin.expires != when:
                continue  # refreshed since (a later entry stands), or gone
            del self._pins[key]
            for d in pin.digests:
                left = self._held[d] - 1
                if left:
                    self._held[d] = left
                else:
                    del self._held[d]
            self.pool.release(pin.blocks)
            count += 1
        return count

    def clear(self) -> None:
        """Let go of every pin (a cache reset)."""
        for pin in self._pins.values():
            self.pool.release(pin.blocks)
        self._pins.clear()
        self._expiry.clear()
        self._held.clear()


def check_pins(pins: object) -> list[tuple[int, float]]:
    """ValueError for breakpoints that are not (prompt tokens >= 0, seconds > 0) pairs, or too many."""
    if not isinstance(pins, list | tuple):
        raise ValueError("cache_pins must be a list of (prompt tokens, seconds) pairs")
    out = []
    for p in pins:
        if not isinstance(p, list | tuple) or len(p) != 2:
            raise ValueError(f"a cache pin is a (prompt tokens, seconds) pair, got {p!r}")
        tokens, ttl = p
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"a cache pin's prompt tokens must be an integer >= 0, got {tokens!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
            raise ValueError(f"a cache pin's seconds must be > 0, got {ttl!r}")
        out.append((tokens, float(ttl)))
    if len(out) > MAX_BREAKPOINTS:
        raise ValueError(f"at most {MAX_BREAKPOINTS} cache breakpoints, got {len(out)}")
    return out


__all__ = ["MAX_BREAKPOINTS", "TTLS", "CachePins", "check_pins"]
