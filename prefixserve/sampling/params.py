"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-compatible names)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prefixserve.sampling.structured_outputs import StructuredOutputs, as_structured

MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 256
MAX_N = 128
MAX_LOGPROBS = 20
MAX_TOP_K = (1 << 31) - 1  # more than any vocabulary, and what the sampler's index tensors hold
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range [-2, 2]
MAX_LOGIT_BIAS = 100.0  # logit_bias values: OpenAI's range [-100, 100]
MIN_TEMPERATURE = 1e-2  # a smaller positive temperature is raised to it, as vLLM does
_STOP_IDS = "stop_token_ids must be a list of token ids (integers >= 0)"


@dataclass(slots=True)
class SamplingParams:
    """Validated on creation: a bad value raises ValueError naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the chosen token's
    include_stop_str_in_output: bool = False
    # logits processing (sampling/penalties.py), vLLM's definitions: presence and frequency over the
    # output tokens (OpenAI's), repetition over prompt and output tokens (divides positive logits,
    # multiplies negative ones); logit_bias adds to the raw logits of the token ids it names
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    prompt_logprobs: int | None = None  # each prompt token's logprob (the first: None) and top-k
    # the output must match a JSON schema, a regex, a choice or a grammar (``prefixserve.structured``)
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: list[int] | None = None  # only these may be chosen (every other logit: -inf)
    skip_special_tokens: bool = True  # the output's text leaves special tokens out (as decode does)
    # keep the prompt's last k tokens (left truncation); -1: as many as leave room for max_tokens
    truncate_prompt_tokens: int | None = None
    # strings the output may never contain (``sampling/bad_words.py``), encoded at each request's intake
    bad_words: list[str] | None = None
    # a reasoning model's thinking ends after at most this many tokens (``sampling/thinking_budget.py``;
    # needs the engine's reasoning_parser)
    thinking_token_budget: int | None = None
    # vLLM's: False leaves outputs' text empty (no detokenizing on the host: token ids alone)
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.structured_outputs = as_structured(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        # vLLM's spellings of "off" and "the chosen token's": None stop ids, seed -1, logprobs True
        ids = self.stop_token_ids
        self.stop_token_ids = [] if ids is None else list(ids) if isinstance(ids, list | tuple | set) else ids
        if self.seed == -1:
            self.seed = None
        if isinstance(self.logprobs, bool):
            self.logprobs = int(self.logprobs)
        if isinstance(self.prompt_logprobs, bool):
            self.prompt_logprobs = int(self.prompt_logprobs)
        if isinstance(self.temperature, int | float) and 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE  # logits / 1e-40 overflow to inf, and NaN would pick token 0
        checks = [
            (isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}]"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (
                isinstance(self.top_k, int) and 0 <= self.top_k <= MAX_TOP_K,
                f"top_k must be in [0, {MAX_TOP_K}] (0 or -1 disables it)",
            ),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                isinstance(self.stop_token_ids, list) and all(map(_is_token_id, self.stop_token_ids)),
                _STOP_IDS,
            ),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            ),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are allowed"),
            (
                self.detokenize or not self.stop,
                "stop strings need detokenize=True (they are found in the text)",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
        ]
        checks += _processing_checks(self)
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_counts(self) -> bool:
        """A penalty that reads the tokens so far (the runner keeps their counts on the device)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Anything that changes the logits before the choice (false: the fast path, untouched)."""
        return self.needs_counts or bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def wants_chosen_logprobs(self) -> bool:
        """The chosen tokens' logprobs are kept: asked for, or needed to rank ``best_of`` samples."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def distinct(params: Iterable[SamplingParams]) -> Iterable[SamplingParams]:
    """Each parameters object once: a batch's rows mostly share a few (one per ``generate`` call or
    request), and the checks a step makes over its rows read several properties of each."""
    return {id(p): p for p in params}.values()


# What a step's checks ask of all its rows' parameters, one bit each (``param_flags``)
MIN_TOKENS = 1  # some row has min_tokens (its stops may be banned)
BAD_WORDS = 2  # some row has bad words
PROCESSES_LOGITS = 4  # some row changes its logits before the choice
NOT_ARGMAX = 8  # some row is not a plain argmax (sampled, logprobs kept, or logits processed)
THINKING_BUDGET = 16  # some row's thinking may be cut (its end tag forced)


