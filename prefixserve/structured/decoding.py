"""One engine's structured decoding: grammars, a matcher per constrained sequence, each step's mask.

Its request rule (``rule.StructuredOutputsRule``) calls ``admit`` when a constrained request arrives
(compiling its grammar, or refusing it), ``advance`` as a step's tokens arrive (each sequence's
matcher takes the token put in place), and ``bitmask`` when a step's sampling is issued. A request's
matchers are its rule state (``Request.rules[MATCHERS]``: sample index -> matcher); one is made at
the sequence's first sampled token, so the n samples of a request (split off at the end of the
prompt) each get their own, and a preempted sequence keeps its own across the recompute.

Launched ahead, the tokens of step t arrive while the forward of step t+1 runs, and step t+1's
sampling waits for its mask. ``advance`` given step t+1's samplers hands the accept and that mask's
fill to a worker thread (xgrammar drops the GIL in both): the engine's thread places the tokens,
reports, schedules and assembles step t+2 meanwhile, then ``bitmask`` takes the mask and the sampling
of t+1 goes out just ahead of the forward of t+2, so the GPU is not left idle by the fill.

xgrammar (through tvm-ffi) drops the GIL in every call, however small, and a thread that dropped it
waits to take it back while the engine's thread runs Python: up to a switch interval (5 ms by
default) a call. So the worker makes two calls a step, the accept and the fill, and none a row: which
matchers have ended is kept here (a matcher ends by accepting a stop token, so only such a token's
row asks xgrammar), and the accept's per-row answers, which xgrammar's wrapper reads back a call a
row, are not read (``benchmarks/probes/structured_fill.py --gil``, 2-core CPU: beside a thread busy
in Python, the 64-row job took 150-230 ms with the ~190 calls a row it made before, 11-16 ms with
two, 0.3-0.8 ms alone; at the server's 0.5 ms switch interval 10-22 ms and 1.6-2.0 ms).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from prefixserve.sampling.structured_outputs import StructuredOutputs
from prefixserve.sequence import Sequence
from prefixserve.structured.bitmask import StepBitmasks, StepMask
from prefixserve.structured.grammars import GrammarCache

MATCHERS = "structured_outputs"  # the rule's name; Request.rules[MATCHERS]: sample index -> matcher


class StructuredDecoding:
    """Grammars compiled once per spec, matchers per sequence, and the host side of each step's mask."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: set[int],
        threads: int | None = None,
        device: torch.device | str = "cpu",
        rows: int = 64,
    ) -> None:
        import xgrammar as xgr

        if threads is None:
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.grammars = GrammarCache(tokenizer, vocab_size, sorted(eos_ids), max(2, threads))
        self.words = -(-vocab_size // 32)
        self.masks = StepBitmasks(self.words, device, rows)  # ``rows``: the most sample rows a step has
        # a step's fill on one thread unless that would take long (``FillThreads``)
        self._fills = FillThreads(xgr, threads)
        self._matcher_cls = _matcher_class(xgr)
        self._accept = _batch_accept(xgr)
        self._stops = frozenset(eos_ids)  # the grammars' stop tokens (``GrammarCache``)
        self._worker: ThreadPoolExecutor | None = None  # made at the first step launched ahead
        # the worker's job: the samplers whose mask it fills, and the mask to come
        self._job: tuple[list[Sequence], Future[StepMask | None]] | None = None

    def admit(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` now (or find it compiled): a bad one raises ValueError before queueing."""
        self.grammars.get(spec)

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
        samplers of a step launched ahead whose sampling waits, the accept and their mask's fill run
        on the worker thread, taken by ``bitmask(then)``. Without, the accept runs now.
        """
        self._join()
        matchers, accepted = [], []
        for i, seq in enumerate(samplers):
            held_matchers = seq.request.rules.get(MATCHERS)
            grammar = held_matchers.get(seq.index) if held_matchers else None
            if grammar is None:
                continue
            held = pending.get(seq)
            if held and held[0][0] == indices[i] and not seq.is_finished:
                matchers.append(grammar)
                accepted.append(tokens[i])
        if then is None:
            self._accept_live(matchers, accepted)
            return
        candidates = self._candidates(then)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="prefixserve-grammar")
        job = self._worker.submit(self._accept_and_fill, matchers, accepted, len(then), candidates)
        self._job = (then, job)

    def _accept_live(self, matchers: list[Any], tokens: list[int]) -> None:
        """Matchers that have not ended take their tokens (one call for all); one that took a stop
        token is asked whether it ended (the only call a row, once in a sequence's life)."""
        live = [k for k, m in enumerate(matchers) if not m.ended]
        if not live:
            return
        self._accept([matchers[k] for k in live], [tokens[k] for k in live])
        for k in live:
            if tokens[k] in self._stops and matchers[k].is_terminated():
                matchers[k].ended = True

    def _candidates(self, samplers: list[Sequence]) -> list[tuple[int, Any]]:
        """(row, matcher) of each constrained sampler still running; a matcher is made at its first."""
        out = []
        for i, seq in enumerate(samplers):
            spec = seq.request.params.structured_outputs
            if spec is None or seq.is_finished:
                continue
            matchers = seq.request.rules.setdefault(MATCHERS, {})  # made at intake (``rule.py``)
            matcher = matchers.get(seq.index)
            if matcher is None:
                matcher = matchers[seq.index] = self._matcher_cls(self.grammars.get(spec))
            out.append((i, matcher))
        return out

    def _fill(self, n: int, candidates: list[tuple[int, Any]]) -> StepMask | None:
        """The mask of ``n`` sample rows, the candidates' rows filled (those whose matcher has ended,
        ignore_eos, are free)."""
        live = [(i, m) for i, m in candidates if not m.ended]
        if not live:
            return None
        rows = [i for i, _ in live]
        mask = self.masks.host(n)
        self._fills.fill([m for _, m in live], mask, rows)
        return StepMask(mask, rows, self.masks)

    def _accept_and_fill(
        self, matchers: list[Any], tokens: list[int], n: int, candidates: list[tuple[int, Any]]
    ) -> StepMask | None:
        self._accept_live(matchers, tokens)
        return self._fill(n, candidates)

    def _join(self) -> StepMask | None:
        """The worker's job done (its exception raised here), and its mask."""
        if self._job is None:
            return None
        job, self._job = self._job[1], None
        return job.result()

    def bitmask(self, samplers: list[Sequence]) -> StepMask | None:
        """The step's mask on the host, int32 [len(samplers), words], and the rows it constrains (None:
        no row is): the worker's if it filled this step's, else filled now. Every constrained
        sequence's matcher has seen all its tokens but the one sampled now. Only constrained rows are
        filled and masked: rows of sequences that finished meanwhile (launch-ahead) stay unmasked,
        their token is dropped.
        """
        mine = self._job is not None and self._job[0] is samplers
        mask = self._join()
        if not mine:
            return self._fill(len(samplers), self._candidates(samplers))
        if mask is not None:  # finished while the worker filled: left unmasked, as if filled now
            mask.rows = [r for r in mask.rows if not samplers[r].is_finished]
            if not mask.rows:
                return None
        return mask


class FillThreads:
    """Which of xgrammar's batch matchers fills a step's mask: one thread, or ``threads``.

    With bounded repeats folded (``repeats``) a row's fill takes ~3-7 us (SmolLM2's 49K entries and a
    128K BPE alike), so a 64-row step is ~0.3-0.4 ms on one thread, and handing it to more threads
    cost more than it saved: 2 threads took 0.46 against 0.31 ms for 64 rows (0.51 against 0.42 with
    the 128K BPE; 2-core CPU, ``benchmarks/probes/structured_fill.py``), and the 135M shape on an
    H200's 16-core host decoded at 0.79x unconstrained with one fill thread against 0.48-0.70x with 8
    (one run each, docs/guides/serving.md). Threads can pay off only where a step's fill is long: past
    ``FANOUT_ROWS`` rows (~1 ms on one thread). A row count, not a timed fill: the worker's wall time
    includes waiting for the GIL after xgrammar's call, which is the engine thread's, not the fill's."""

    FANOUT_ROWS = 128  # a step filling more rows than this goes to the threads

    def __init__(self, xgr: Any, threads: int) -> None:
        self.one = xgr.BatchGrammarMatcher(max_threads=1)
        self.many = xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else self.one

    def fill(self, matchers: list[Any], mask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``rows`` of ``mask`` from ``matchers`` (one a row), on one thread or many."""
        batch = self.many if len(rows) > self.FANOUT_ROWS else self.one
        batch.batch_fill_next_token_bitmask(matchers, mask, rows)


def _matcher_class(xgr: Any) -> Any:
    """xgrammar's ``GrammarMatcher`` that keeps whether it ended in Python (``ended``: asking
    xgrammar is a call, and so a GIL round trip, a row)."""

    class Matcher(xgr.GrammarMatcher):
        ended = False  # set by ``_accept_live`` once ``is_terminated`` says so

    return Matcher


def _batch_accept(xgr: Any) -> Any:
    """``batch_accept_token`` as one call into xgrammar: its Python wrapper reads the answers back a
    call a row (each dropping and taking the GIL), and they are not needed here; xgrammar's own wrapper
    where its internals differ."""
    core = getattr(getattr(xgr, "matcher", None), "_core", None)
    raw = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if raw is None:
        return xgr.BatchGrammarMatcher.batch_accept_token

    def accept(matchers: list[Any], tokens: list[int]) -> None:
        raw([m._handle for m in matchers], tokens, False)

    return accept


__all__ = ["MATCHERS", "FillThreads", "StructuredDecoding"]
