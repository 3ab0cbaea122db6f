"""Requests and their sequences: the state the scheduler and engine move along. Pure Python.

Token ids and positions live in ``array("q")`` (``TokenArray``), not lists. Python's cyclic GC visits
every element of every live list on a full pass, and at 1,024 sequences of 16K tokens that was ~67M
elements and a 1.8 s pause in the middle of decode (measured on an H100 host); an array holds no
object references, so the GC never looks inside it. It also takes 8 bytes a token instead of ~36.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixserve.detokenizer import PROMPT_CONTEXT, IncrementalDetokenizer
from prefixserve.sampling.params import SamplingParams, param_flags

TokenArray = array  # array("q"): token ids or positions; the GC visits the array, never its elements


def token_array(values: Iterable[int] = ()) -> TokenArray:
    """int64 ids or positions as a ``TokenArray`` (a copy; raises TypeError for non-integers)."""
    return array("q", values)


_counting = array("q")  # 0, 1, 2, ...: grown on demand, sliced by ``counting_positions``


def counting_positions(n: int) -> TokenArray:
    """Positions 0..n-1 as a new ``TokenArray``: a slice (a copy) of one growing array, since
    building them from ``range`` took ~0.6 ms per 16K tokens on the dev CPU, ~200x the slice."""
    global _counting
    if len(_counting) < n:
        _counting = array("q", range(max(n, 2 * len(_counting))))
    return _counting[:n]


PLACEHOLDER_TOKEN = -1  # a sequence's in-flight token until the device returns it (never a real id)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: its tokens, their positions, and the KV blocks that hold them."""

    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: TokenArray  # prompt, then output (placeholders while sampled tokens are in flight)
    positions: TokenArray
    block_table: list[int] = field(default_factory=list)
    block_digests: list[bytes] = field(default_factory=list)  # of the leading full blocks (computed or not)
    num_indexed_blocks: int = 0  # leading blocks already in the prefix index (or taken from it)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: SeqStatus = SeqStatus.WAITING
    generator: torch.Generator | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_text: str = ""  # the text cut at the stop string that ended the sequence
    detokenizer: IncrementalDetokenizer | None = None  # the output's text, grown as tokens arrive
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_preemptions: int = 0  # times sent back to the queue with its blocks freed (``Scheduler._preempt``)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :].tolist()

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.positions.append(self.positions[-1] + 1)

    def prompt_tail(self) -> list[int]:
        """The prompt's last ids, the context the output's text is decoded in (``detokenizer.py``)."""
        n = self.num_prompt_tokens
        return [t for t in self.token_ids[max(0, n - PROMPT_CONTEXT) : n] if t >= 0]

    def detokenize(self, tokenizer: Any, upto: int | None = None) -> IncrementalDetokenizer:
        """The output's incremental detokenizer, first fed the tokens appended since the last call
        (with ``upto``, only as far as the first ``upto`` output tokens)."""
        detok = self.detokenizer
        if detok is None:
            skip = self.request.params.skip_special_tokens
            detok = self.detokenizer = IncrementalDetokenizer(tokenizer, skip, context=self.prompt_tail())
        start = self.num_prompt_tokens + detok.num_ids
        end = len(self.token_ids) if upto is None else min(len(self.token_ids), self.num_prompt_tokens + upto)
        if start < end:
            detok.add(self.token_ids[start:end])
        return detok


@dataclass(slots=True)
class HeldModules:
    """A Prompt Cache request's module blocks: they lead every sample's table, held by the request
    until it ends, with stand-in digests so its own blocks chain from all the modules; the blocks'
    empty rows are ``holes`` placeholder tokens of the prompt."""

    blocks: list[int]
    digests: list[bytes]
    holes: int = 0
    tokens: int = 0  # real prompt tokens reused from modules
    recomputed_tokens: int = 0  # module rows recomputed in this request's context (recovery)
    private_rows: int = 0  # module rows in private copies of module blocks
    # module rows (table row runs) still to compute in context: in the first prefill step
    recompute_runs: list[tuple[int, int]] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)  # all of them: again after a let-go
    keys: list[str] = field(default_factory=list)  # the pieces' keys, in table order
    private: list[int] = field(default_factory=list)  # table indices of the recovery copies
    let_go: bool = False  # the holds were let go while it waited (``PromptModules.let_go``)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens served from the modules' KV (the recomputed rows are computed again)."""
        return self.tokens - self.recomputed_tokens

    @property
    def uncounted_tokens(self) -> int:
        """Table rows that are not prompt tokens served from cache: holes and recomputed rows."""
        return self.holes + self.recomputed_tokens


