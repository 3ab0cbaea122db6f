"""What the engine hands back to callers (vLLM-compatible shapes)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """vLLM's shape of one token's logprob: its value, its rank among the model's choices there (1:
    the top; None: not known, a sampled token outside the top-k asked for), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per position: the chosen token's, then the top-k's
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token (the first: None)


def logprob_dicts(
    ids: Sequence[int],
    chosen: Sequence[float | None],
    tops: Sequence[Sequence[tuple[int, float]]] | None,
    ranks: Sequence[int | None] | None = None,
) -> list[dict[int, Logprob] | None]:
    """Per position, ``{token id: Logprob}``: the chosen token's first (its rank from ``ranks``, else
    its place in the top-k), then the top-k's with their ranks; None where nothing is known (a
    prompt's first token)."""
    out: list[dict[int, Logprob] | None] = []
    for i, (tid, lp) in enumerate(zip(ids, chosen, strict=False)):
        if lp is None:
            out.append(None)
            continue
        top = tops[i] if tops is not None and i < len(tops) else ()
        place = next((r for r, (t, _) in enumerate(top, 1) if t == tid), None)
        rank = ranks[i] if ranks is not None and ranks[i] is not None else place
        entry = {tid: Logprob(lp, rank)}
        for r, (t, value) in enumerate(top, 1):
            entry.setdefault(t, Logprob(value, r))
        out.append(entry)
    return out


def fill_decoded(entries: Sequence[dict[int, Logprob] | None] | None, tokenizer: Any) -> None:
    """Set each ``Logprob.decoded_token`` to its token's text (one decode per distinct id)."""
    if not entries or tokenizer is None:
        return
    texts: dict[int, str] = {}
    for entry in entries:
        for tid, lp in (entry or {}).items():
            if tid not in texts:
                texts[tid] = tokenizer.decode([tid])
            lp.decoded_token = texts[tid]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. ``logprobs`` is vLLM's shape (``SampleLogprobs``, made on first read
    from ``token_logprobs`` and ``top_logprobs``, the engine's compact form that the server reads)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    token_logprobs: list[float] | None = None  # chosen tokens' logprobs, if asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None  # their top-k (token id, logprob) pairs
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs (logprobs or best_of)
    _logprobs: SampleLogprobs | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def logprobs(self) -> SampleLogprobs | None:
        """Per generated token, ``{token id: Logprob}``: the chosen token's, then its top-k (vLLM's
        ``CompletionOutput.logprobs``); None when not asked for."""
        if self.token_logprobs is None:
            return None
        if self._logprobs is None:
            dicts = logprob_dicts(self.token_ids, self.token_logprobs, self.top_logprobs)
            self._logprobs = [d for d in dicts if d is not None]
        return self._logprobs


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # the pooled final hidden states (``PoolingParams``), fp32


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """An embedding request's result (vLLM's ``EmbeddingRequestOutput`` shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float  # the cosine similarity of the pair's two embeddings


@dataclass(slots=True)
class ScoringRequestOutput:
    """One pair's score (vLLM's ``ScoringRequestOutput`` shape): ``prompt_token_ids`` are the two
    texts' ids, the first's then the second's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass(slots=True, init=False, eq=False, repr=False)
