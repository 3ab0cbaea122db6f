"""``TokenBan``: the token ids a step's sample rows may not choose, and the rows whose choice is forced.

What request rules that ban (``min_tokens``, ``bad_words``) or force (``thinking_token_budget``) hand
the sampler, one for the whole step: ``RuleSet.restrict`` joins the rules' bans into one, which the
sampler applies on the device with two scatters, whatever the number of rows or rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixserve.sampling.small_tensors import small_tensor

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


def joined(a: TokenBan | None, b: TokenBan | None) -> TokenBan | None:
    """Both bans at once."""
    if a is None or b is None:
        return a or b
    return TokenBan(
        a.rows + b.rows, a.ids + b.ids, a.forced_rows + b.forced_rows, a.forced_ids + b.forced_ids
    )


__all__ = ["FORCED", "TokenBan", "joined"]