@dataclass(slots=True, eq=False)
class Request:
    """What a user asked for; owns 1..n sequences (the n samples share the prompt's KV blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: TokenArray
    prompt_positions: TokenArray
    params: SamplingParams
    # len(prompt_token_ids), fixed at creation: outputs hand the prompt's array itself to callers, so
    # nothing the engine decides may read that array after admission
    num_prompt_tokens: int = field(init=False)
    cache_salt: str | None = None
    # with a salt: the prompt's first ``public_tokens`` are public, so the blocks wholly inside them are
    # digested without it and shared across salts (``--cache-salt-scope``; 0: the salt covers all)
    public_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # under the priority scheduling policy, a smaller value is served first
    tenant: str | None = None  # whose share it draws on under the fair policy (scheduler/fair_share.py)
    # cache breakpoints (engine/cache_pins.py): (prompt tokens, seconds) to hold the blocks up to each;
    # refused at intake for the pinned-block budget; what it wrote up to them, set when it retires
    cache_pins: list[tuple[int, float]] = field(default_factory=list)
    cache_pins_refused: bool = False
    cache_written_tokens: int = 0
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when its first step was planned (its queue time ends)
    finish_time: float | None = None
    forked: bool = False  # the n > 1 samples have been split off sequence 0
    stream: bool = False  # report every step's progress, not only the final output
    unreported: int = 0  # tokens generated since the last streamed output (EngineConfig.stream_interval)
    streamed: bool = False  # a progress output has gone out (the first one goes at once)
    modules: HeldModules | None = None  # a Prompt Cache prompt's reused module blocks
    error: str | None = None  # why it finished with "error", where the engine knows
    # each request rule's state, by the rule's name, where the rule applies to the request (bad words'
    # encoded ids, a thinking budget, grammar matchers by sample, prompt logprobs, pooling): made at
    # intake, read back by the rule alone (``sampling/rules.py``, ``engine/output_rules.py``)
    rules: dict[str, Any] = field(default_factory=dict)
    _reported_prompt: TokenArray | None = field(default=None, repr=False)
    param_flags: int = field(init=False)  # what the step checks ask of ``params`` (sampling/params.py)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.param_flags = param_flags(self.params)

    @property
    def reported_prompt_token_ids(self) -> TokenArray:
        """The prompt's ids as outputs report them (Prompt Cache holes dropped), built once: a streamed
        request reports them every step, and copying an 8K-token prompt for each of 256 streams took
        more of a step's host time than anything else. Without holes it is the prompt's own array (the
        engine never changes it, and reads only ``num_prompt_tokens`` once the request is admitted):
        copying a 16K-token prompt for each of 1,024 requests finishing in one step was a third of that
        step's host time on a 2-core CPU. ``RequestOutput`` turns it into a list only when read."""
        if self._reported_prompt is None:
            ids = self.prompt_token_ids
            holes = self.modules is not None and self.modules.holes > 0
            self._reported_prompt = token_array(t for t in ids if t >= 0) if holes else ids
        return self._reported_prompt

    @property
    def pending_recompute_tokens(self) -> int:
        """Module rows its first prefill step will recompute besides its own tokens (recovery)."""
        return 0 if self.modules is None else sum(b - a for a, b in self.modules.recompute_runs)

    @property
    def is_finished(self) -> bool:
        return (
            bool(self.sequences)
            and all(s.is_finished for s in self.sequences)
            and (self.forked or self.params.num_samples == 1)
        )