class RequestOutput:
    """A request's state as the caller sees it.

    ``prompt_token_ids`` is a list made on first read from the engine's compact array (one array
    shared by a request's outputs; each output makes its own list): most callers never read it, and
    1,024 finished 16K-token prompts held as lists would cost ~0.2 s to build and keep the GC walking
    16M elements for as long as they are held. The dataclass field behind it is ``_prompt_ids``
    (``dataclasses.asdict`` shows that name, holding the array); read the property instead.
    """

    request_id: str
    prompt: str | None
    _prompt_ids: Sequence[int] = field(repr=False)  # list, or the engine's array until first read
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Prompt Cache accuracy recovery: module rows computed again in this request's context, and the
    # module rows it reads from blocks every holder shares vs from its own private copies
    num_recomputed_tokens: int = 0
    module_rows_shared: int = 0
    module_rows_private: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token and finish times
    # with SamplingParams.prompt_logprobs: each prompt token's logprob (the first: None) and its top-k
    # (token id, logprob) pairs (the first: []); None when not asked for (``prompt_logprobs``: vLLM's
    # shape of them)
    prompt_token_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None  # why a request that finished with "error" did, where the engine knows
    # each prompt token's rank among the model's choices there (1: its top; the first: None)
    prompt_logprob_ranks: list[int | None] | None = None
    # an embedding request's vector (``PoolingParams``): the pooled final hidden states, fp32
    embedding: list[float] | None = None
    # prompt caching with TTLs (``engine/cache_pins.py``): prompt tokens this request wrote up to its
    # honoured cache breakpoints, and whether its breakpoints were refused for the pinned-block budget
    cache_written_tokens: int = 0
    cache_pins_refused: bool = False
    _prompt_logprobs: PromptLogprobs | None = field(default=None, init=False, repr=False)  # on first read

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        outputs: list[CompletionOutput],
        finished: bool,
        num_cached_tokens: int = 0,
        num_recomputed_tokens: int = 0,
        module_rows_shared: int = 0,
        module_rows_private: int = 0,
        metrics: dict[str, float] | None = None,
        prompt_token_logprobs: list[float | None] | None = None,
        prompt_top_logprobs: list[list[tuple[int, float]]] | None = None,
        error: str | None = None,
        prompt_logprob_ranks: list[int | None] | None = None,
        embedding: list[float] | None = None,
        cache_written_tokens: int = 0,
        cache_pins_refused: bool = False,
    ) -> None:
        self.request_id, self.prompt, self._prompt_ids = request_id, prompt, prompt_token_ids
        self.outputs, self.finished = outputs, finished
        self.num_cached_tokens, self.num_recomputed_tokens = num_cached_tokens, num_recomputed_tokens
        self.module_rows_shared, self.module_rows_private = module_rows_shared, module_rows_private
        self.metrics = {} if metrics is None else metrics
        self.prompt_token_logprobs, self.prompt_top_logprobs = prompt_token_logprobs, prompt_top_logprobs
        self._prompt_logprobs: PromptLogprobs | None = None
        self.error, self.prompt_logprob_ranks = error, prompt_logprob_ranks
        self.embedding = embedding
        self.cache_written_tokens, self.cache_pins_refused = cache_written_tokens, cache_pins_refused

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's ids as a list (made from the engine's array, so changing it changes nothing in
        the engine or in the request's other outputs; one given as a list is returned as it is)."""
        ids = self._prompt_ids
        if type(ids) is not list:
            ids = self._prompt_ids = _as_list(ids)
        return ids

    @prompt_token_ids.setter
    def prompt_token_ids(self, ids: Sequence[int]) -> None:
        self._prompt_ids = ids

    @property
    def stored_prompt_token_ids(self) -> Sequence[int]:
        """The prompt's ids as held (the engine's array until ``prompt_token_ids`` is read): for
        passing them on, e.g. pickled to another process, without making a list."""
        return self._prompt_ids

    @property
    def prompt_logprobs(self) -> PromptLogprobs | None:
        """Per prompt token, ``{token id: Logprob}`` (its own, with its rank, then the top-k; the first
        token: None), vLLM's ``RequestOutput.prompt_logprobs``; None when not asked for."""
        if self.prompt_token_logprobs is None:
            return None
        if self._prompt_logprobs is None:
            lps, tops, ranks = self.prompt_token_logprobs, self.prompt_top_logprobs, self.prompt_logprob_ranks
            self._prompt_logprobs = logprob_dicts(self.prompt_token_ids, lps, tops, ranks)
        return self._prompt_logprobs

    def decode_logprob_tokens(self, tokenizer: Any) -> None:
        """Fill every ``Logprob.decoded_token`` (the Python API does, where the tokenizer is)."""
        fill_decoded(self.prompt_logprobs, tokenizer)
        for c in self.outputs:
            fill_decoded(c.logprobs, tokenizer)

    @property
    def num_prompt_tokens(self) -> int:
        """len(prompt_token_ids), without making the list."""
        return len(self._prompt_ids)

    def _args(self) -> tuple[Any, ...]:
        return (
            self.request_id,
            self.prompt,
            self._prompt_ids,
            self.outputs,
            self.finished,
            self.num_cached_tokens,
            self.num_recomputed_tokens,
            self.module_rows_shared,
            self.module_rows_private,
            self.metrics,
            self.prompt_token_logprobs,
            self.prompt_top_logprobs,
            self.error,
            self.prompt_logprob_ranks,
            self.embedding,
            self.cache_written_tokens,
            self.cache_pins_refused,
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as constructor arguments (an array stays compact)
        return RequestOutput, self._args()

    def __repr__(self) -> str:  # the ids shown as a list, none kept
        args = self._args()
        shown = (*args[:2], _as_list(args[2]), *args[3:])
        return f"RequestOutput({', '.join(f'{k}={v!r}' for k, v in zip(_INIT_NAMES, shown, strict=True))})"

    def __eq__(self, other: object) -> bool:  # the prompt's ids compared as values, list or array
        if not isinstance(other, RequestOutput):
            return NotImplemented
        mine, theirs = self._args(), other._args()
        return mine[:2] + mine[3:] == theirs[:2] + theirs[3:] and _as_list(mine[2]) == _as_list(theirs[2])


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


_INIT_NAMES = tuple(inspect.signature(RequestOutput.__init__).parameters)[1:]  # the constructor's arguments
