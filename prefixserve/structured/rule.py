"""Structured outputs as a request rule (``sampling/rules.py``): a grammar compiled at intake (or the
request refused), a matcher per sample as the request's state, each step's token bitmask as its mask.

The engine-wide part (``decoding.StructuredDecoding``: the grammar cache, the mask buffers, the
matcher process) is set up at the first constrained request, which is when xgrammar is imported: an
engine that never sees one never imports it (a GPU engine's matcher process is started with the
engine and imports it there). Until then every step hook returns at once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.rules import RequestRule, RuleRequest
from prefixserve.structured.decoding import MATCHERS, StructuredDecoding
from prefixserve.structured.matcher_process import MatcherProcess

if TYPE_CHECKING:
    from prefixserve.sequence import Sequence as EngineSequence
    from prefixserve.structured.bitmask import StepMask
    from prefixserve.structured.decoding import GatedMask


class StructuredOutputsRule(RequestRule):
    """``structured_outputs``: hooks over one ``StructuredDecoding``, made at the first constrained
    request with the tokenizer that request came with (``rows``: the most sample rows a step has)."""

    name = MATCHERS

    def __init__(self, vocab_size: int, eos_ids: set[int], device: torch.device | str, rows: int) -> None:
        self.vocab_size, self.eos_ids, self.device, self.rows = vocab_size, eos_ids, device, rows
        self.decoding: StructuredDecoding | None = None
        # a GPU engine starts its matcher process now (it imports xgrammar for seconds, beside the
        # engine's own start), so that its first constrained request does not wait for that
        ahead = torch.device(device).type == "cuda" and importlib.util.find_spec("xgrammar") is not None
        self._matchers = MatcherProcess() if ahead else None

    def set_up(self, tokenizer: Any) -> StructuredDecoding:
        """The engine's structured decoding, made now if it is not yet (xgrammar imported then)."""
        if self.decoding is None:
            self.decoding = StructuredDecoding(
                tokenizer, self.vocab_size, self.eos_ids, device=self.device, rows=self.rows,
                matchers=self._matchers,
            )  # fmt: skip
            self._matchers = None
        return self.decoding

    def close(self) -> None:
        """End the matcher process (started ahead, or structured decoding's)."""
        if self.decoding is not None:
            self.decoding.close()
        if self._matchers is not None:
            self._matchers.close()

    def check(self, params: SamplingParams, tokenizer: Any) -> None:
        """Compile the request's grammar now (or find it compiled): a bad spec raises ValueError."""
        if params.structured_outputs is not None:
            self.set_up(tokenizer).admit(params.structured_outputs)

    def admit(self, request: RuleRequest, tokenizer: Any) -> dict[int, Any] | None:
        """A constrained request's matchers, by sample index: made at each sample's first token."""
        return {} if request.params.structured_outputs is not None else None

    def waits(
        self, samplers: Sequence[EngineSequence], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> bool:
        """A grammar row's mask needs every token before the one it samples (sent to the matcher
        process before the sampling is issued, even where the device waits for the fill)."""
        return self.decoding is not None and self.decoding.constrained(samplers)

    def mask(
        self, samplers: Sequence[EngineSequence], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> StepMask | GatedMask | None:
        return self.decoding.mask(samplers) if self.decoding is not None else None

    def advance(
        self,
        samplers: Sequence[EngineSequence],
        indices: Sequence[int],
        tokens: Sequence[int],
        pending: Mapping[Any, Any],
        then: Sequence[EngineSequence] | None,
    ) -> None:
        if self.decoding is not None:
            self.decoding.advance(samplers, indices, tokens, pending, then)


__all__ = ["StructuredOutputsRule"]
