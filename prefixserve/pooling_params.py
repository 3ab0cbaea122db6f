"""What an embedding request asks for (vLLM's ``PoolingParams``): how the model's final hidden states
over the prompt become one vector. An embedding request computes its prompt and no completion."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_KINDS = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """``pooling``: "last" takes the last prompt token's state (what a causal model has read the whole
    prompt by; vLLM's default for decoder models), "mean" the average over every prompt token.
    ``normalize``: scale to unit L2 norm (cosine similarity is then a dot product).
    ``truncate_prompt_tokens``: keep only the prompt's last this many tokens (-1: as many as the
    context holds)."""

    pooling: str = "last"
    normalize: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {list(POOLING_KINDS)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t!r}")


__all__ = ["POOLING_KINDS", "PoolingParams"]
