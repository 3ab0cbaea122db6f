"""``min_tokens``: the first ``min_tokens`` output tokens of a sample are never EOS or a stop token id.

As vLLM's min-tokens logits processor: while a row's output is shorter than its ``min_tokens``, the
logits of its stop token ids (and of EOS, unless ``ignore_eos``) are set to -inf before the choice, so
the sample goes on with the likeliest other token instead of emitting a stop it may not act on. The
ban goes on the logits the choice is made from, never on the raw ones (logprobs stay the model's).
Rows under a grammar (structured outputs) are left to it: it may need EOS to end a valid output.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from prefixserve.sampling.params import MIN_TOKENS, SamplingParams, flags_of
from prefixserve.sampling.small_tensors import small_tensor


class Sampling(Protocol):
    """What the ban reads of a sampling sequence (the engine's ``Sequence``)."""

    num_prompt_tokens: int


FORCED = 1e9  # a forced token's logit (fp32 logits: its softmax is 1 at any temperature down to 1e-2)


@dataclass(slots=True)
class TokenBan:
    """Token ids a step's sample rows may not choose: row ``rows[i]`` bans ``ids[i]``; and rows whose
    choice is forced: row ``forced_rows[i]`` takes ``forced_ids[i]`` (``thinking_budget.py``) unless
    a ban names it too (the ban wins: the row then chooses among the others)."""

    rows: list[int]
    ids: list[int]
    forced_rows: list[int] = field(default_factory=list)
    forced_ids: list[int] = field(default_factory=list)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the banned logits of ``logits`` [sample rows, V] to -inf, in place (ids past V: no tokens);
        a forced token's logit is raised to ``FORCED`` first (as vLLM's budget raises it: after any
        temperature, penalty or top-k/p it is the choice), so a ban of the same token still wins."""
        vocab = logits.shape[-1]
        if self.forced_rows:
            dev = logits.device
            rows = small_tensor(self.forced_rows, dev, torch.long)
            ids = small_tensor(self.forced_ids, dev, torch.long)
            logits.index_put_((rows, ids), torch.full((), FORCED, dtype=logits.dtype, device=dev))
        pairs = [(r, t) for r, t in zip(self.rows, self.ids, strict=True) if 0 <= t < vocab]
        if not pairs:
            return
        rows, ids = zip(*pairs, strict=True)
        dev = logits.device
        index = (small_tensor(list(rows), dev, torch.long), small_tensor(list(ids), dev, torch.long))
        logits.index_put_(index, torch.full((), float("-inf"), dtype=logits.dtype, device=dev))


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


__all__ = ["TokenBan", "min_tokens_ban"]
