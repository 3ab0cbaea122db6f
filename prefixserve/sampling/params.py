"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.sampling.structured_outputs import StructuredOutputs, as_structured

MAX_STOP_STRINGS = 16
MAX_N = 128
MAX_LOGPROBS = 20


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
    # the output must match a JSON schema, a regex, a choice or a grammar (``prefixserve.structured``)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self.structured_outputs = as_structured(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}]"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be >= 0 (0 or -1 disables it)"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are allowed"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
