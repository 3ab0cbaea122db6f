"""One engine's structured decoding: grammars, a matcher per constrained sequence, each step's mask.

The engine calls ``admit`` when a constrained request arrives (compiling its grammar, or refusing
it), ``bitmask`` when a step's sampling is issued, and the scheduler advances each sequence's
matcher (``Sequence.grammar``) as its sampled token is put in place. A matcher is made at the
sequence's first sampled token, so the n samples of a request (split off at the end of the prompt)
each get their own, and a preempted sequence keeps its own across the recompute.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from prefixserve.sampling.structured_outputs import StructuredOutputs
from prefixserve.sequence import Sequence
from prefixserve.structured.bitmask import StepBitmasks, StepMask
from prefixserve.structured.grammars import GrammarCache


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

        # with bounded repeats folded (``repeats``) a row's fill takes ~10-20 us: threads pay off on a
        # big host only, and on a 2-core one they fight the engine's own thread
        # (``benchmarks/probes/structured_fill.py``)
        if threads is None:
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.grammars = GrammarCache(tokenizer, vocab_size, sorted(eos_ids), max(2, threads))
        self.words = -(-vocab_size // 32)
        self.masks = StepBitmasks(self.words, device, rows)  # ``rows``: the most sample rows a step has
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._matcher_cls = xgr.GrammarMatcher

    def admit(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` now (or find it compiled): a bad one raises ValueError before queueing."""
        self.grammars.get(spec)

    @staticmethod
    def constrained(samplers: list[Sequence]) -> bool:
        """Does any of a step's sampling sequences follow a grammar?"""
        return any(s.request.params.structured_outputs is not None for s in samplers)

    def bitmask(self, samplers: list[Sequence]) -> StepMask | None:
        """The step's mask on the host, int32 [len(samplers), words], and the rows it constrains (None:
        no row is). Every constrained sequence's matcher has seen all its tokens but the one sampled now.
        Only constrained rows are filled and masked: rows of sequences that finished meanwhile
        (launch-ahead) stay unmasked, their token is dropped.
        """
        rows: list[int] = []
        matchers = []
        for i, seq in enumerate(samplers):
            spec = seq.request.params.structured_outputs
            if spec is None or seq.is_finished:
                continue
            matcher = seq.grammar
            if matcher is None:
                matcher = seq.grammar = self._matcher_cls(self.grammars.get(spec))
            if matcher.is_terminated():  # ended (ignore_eos): what follows is free
                continue
            rows.append(i)
            matchers.append(matcher)
        if not rows:
            return None
        mask = self.masks.host(len(samplers))
        self._batch.batch_fill_next_token_bitmask(matchers, mask, rows)
        return StepMask(mask, rows, self.masks)


__all__ = ["StructuredDecoding"]
