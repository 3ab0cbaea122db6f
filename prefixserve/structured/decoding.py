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
from prefixserve.structured.grammars import GrammarCache


class StructuredDecoding:
    """Grammars compiled once per spec, matchers per sequence, and the host side of each step's mask."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_ids: set[int], threads: int | None = None
    ) -> None:
        import xgrammar as xgr

        # the mask's fill is the host's longest part of a constrained step (docs/benchmarks/structured_gpu):
        # threads hide it behind the GPU's forward
        if threads is None:
            threads = max(2, min(8, (os.cpu_count() or 2) // 2))
        self.grammars = GrammarCache(tokenizer, vocab_size, sorted(eos_ids), threads)
        self.words = -(-vocab_size // 32)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._matcher_cls = xgr.GrammarMatcher

    def admit(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` now (or find it compiled): a bad one raises ValueError before queueing."""
        self.grammars.get(spec)

    @staticmethod
    def constrained(samplers: list[Sequence]) -> bool:
        """Does any of a step's sampling sequences follow a grammar?"""
        return any(s.request.params.structured_outputs is not None for s in samplers)

    def bitmask(self, samplers: list[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """The step's mask on the host, int32 [len(samplers), words], and the rows it constrains (None:
        no row is). Every constrained sequence's matcher has seen all its tokens but the one sampled now.
        Rows of sequences that finished meanwhile (launch-ahead) stay all-allowed: their token is dropped.
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
        mask = torch.full((len(samplers), self.words), -1, dtype=torch.int32)
        self._batch.batch_fill_next_token_bitmask(matchers, mask, rows)
        return mask, rows


__all__ = ["StructuredDecoding"]
