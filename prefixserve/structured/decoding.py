"""One engine's structured decoding: grammars, a matcher per constrained sequence, each step's mask.

Its request rule (``rule.StructuredOutputsRule``) calls ``admit`` when a constrained request arrives
(compiling its grammar, or refusing it), ``advance`` as a step's tokens arrive (each sequence's
matcher takes the token put in place), and ``bitmask`` (``gated_mask`` where the device waits) when
a step's sampling is issued. A request's matchers are its rule state (``Request.rules[MATCHERS]``:
sample index -> matcher handle); one is made at the sequence's first sampled token, so the n samples
of a request (split off at the end of the prompt) each get their own, and a preempted sequence keeps
its own across the recompute.

The matchers live in a process of their own (``matcher_process``): xgrammar's calls drop the GIL,
but a thread of this process that made them waited for the GIL between calls while the engine's
thread ran Python, so a small model's constrained steps waited on the fill. Here a step's accept and
fill are one message to the child; it writes the mask into the step's shared host slot.

Launched ahead, the tokens of step t arrive while the forward of step t+1 runs, and step t+1's
sampling waits for its mask. ``advance`` given step t+1's samplers sends the accept and that mask's
fill at once: the engine's thread places the tokens, reports, schedules and assembles step t+2
meanwhile, then ``bitmask`` reads which rows the child filled and the sampling of t+1 goes out just
ahead of the forward of t+2, so the GPU is not left idle by the fill. On a host-bound step the engine
takes step t's tokens as soon as its sampling is out, before it issues the forward of t+1
(``Engine._take_tokens``): the samplers of t+1 are not known yet, so the fill is sent for step t's
own, the guess that holds for most decode steps; ``bitmask`` takes it for a step whose samplers are
the same sequences in the same order, and fills anew for any other. Without launch-ahead the accept
is sent alone and the fill is asked for when the step samples.

On a GPU whose kernels can read the pinned host slots, the engine's thread never waits for the
child (``gate.py``): the fill goes out as above, with a slot and a number of its own, and the step's
sampling, issued as before once the tokens ahead of it are placed, waits for it on the device (a
kernel spinning on the slot's flag) instead of the host waiting for the answer and copying the mask.
A fill is always sent before the sampling that waits for it is issued, so no wait of the host for
the device (a graph's capture, an allocation) can hold up the fill the device waits for. ``advance``
checks, as each gated step's tokens arrive, that its wait saw its own fill.
"""

from __future__ import annotations

import operator
import os
import platform
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.sampling.sampler import SampleFuture
from prefixserve.sampling.structured_outputs import StructuredOutputs
from prefixserve.sequence import Sequence
from prefixserve.structured.bitmask import StepBitmasks, StepMask
from prefixserve.structured.gate import FillGate
from prefixserve.structured.grammars import GrammarCache
from prefixserve.structured.matcher_process import MatcherProcess
from prefixserve.triton_support import triton_available

MATCHERS = "structured_outputs"  # the rule's name; Request.rules[MATCHERS]: sample index -> matcher handle
NUMBERS = 2**31 - 1  # gated fills are numbered 1 .. NUMBERS, then from 1 again
GATED = True  # the device waits for a step's fill where it can (``gate.py``); tests and A/B runs: False


@dataclass(slots=True)
class GatedFill:
    """A gated step's fill: its samplers, the slot and the fill's number."""

    samplers: list[Sequence]
    slot: int
    number: int


@dataclass(slots=True)
class GatedMask:
    """A gated step's mask (a ``LogitsMask``): applied on the device once its fill's flag is set."""

    fill: GatedFill
    decoding: StructuredDecoding  # (its masks and gate)

    def apply(self, logits: torch.Tensor) -> None:
        d, f = self.decoding, self.fill
        d.masks.read(logits, f.slot, f.number, len(f.samplers), d.gate)

    def choose(self, logits: torch.Tensor) -> SampleFuture:
        """Greedy rows alone (``rules.ChoosingMask``): the mask and the argmax in one launch."""
        d, f = self.decoding, self.fill
        return d.masks.choose(logits, f.slot, f.number, len(f.samplers), d.gate)


