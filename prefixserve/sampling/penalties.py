"""Logits processing before the choice: ``logit_bias``, ``allowed_token_ids``, then presence, frequency
and repetition penalties.

Definitions as vLLM's (OpenAI's for presence and frequency): with ``c[t]`` the count of token ``t`` in
the sequence's output so far,

    logits[t] += logit_bias[t]
    logits[t] = -inf                                   where allowed_token_ids is set and t not in it
    logits[t] /= rep if logits[t] > 0 else 1 / rep     where t is in the prompt or the output
    logits[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)

All of it runs on the device for the whole batch, as three request rules' ``adjust`` hooks
(``sampling/rules.py``), in that order: ``LogitBiasRule``, ``AllowedTokensRule``, ``PenaltiesRule``.
The token counts are device state, one row per sequence (``PenaltyState``, the penalties rule's),
updated from the sampled tokens on the device right behind each sampling: under launch-ahead a
sequence's last token is still on the device (a placeholder on the host) when its next row is
sampled, and stream order alone makes the counts include it. The host never reads a sampled token
to keep the counts, and a row's prompt is read once, when its sequence first samples.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch

from prefixserve.sampling.params import PROCESSES_LOGITS, SamplingParams, flags_of
from prefixserve.sampling.rules import LogitsAdjust, RequestRule
from prefixserve.sampling.small_tensors import small_tensor

PromptOf = Callable[[Hashable], tuple[Sequence[int], Sequence[int]]]  # key -> (prompt ids, output ids)


class Penalized(Protocol, Hashable):
    """What the penalties read of a sequence (the engine's ``Sequence``; the device side never imports it)."""

    num_prompt_tokens: int
    token_ids: Any

    @property
    def is_finished(self) -> bool: ...


def sequence_ended(seq: Penalized) -> bool:
    return seq.is_finished


def prompt_and_output(seq: Penalized) -> tuple[Any, Any]:
    """A sequence's prompt ids and the output ids known on the host (placeholders are negative)."""
    n = seq.num_prompt_tokens
    return seq.token_ids[:n], seq.token_ids[n:]


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [R, V] with each row's bias added (in place; one scatter for the batch)."""
    rows, cols, vals = [], [], []
    for r, p in enumerate(params):
        if p.logit_bias:
            rows += [r] * len(p.logit_bias)
            cols += list(p.logit_bias)
            vals += list(p.logit_bias.values())
    if rows:
        dev = logits.device
        index = (small_tensor(rows, dev, torch.long), small_tensor(cols, dev, torch.long))
        logits.index_put_(index, small_tensor(vals, dev, logits.dtype), accumulate=True)
    return logits


def apply_allowed_tokens(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Rows with ``allowed_token_ids``: every other logit of theirs set to -inf (in place; ids past the
    vocabulary are no tokens). One gather and two writes per parameters object, whatever its rows."""
    rows_of: dict[int, tuple[SamplingParams, list[int]]] = {}
    for r, p in enumerate(params):
        if p.allowed_token_ids is not None:
            rows_of.setdefault(id(p), (p, []))[1].append(r)
    vocab, dev = logits.shape[-1], logits.device
    for p, rows in rows_of.values():
        row_t = small_tensor(rows, dev, torch.long)[:, None]
        id_t = small_tensor([t for t in p.allowed_token_ids or () if t < vocab], dev, torch.long)[None, :]
        kept = logits[row_t, id_t]
        logits.index_fill_(0, row_t[:, 0], float("-inf"))
        logits[row_t, id_t] = kept


def apply_penalties(
    logits: torch.Tensor,  # [R, V]
    counts: torch.Tensor,  # [R, V] output token counts
    prompt_seen: torch.Tensor,  # [R, V] bool: the token is in the prompt
    presence: torch.Tensor,  # [R]
    frequency: torch.Tensor,  # [R]
    repetition: torch.Tensor,  # [R]
) -> torch.Tensor:
    """The three penalties on a batch, vectorized (a new tensor)."""
    counts = counts.to(logits.dtype)
    seen = prompt_seen | (counts > 0)
    rep = torch.where(seen, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).to(logits.dtype)


class PenaltyState:
    """Per-sequence token counts and prompt masks on the device, one row (slot) per sequence.

    A sequence takes a slot the first time it samples with a penalty that reads tokens; ``release``
    gives back the slots of sequences that have ended. Rows grow by doubling.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: dict[Hashable, int] = {}
        self.free: list[int] = []
        self.counts: torch.Tensor | None = None  # [capacity, V] int32
        self.prompt_seen: torch.Tensor | None = None  # [capacity, V] bool

    def __len__(self) -> int:
        return len(self.slots)

    def _grow(self, vocab: int) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, vocab, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new, vocab, dtype=torch.bool, device=self.device)
        if self.counts is not None:
            counts[:old] = self.counts
            seen[:old] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        self.free += range(new - 1, old - 1, -1)  # popped lowest first

    def _take(self, key: Hashable, prompt_of: PromptOf, vocab: int) -> int:
        """A fresh slot for ``key``: its prompt's tokens marked, its known output tokens counted."""
        if not self.free:
            self._grow(vocab)
        slot = self.free.pop()
        self.slots[key] = slot
        prompt, output = prompt_of(key)
        self.counts[slot].zero_()
        self.prompt_seen[slot].zero_()
        prompt_ids = [t for t in prompt if 0 <= t < vocab]  # placeholders (< 0) are no tokens
        if prompt_ids:
            self.prompt_seen[slot].index_fill_(0, small_tensor(prompt_ids, self.device, torch.long), True)
        output_ids = [t for t in output if 0 <= t < vocab]
        if output_ids:
            ids = small_tensor(output_ids, self.device, torch.long)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def apply(
        self,
        logits: torch.Tensor,  # [R, V] fp32, changed in place where rows need it
        params: list[SamplingParams],
        keys: Sequence[Hashable],
        prompt_of: PromptOf,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Penalize the rows whose parameters ask for it; returns (their row indices, their slots)
        for ``record``, or None when no row reads counts."""
        rows = [r for r, p in enumerate(params) if p.needs_counts]
        if not rows:
            return None
        vocab = logits.shape[-1]
        slots = self.slots
        picked = [slots[keys[r]] if keys[r] in slots else self._take(keys[r], prompt_of, vocab) for r in rows]
        dev = logits.device
        row_t, slot_t = small_tensor(rows, dev, torch.long), small_tensor(picked, dev, torch.long)
        ps = [params[r] for r in rows]
        penalized = apply_penalties(
            logits.index_select(0, row_t),
            self.counts.index_select(0, slot_t),
            self.prompt_seen.index_select(0, slot_t),
            small_tensor([p.presence_penalty for p in ps], dev, logits.dtype),
            small_tensor([p.frequency_penalty for p in ps], dev, logits.dtype),
            small_tensor([p.repetition_penalty for p in ps], dev, logits.dtype),
        )
        logits.index_copy_(0, row_t, penalized)
        return row_t, slot_t

    def record(self, taken: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (``tokens`` [R] on the device) in their rows' slots."""
        row_t, slot_t = taken
        chosen = tokens.index_select(0, row_t)
        self.counts.index_put_((slot_t, chosen), torch.ones_like(chosen, dtype=torch.int32), accumulate=True)

    def release(self, ended: Callable[[Hashable], bool]) -> None:
        """Give back the slots of the sequences ``ended`` says are over."""
        gone = [k for k in self.slots if ended(k)]
        for k in gone:
            self.free.append(self.slots.pop(k))


class _Adjust:
    """An adjust that changes the logits with ``change(logits, params)`` and keeps no state."""

    def __init__(self, change: Callable[[torch.Tensor, list[SamplingParams]], Any], params: list) -> None:
        self.change, self.params = change, params

    def apply(self, logits: torch.Tensor) -> None:
        self.change(logits, self.params)

    def sampled(self, tokens: torch.Tensor) -> None:
        pass


def _processes(params: Sequence[SamplingParams]) -> bool:
    """Whether any row changes its logits before the choice (one flag test for a plain step)."""
    return bool(flags_of(params) & PROCESSES_LOGITS)


class LogitBiasRule(RequestRule):
    """``logit_bias``: each row's bias added to its logits."""

    name = "logit_bias"

    def adjust(self, rows: Sequence[Any], params: Sequence[SamplingParams]) -> LogitsAdjust | None:
        if not _processes(params) or not any(p.logit_bias for p in params):
            return None
        return _Adjust(apply_logit_bias, list(params))


class AllowedTokensRule(RequestRule):
    """``allowed_token_ids``: every other token of the row at -inf."""

    name = "allowed_token_ids"

    def adjust(self, rows: Sequence[Any], params: Sequence[SamplingParams]) -> LogitsAdjust | None:
        if not _processes(params) or all(p.allowed_token_ids is None for p in params):
            return None
        return _Adjust(apply_allowed_tokens, list(params))


class PenaltiesRule(RequestRule):
    """Presence, frequency and repetition penalties over the device's token counts (``state``, made
    on the logits' device at the first penalized step)."""

    name = "penalties"

    def __init__(self) -> None:
        self.state: PenaltyState | None = None

    def adjust(self, rows: Sequence[Any], params: Sequence[SamplingParams]) -> LogitsAdjust | None:
        if not _processes(params) or not any(p.needs_counts for p in params):
            return None
        return _Penalize(self, list(rows), list(params))


class _Penalize:
    """One step's penalties: applied to the rows that ask, their sampled tokens counted after."""

    def __init__(self, rule: PenaltiesRule, rows: list[Any], params: list[SamplingParams]) -> None:
        self.rule, self.rows, self.params = rule, rows, params
        self.taken: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, logits: torch.Tensor) -> None:
        if self.rule.state is None:
            self.rule.state = PenaltyState(logits.device)
        state = self.rule.state
        state.release(sequence_ended)
        self.taken = state.apply(logits, self.params, self.rows, prompt_and_output)

    def sampled(self, tokens: torch.Tensor) -> None:
        if self.taken is not None and self.rule.state is not None:
            self.rule.state.record(self.taken, tokens)


__all__ = [
    "AllowedTokensRule",
    "LogitBiasRule",
    "Penalized",
    "PenaltiesRule",
    "PenaltyState",
    "apply_allowed_tokens",
    "apply_logit_bias",
    "apply_penalties",
    "prompt_and_output",
    "sequence_ended",
]