def param_flags(p: SamplingParams) -> int:
    """``p``'s bits of the step checks, read once per request at intake (``Request.param_flags``)."""
    processes = p.processes_logits
    return (
        (MIN_TOKENS if p.min_tokens else 0)
        | (BAD_WORDS if p.bad_words else 0)
        | (PROCESSES_LOGITS if processes else 0)
        | (NOT_ARGMAX if processes or not p.greedy or p.wants_chosen_logprobs else 0)
        | (THINKING_BUDGET if p.thinking_token_budget is not None else 0)
    )


class RowParams(list):  # type: ignore[type-arg]
    """A step's sample rows' parameters (``list[SamplingParams]``) with their ``flags`` or-ed while
    the list was built: a server's requests each bring their own object, so each check reading
    every row's properties would be a pass over the whole batch, five of them every step."""

    flags: int = 0


def leading_rows(params: list[SamplingParams], n: int) -> list[SamplingParams]:
    """The first ``n`` rows' parameters (a ``RowParams`` keeps its flags: those of every row, a
    superset, which only gates the checks): a step's samplers, without the speculated rows after them."""
    if len(params) == n:
        return params
    out = RowParams(params[:n])
    out.flags = flags_of(params)
    return out


def flags_of(params: Iterable[SamplingParams]) -> int:
    """The or of the rows' ``param_flags``: kept by a ``RowParams``, else read now."""
    if isinstance(params, RowParams):
        return params.flags
    flags = 0
    for p in distinct(params):
        flags |= param_flags(p)
    return flags


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _processing_checks(p: SamplingParams) -> list[tuple[bool, str]]:
    """Checks of the logits-processing fields, best_of and prompt_logprobs (messages name the field)."""
    bias = p.logit_bias
    bias_ok = bias is None or (
        isinstance(bias, dict)
        and all(_is_id(k) for k in bias)
        and all(_finite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in bias.values())
    )
    return [
        (
            _finite(p.presence_penalty) and -MAX_PENALTY <= p.presence_penalty <= MAX_PENALTY,
            f"presence_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
        ),
        (
            _finite(p.frequency_penalty) and -MAX_PENALTY <= p.frequency_penalty <= MAX_PENALTY,
            f"frequency_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
        ),
        (
            _finite(p.repetition_penalty) and 0.0 < p.repetition_penalty <= MAX_PENALTY,
            f"repetition_penalty must be in (0, {MAX_PENALTY:g}]",
        ),
        (
            bias_ok,
            f"logit_bias must map token ids (integers >= 0) to values in [-{MAX_LOGIT_BIAS:g}, "
            f"{MAX_LOGIT_BIAS:g}]",
        ),
        (
            p.best_of is None
            or (isinstance(p.best_of, int) and not isinstance(p.best_of, bool) and p.n <= p.best_of <= MAX_N),
            f"best_of must be an integer in [n, {MAX_N}] (n={p.n})",
        ),
        (
            p.best_of is None or p.best_of == p.n or p.temperature > 0.0,
            "best_of > n needs temperature > 0 (greedy samples are all the same)",
        ),
        (
            p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
        ),
        (
            p.allowed_token_ids is None
            or (
                isinstance(p.allowed_token_ids, list | tuple | set)
                and len(p.allowed_token_ids) > 0
                and all(map(_is_token_id, p.allowed_token_ids))
            ),
            "allowed_token_ids must be a non-empty list of token ids (integers >= 0)",
        ),
        (
            p.bad_words is None
            or (
                isinstance(p.bad_words, list | tuple)
                and len(p.bad_words) <= MAX_BAD_WORDS
                and all(isinstance(w, str) and w.strip() for w in p.bad_words)
            ),
            f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings",
        ),
        (
            p.thinking_token_budget is None
            or (_is_int(p.thinking_token_budget) and p.thinking_token_budget >= 0),
            "thinking_token_budget must be an integer >= 0",
        ),
        (
            p.truncate_prompt_tokens is None
            or (
                _is_int(p.truncate_prompt_tokens)
                and (p.truncate_prompt_tokens >= 1 or p.truncate_prompt_tokens == -1)
            ),
            "truncate_prompt_tokens must be an integer >= 1, or -1 (as many as leave room for max_tokens)",
        ),
    ]


def _is_int(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_token_id(t: object) -> bool:
    return _is_int(t) and t >= 0  # type: ignore[operator]


def _is_id(k: object) -> bool:
    """A logit_bias key: an int, or a string of one (OpenAI sends ids as JSON object keys)."""
    if isinstance(k, bool):
        return False
    if isinstance(k, int):
        return k >= 0
    return isinstance(k, str) and k.strip().isdigit()
