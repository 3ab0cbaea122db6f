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


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """vLLM's pairing of scoring's two sides, as (first, second) indices: one text against each of
    the other side's, or the two sides pair by pair."""
    if num_first < 1 or num_second < 1:
        raise ValueError("scoring needs at least one text on each side")
    if num_first == 1 or num_second == 1:
        return [
            (0 if num_first == 1 else i, 0 if num_second == 1 else i)
            for i in range(max(num_first, num_second))
        ]
    if num_first != num_second:
        raise ValueError(
            f"text_1 has {num_first} texts and text_2 {num_second}: give one, or as many as the other"
        )
    return [(i, i) for i in range(num_first)]
