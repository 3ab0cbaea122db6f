"""Beam search as a loop of one-token engine steps (vLLM's algorithm, scores and output shapes).

Why outside the engine: each step runs every live beam as an ordinary request for one token with its
top 2W log-probabilities (W: the beam width). The beams' common prompt and the prefixes they share
are in the prefix cache, so a step computes only each beam's tail since its last full block, and
the requests of a step share their prompt's KV like any other batch: no engine change, and every
engine path (sharing kernels, graphs, tensor parallelism) runs it.

The search (per prompt): every live beam's 2W best next tokens are candidates; a candidate that ends
the output (EOS, a stop token id) becomes a finished beam, the W best of the others by score are the
next step's beams. At the end the W best of all finished and live beams are the answer. Score:
``cum_logprob / len ** length_penalty``, ``len`` counting the prompt and the output less its stop
token (vLLM's ``get_beam_search_score``). The search stops early only where no live beam's
descendant can reach the W-th best finished score, so the answer is the one a run to max_tokens gives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.detokenizer import decode_output
from prefixserve.outputs import CompletionOutput
from prefixserve.sampling.params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for its 2W best next tokens


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``; ``stop_token_ids``, ``skip_special_tokens`` and ``logprobs`` (the
    top log-probabilities kept per output token) are this engine's additions. The search is
    deterministic: ``temperature`` is there for vLLM's callers and must be 0."""

    beam_width: int
    max_tokens: int | None = 16  # None: up to the context length
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (
                isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
                f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}]",
            ),
            (
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "max_tokens must be an integer >= 1 (or None: up to the context length)",
            ),
            (
                self.temperature == 0,
                "temperature must be 0: beam search ranks by the model's log-probabilities",
            ),
            (
                isinstance(self.length_penalty, int | float) and math.isfinite(self.length_penalty),
                "length_penalty must be a finite number",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be a list of token ids (integers >= 0)",
            ),
            (
                self.logprobs is None
                or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks the engine for: its 2W best next tokens (more where
        the outputs keep more top log-probabilities)."""
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=max(2 * self.beam_width, self.logprobs or 0),
            ignore_eos=True,
            skip_special_tokens=self.skip_special_tokens,
        )


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the output (as vLLM's); ``logprobs`` one dict per
    output token of the step's top candidates; ``text`` the output's text (set on the answer's beams)."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, beam_width of them (fewer if fewer exist)


def beam_score(num_tokens: int, cum_logprob: float, stopped: bool, length_penalty: float) -> float:
    """vLLM's score: the length counts the prompt and the output, less a stop token that ended it."""
    return cum_logprob / ((num_tokens - stopped) ** length_penalty)


@dataclass(slots=True)
class _Beam:
    """A beam while searching: its output only (the prompt is its search's)."""

    outputs: list[int]
    tops: list[dict[int, float]]
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass(slots=True)
class _Search:
    """One prompt's search."""

    prompt: list[int]
    limit: int  # the longest a beam may grow: the prompt and its room
    live: list[_Beam]
    finished: list[_Beam] = field(default_factory=list)


class BeamSearch:
    """The search over all prompts, driven by a caller that runs each step's requests on an engine:
    ``while not s.done: s.advance(run(s.pending(), s.params.step_params()))``; ``results()``
    then holds each prompt's best beams."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: BeamSearchParams,
        eos_ids: Iterable[int],
        rooms: Sequence[int],
    ) -> None:
        """``rooms``: the most tokens each prompt's outputs may have (max_tokens within the context,
        as the caller's checks found it)."""
        self.params = params
        self._eos = frozenset(() if params.ignore_eos else eos_ids)
        self._stops = frozenset(params.stop_token_ids)
        self._searches = [
            _Search(list(ids), len(ids) + room, [_Beam([], [])])
            for ids, room in zip(prompts, rooms, strict=True)
        ]

    @property
    def done(self) -> bool:
        return not any(s.live for s in self._searches)

    def pending(self) -> list[tuple[int, list[int]]]:
        """Every live beam as (its prompt's index, its token ids), prompt by prompt: this step's
        requests."""
        return [(i, s.prompt + beam.outputs) for i, s in enumerate(self._searches) for beam in s.live]

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """Take each pending beam's best next tokens (``(token, logprob)``, best first) and choose the
        next beams."""
        if len(tops) != sum(len(s.live) for s in self._searches):
            raise ValueError(f"{len(tops)} candidate lists for {len(self.pending())} live beams")
        width = self.params.beam_width
        todo = iter(tops)
        for search in self._searches:
            grown: list[_Beam] = []
            for beam in search.live:
                top = list(next(todo))
                kept = dict(top)
                for token, logprob in top[: 2 * width]:
                    child = _Beam([*beam.outputs, token], [*beam.tops, kept], beam.cum_logprob + logprob)
                    if token in self._eos or token in self._stops:
                        child.finish_reason = "stop"
                        child.stop_reason = None if token in self._eos else token
                        search.finished.append(child)
                    else:
                        grown.append(child)
            plen = len(search.prompt)
            grown.sort(key=lambda b: self._score(plen, b), reverse=True)
            search.live = grown[:width]
            if search.live and plen + len(search.live[0].outputs) >= search.limit:
                for beam in search.live:
                    beam.finish_reason = "length"
                search.finished += search.live
                search.live = []
            elif search.live and self._settled(search):
                search.live = []

    def _score(self, prompt_len: int, beam: _Beam) -> float:
        stopped = beam.finish_reason == "stop"
        return beam_score(
            prompt_len + len(beam.outputs), beam.cum_logprob, stopped, self.params.length_penalty
        )

    def _settled(self, search: _Search) -> bool:
        """True when no live beam's descendant can score above the W-th best finished beam. A
        descendant's cumulative logprob is at most its beam's (logprobs are <= 0) and its scored
        length lies between the beam's and the limit: the bound is the beam's cumulative logprob
        over the larger of ``length ** length_penalty`` at those two ends."""
        width = self.params.beam_width
        if len(search.finished) < width:
            return False
        plen = len(search.prompt)
        scores = sorted((self._score(plen, b) for b in search.finished), reverse=True)
        penalty = self.params.length_penalty
        bound = max(
            b.cum_logprob / max((plen + len(b.outputs)) ** penalty, search.limit**penalty)
            for b in search.live
        )
        return scores[width - 1] > bound

    def results(self) -> list[list[BeamSearchSequence]]:
        """Each prompt's best beams, best first."""
        best = []
        for search in self._searches:
            plen = len(search.prompt)
            beams = sorted(search.finished + search.live, key=lambda b: self._score(plen, b), reverse=True)
            best.append(
                [
                    BeamSearchSequence(
                        search.prompt + b.outputs,
                        b.tops,
                        b.cum_logprob,
                        finish_reason=b.finish_reason,
                        stop_reason=b.stop_reason,
                        num_prompt_tokens=plen,
                    )
                    for b in beams[: self.params.beam_width]
                ]
            )
        return best


def top_candidates(out: Any) -> list[tuple[int, float]]:
    """A one-token request's candidates from its ``RequestOutput``: the top log-probabilities of its
    only token."""
    top = out.outputs[0].top_logprobs
    if not top:
        raise RuntimeError(f"request {out.request_id} returned no top logprobs for beam search")
    return list(top[0])


def with_text(beams: list[BeamSearchSequence], tokenizer: Any, params: BeamSearchParams) -> None:
    """Set each beam's ``text``: its output decoded as the engine decodes outputs (a stop token's own
    text left out unless ``include_stop_str_in_output``)."""
    for beam in beams:
        ids = beam.output_token_ids
        if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
            ids = ids[:-1]
        if tokenizer is None:
            beam.text = ""
        else:
            beam.text = decode_output(
                tokenizer, beam.tokens[: beam.num_prompt_tokens], ids, params.skip_special_tokens
            )


def as_completion(beam: BeamSearchSequence, index: int, logprobs: int | None) -> CompletionOutput:
    """A beam as the engine's ``CompletionOutput`` (``with_text`` first): the chosen tokens'
    logprobs and each token's top ``logprobs`` where asked."""
    outputs = beam.output_token_ids
    chosen = [lp[t] for t, lp in zip(outputs, beam.logprobs, strict=True)] if logprobs is not None else None
    top = [list(lp.items())[:logprobs] for lp in beam.logprobs] if logprobs is not None else None
    return CompletionOutput(
        index=index,
        text=beam.text or "",
        token_ids=outputs,
        finish_reason=beam.finish_reason,
        stop_reason=beam.stop_reason,
        token_logprobs=chosen,
        top_logprobs=top,
        cumulative_logprob=beam.cum_logprob,
    )
