"""What the engine hands back to callers (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[float] | None = None  # chosen tokens' logprobs, if asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # one list shared by all of a request's outputs: read, do not modify
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Prompt Cache accuracy recovery: module rows computed again in this request's context, and the
    # module rows it reads from blocks every holder shares vs from its own private copies
    num_recomputed_tokens: int = 0
    module_rows_shared: int = 0
    module_rows_private: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token and finish times
