"""``min_tokens``: the first ``min_tokens`` output tokens of a sample are never EOS or a stop token id.

As vLLM's min-tokens logits processor: while a row's output is shorter than its ``min_tokens``, the
logits of its stop token ids (and of EOS, unless ``ignore_eos``) are set to -inf before the choice, so
the sample goes on with the likeliest other token instead of emitting a stop it may not act on. The
ban goes on the logits the choice is made from, never on the raw ones (logprobs stay the model's).
Rows under a grammar (structured outputs) are left to it: it may need EOS to end a valid output.
A request rule (``MinTokensRule``, ``rules.py``): a ban, no state of its own (the params say it all).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from prefixserve.sampling.params import MIN_TOKENS, SamplingParams, flags_of
from prefixserve.sampling.rules import RequestRule
from prefixserve.sampling.token_ban import TokenBan  # the sampler's ban


class Sampling(Protocol):
    """What the ban reads of a sampling sequence (the engine's ``Sequence``)."""

    num_prompt_tokens: int


def min_tokens_ban(
    samplers: Sequence[Sampling],
    indices: Sequence[int],
    params: Sequence[SamplingParams],
    eos_ids: Collection[int],
) -> TokenBan | None:
    """The ban of a step's sample rows (``samplers[i]`` samples the token at ``indices[i]`` of its token
    ids, with ``params[i]``), or None when no row is under its ``min_tokens``."""
    if not flags_of(params) & MIN_TOKENS:
        return None
    rows: list[int] = []
    ids: list[int] = []
    for r, (seq, at, p) in enumerate(zip(samplers, indices, params, strict=True)):
        # the token sampled here is output token number at - prompt + 1; stops count from min_tokens + 1
        if not p.min_tokens or at - seq.num_prompt_tokens >= p.min_tokens or p.structured_outputs is not None:
            continue
        banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_ids)
        rows += [r] * len(banned)
        ids += sorted(banned)
    return TokenBan(rows, ids) if rows else None


class MinTokensRule(RequestRule):
    """``min_tokens`` as a request rule: each step's ban of the stops of the rows under it."""

    name = "min_tokens"

    def __init__(self, eos_ids: Collection[int]) -> None:
        self.eos_ids = eos_ids  # the engine's set: the model's EOS ids and the tokenizer's

    def ban(
        self, samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> TokenBan | None:
        return min_tokens_ban(samplers, indices, params, self.eos_ids)


__all__ = ["MinTokensRule", "TokenBan", "min_tokens_ban"]