class StructuredDecoding:
    """Grammars compiled once per spec (checked here, matched in the child), handles of the matchers
    per sequence, and the host side of each step's mask."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: set[int],
        threads: int | None = None,
        device: torch.device | str = "cpu",
        rows: int = 64,
        matchers: MatcherProcess | None = None,
    ) -> None:
        """``matchers``: a matcher process started ahead (else one is started now)."""
        if threads is None:
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.grammars = GrammarCache(tokenizer, vocab_size, sorted(eos_ids), max(2, threads))
        self.words = -(-vocab_size // 32)
        self.masks = StepBitmasks(self.words, device, rows)  # ``rows``: the most sample rows a step has
        self.matchers = matchers if matchers is not None else MatcherProcess()
        self.matchers.setup(self.grammars.info.serialize_json(), vocab_size, threads)
        # a step whose fill was sent ahead: its samplers and its host slot
        self._job: tuple[list[Sequence], torch.Tensor | None] | None = None
        self.fills_ahead = 0  # fills sent with the tokens before their step (a guess may miss)
        # the samplers of the last fill and their (row, sequence, key) rows: what the step's tokens
        # advance (``advance``), and the next step's rows where its samplers are the same (``_rows``)
        self._last_rows: tuple[list[Sequence], list[tuple[int, Sequence, int]]] | None = None
        self._pairs: tuple[list[Any], list[tuple[int, int]]] | None = None  # those rows' (row, key)s
        gated = GATED and self.masks.device_readable and triton_available() and _stores_in_order()
        self.gate = FillGate(self.masks.device) if gated else None  # None: the host waits (``bitmask``)
        self._number = 0  # the last gated fill's number (``_next_number``)
        self._ahead: GatedFill | None = None  # a gated fill sent with the tokens before its step
        self._issued: deque[GatedFill] = deque()  # gated steps whose tokens have not come back

    @property
    def gated(self) -> bool:
        """Does the device wait for each step's fill (``gate.py``), so no sampling waits on the host?
        (Not after slots regrown for a larger step could not be pinned: the host's wait again.)"""
        return self.gate is not None and self.masks.device_readable

    def admit(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` now (or find it compiled): a bad one raises ValueError before queueing;
        the matcher process compiles its own meanwhile."""
        if self.grammars.cached(spec) is None:
            self.grammars.put(spec, self.grammars.compile(spec))
            self.matchers.compile(spec)

    @staticmethod
    def constrained(samplers: list[Sequence]) -> bool:
        """Does any of a step's sampling sequences follow a grammar?"""
        return any(s.request.params.structured_outputs is not None for s in samplers)

    def advance(
        self,
        samplers: list[Sequence],
        indices: list[int],
        tokens: list[int],
        pending: dict[Sequence, list[Any]],
        then: list[Sequence] | None = None,
    ) -> None:
        """Each constrained sampler's matcher takes its token, where ``Scheduler.update_from_output``
        will put it in place (so before that call: the same test on ``pending``); with ``then``, the
        samplers of a step launched ahead whose sampling waits (or the guess of them, ``samplers``
        itself), their mask's fill is sent with it, taken by ``bitmask`` (``gated_mask``) for the same
        sequences.
        """
        self._job = None  # a job not taken by its step is dropped (its answer is read first)
        keys, accepted = self._accepts(samplers, indices, tokens, pending)
        if self.gated:
            self._ahead = None
            if then is not None:  # (``accepts`` alone where ``then`` has no constrained row)
                self._ahead = self._send_gated(then, (keys, accepted))
                self.fills_ahead += self._ahead is not None
            elif keys:
                self.matchers.step((keys, accepted), None)
            self._check_gated(samplers)
            return
        if then is not None:
            self._job = (then, self._send_fill(then, (keys, accepted)))
            self.fills_ahead += self._job[1] is not None
        elif keys:
            self.matchers.step((keys, accepted), None)

    def _accepts(
        self,
        samplers: list[Sequence],
        indices: list[int],
        tokens: list[int],
        pending: dict[Sequence, list[Any]],
    ) -> tuple[list[int], list[int]]:
        """(matcher keys, tokens) of the constrained samplers whose token is put in place now."""
        keys, accepted = [], []
        last = self._last_rows
        filled = last[1] if last is not None and _same(last[0], samplers) else None
        if filled is None:  # rows not filled through here: each sampler's handle, if it has one
            filled = []
            for i, seq in enumerate(samplers):
                handle = seq.request.rules.get(MATCHERS, {}).get(seq.index)
                if handle is not None:
                    filled.append((i, seq, handle.key))
        for i, seq, key in filled:
            waiting = pending.get(seq)
            if waiting and waiting[0][0] == indices[i] and not seq.is_finished:
                keys.append(key)
                accepted.append(tokens[i])
        return keys, accepted

    def gated_mask(self, samplers: list[Sequence]) -> GatedMask | None:
        """The step's mask, waited for on the device (``gated``): the fill sent ahead with the tokens
        before it, for the same sequences, else sent now (every token before the step's is placed by
        then). None: no row is constrained."""
        fill, self._ahead = self._ahead, None
        if fill is None or not _same(fill.samplers, samplers):
            fill = self._send_gated(samplers, ([], []))
            if fill is None:
                return None
        fill.samplers = samplers  # its step's own list: ``_check_gated`` finds it by identity
        self._issued.append(fill)
        return GatedMask(fill, self)

    def _send_gated(self, samplers: list[Sequence], accepts: tuple[list[int], list[int]]) -> GatedFill | None:
        """``_send_fill``, gated: the fill under a new number, answered by the slot's flag alone."""
        job = self._next_fill(samplers, accepts)
        if job is None:
            return None
        if not self.masks.device_readable:  # regrown, not pinned: this step fails, the next is the host's
            raise RuntimeError("structured decoding's mask slots grew and could not be pinned")
        fill = GatedFill(samplers, self.masks.slot, self._next_number())
        self.matchers.step(accepts, job, fill.number)
        return fill

    def _next_number(self) -> int:
        """A gated fill's number: 1 .. 2**31 - 1, then 1 again (the flagged argmax takes it as a 32-bit
        kernel argument; a slot's flag is rewritten every other fill, so a number met again after
        2**31 fills is never a stale flag's)."""
        self._number = self._number % NUMBERS + 1
        return self._number

    def _check_gated(self, samplers: list[Sequence]) -> None:
        """The tokens of ``samplers``' step arrived: if a gated fill was theirs, did its wait see it?
        Fills before it belonged to steps whose tokens never came (they failed)."""
        issued = self._issued
        while len(issued) > 8:  # fills of failed steps, whose tokens never came
            issued.popleft()
        for k, fill in enumerate(issued):
            if fill.samplers is samplers:
                for _ in range(k + 1):
                    issued.popleft()
                try:
                    self.gate.check(fill.slot, fill.number)
                except TimeoutError as exc:  # a hung (or dead) child: replaced, its other waits released
                    self.matchers.lose(str(exc))
                    raise RuntimeError(str(exc)) from None
                return

    def _send_fill(
        self, samplers: list[Sequence], accepts: tuple[list[int], list[int]]
    ) -> torch.Tensor | None:
        """Send ``accepts`` and the fill of each constrained sampler still running (a matcher is made
        at its first); the host slot the child fills (None: no row to fill, only ``accepts`` sent)."""
        job = self._next_fill(samplers, accepts)
        if job is None:
            return None
        self.matchers.step(accepts, job)
        return self.masks.shared.tensor[job[1]][: job[2]]

    def _next_fill(
        self, samplers: list[Sequence], accepts: tuple[list[int], list[int]]
    ) -> tuple[Any, int, int, list[tuple[int, int]]] | None:
        """The fill of ``samplers``' constrained rows, (slots, slot, n, [(row, key)]), in the next slot
        (once its last read is done); None, with ``accepts`` sent alone: no constrained row."""
        rows = self._rows(samplers)
        if not rows:
            if accepts[0]:
                self.matchers.step(accepts, None)
            return None
        slot = self.masks.reserve(len(samplers))
        pairs = self._pairs
        if pairs is None or pairs[0] is not rows:  # (rows unchanged: the same list, sent as "the last")
            pairs = self._pairs = rows, [(i, key) for i, _, key in rows]
        return self.masks.shared, slot, len(samplers), pairs[1]

    def _rows(self, samplers: list[Sequence]) -> list[tuple[int, Sequence, int]]:
        """(row, sequence, matcher key) of each constrained sampler still running, a matcher made at its
        first. A step whose samplers are the last fill's, in order (most decode steps), reuses its rows:
        a Python pass over every sampler's request is most of this call's time at 64 rows."""
        last = self._last_rows
        if last is not None and _same(last[0], samplers):
            rows = last[1]
            if any(row[1].is_finished for row in rows):  # (most steps: none, and the list is kept)
                rows = [row for row in rows if not row[1].is_finished]
        else:
            rows = []
            for i, seq in enumerate(samplers):
                spec = seq.request.params.structured_outputs
                if spec is None or seq.is_finished:
                    continue
                held = seq.request.rules.setdefault(MATCHERS, {})  # made at intake (``rule.py``)
                handle = held.get(seq.index)
                if handle is None:
                    handle = held[seq.index] = self.matchers.matcher(spec)
                rows.append((i, seq, handle.key))
        self._last_rows = (samplers, rows)
        return rows

    def bitmask(self, samplers: list[Sequence]) -> StepMask | None:
        """The step's mask on the host, int32 [len(samplers), words], and the rows it constrains (None:
        no row is): the fill sent ahead for this step's samplers, else sent now. Every constrained
        sequence's matcher has seen all its tokens but the one sampled now. Only constrained rows are
        filled and masked: rows of sequences that finished meanwhile (launch-ahead) stay unmasked,
        their token is dropped.
        """
        job, self._job = self._job, None
        if job is None or not _same(job[0], samplers):
            job = (samplers, self._send_fill(samplers, ([], [])))
        if job[1] is None:  # no constrained row
            return None
        rows = [r for r in self.matchers.rows() if not samplers[r].is_finished]
        return StepMask(job[1], rows, self.masks) if rows else None

    def mask(self, samplers: list[Sequence]) -> StepMask | GatedMask | None:
        """The step's mask: waited for on the device where it can (``gated_mask``), else on the host
        (``bitmask``)."""
        return self.gated_mask(samplers) if self.gated else self.bitmask(samplers)

    def close(self) -> None:
        """End the matcher process; unpin the host slots once no kernel reads them (a device still
        waiting for a fill is released first)."""
        self.matchers.close()
        self.matchers.release_waits()
        self.masks.wait()
        self.masks.close()


def _stores_in_order() -> bool:
    """Does this host make a process's stores visible in program order (x86), so the matcher process's
    flag is never seen before its rows (Python has no store barrier for the others)?"""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _same(a: list[Sequence], b: list[Sequence]) -> bool:
    """The same sequences in the same order (a step's samplers against a fill's)."""
    return a is b or (len(a) == len(b) and all(map(operator.is_, a, b)))


__all__ = ["MATCHERS", "StructuredDecoding"]
