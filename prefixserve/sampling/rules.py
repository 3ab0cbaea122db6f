"""Request rules: what a request asks of its sampling beyond the sampler's parameters, behind one interface
(as vLLM v1's logits processors), so the engine calls the same few hooks whatever the features.

A rule (``RequestRule``) overrides the hooks it needs; the engine calls each hook of the ``RuleSet``
once per request (intake) or once per step for all of the step's rows, never once per row:

* ``check(params, tokenizer)``: at intake, before the request is made: refuse what the rule cannot
  serve (a ValueError naming the field; nothing is queued then) or prepare what it will need (a
  grammar compiled once per spec).
* ``admit(request, tokenizer)``: the request's own state for the rule, made once its prompt's tokens
  are known (None: the rule does not apply to it). The set keeps it in ``Request.rules[rule.name]``,
  where the rule reads it back; a state per sample is the rule's to key (by ``Sequence.index``).
* ``waits(samplers, indices, params)``: launch-ahead: must the step's sampling wait for the tokens
  of the step ahead of it (still on the device, placeholders on the host) because the rule's ban or
  mask reads them? True makes the engine sample it at the next step, once they have arrived.
* ``ban(samplers, indices, params)``: a ``TokenBan`` for the step's rows (tokens they may not choose,
  or the one they must), or None. ``mask(...)``: a ``LogitsMask`` (``apply(logits)`` in place, e.g. a
  grammar's token bitmask), or None. The set joins them: one ban and one mask go to the sampler.
* ``adjust(rows, params)``: a ``LogitsAdjust`` for the step's sample rows (``rows[i]``: the
  sequence row i samples for, speculated rows included), or None: it changes, on the device, the copy
  of the logits the choice is made from (the raw ones still give the logprobs: vLLM's raw
  logprobs), and sees the step's sampled tokens on the device right after the choice
  (``sampled``), so its device state needs no host token: ``logit_bias``, ``allowed_token_ids`` and
  the penalties, whose token counts follow the sampled tokens in stream order even under
  launch-ahead, where the host has only placeholders for them (``penalties.py``).
* ``advance(samplers, indices, tokens, pending, then)``: the step's sampled tokens, as they are put in
  place (``pending``: the engine's in-flight tokens, which say whether a row's token is placed at
  all); ``then``: the samplers of the step launched after it whose sampling waits for these tokens
  (launch-ahead), so a rule may start that step's work now (structured decoding fills its mask).
  Tokens taken as soon as their sampling went out (a host-bound step, ``Engine._take_tokens``) come
  before the next step is planned, with ``samplers`` itself as ``then``: a guess, which a rule checks
  against the step that comes.

Row conventions, as the engine hands them: ``samplers[i]`` samples the token at ``indices[i]`` of its
token ids, under ``params[i]``; ``params`` is a ``RowParams`` whose ``flags`` (``params.param_flags``)
gate a rule's work with one test, so a step none of whose rows asks costs a rule one branch. Rows of
speculated sequences follow the samplers' in ``params``; ``ban`` and ``mask`` see the samplers' only.

The runner applies a step's adjusts, then its ban, to one copy of the logits (after the mask, which
the raw logits take too); a step with neither keeps the sampler's untouched path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from prefixserve.sampling.params import SamplingParams, leading_rows
from prefixserve.sampling.token_ban import TokenBan, joined

if TYPE_CHECKING:
    from prefixserve.sampling.sampler import SampleFuture


class RuleRequest(Protocol):
    """What rules read of a request (the engine's ``Request``; the sampling layer never imports it)."""

    params: SamplingParams
    rules: MutableMapping[str, Any]  # each rule's state, by the rule's name
    prompt_token_ids: Sequence[int]
    num_prompt_tokens: int


class RuleSequence(Protocol):
    """What rules read of a sampling sequence (the engine's ``Sequence``)."""

    index: int  # which of its request's samples
    token_ids: Any  # prompt, then output (placeholders, negative, for tokens still on the device)
    request: Any  # a RuleRequest

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...


class LogitsMask(Protocol):
    """A step's mask of the logits the choice is made from (rows it does not name are left alone)."""

    def apply(self, logits: torch.Tensor) -> None: ...


class ChoosingMask(LogitsMask, Protocol):
    """A mask that can also make a step's greedy choice itself, where every row is greedy and nothing
    else processes the logits (a grammar's mask waited for on the device: the wait, the mask and the
    argmax in one launch, ``structured/gate.py``). The runner looks for ``choose``."""

    def choose(self, logits: torch.Tensor) -> SampleFuture: ...


class LogitsAdjust(Protocol):
    """A step's change of the logits the choice is made from, on the device (see ``adjust``)."""

    def apply(self, logits: torch.Tensor) -> None:
        """Change ``logits`` [rows, V] fp32 (the copy the choice is made from) in place."""

    def sampled(self, tokens: torch.Tensor) -> None:
        """The step's sampled tokens [rows] on the device, right after the choice."""


@dataclass(slots=True)
class Adjusts:
    """Several rules' adjusts of one step, applied in the rules' order."""

    parts: list[LogitsAdjust]

    def apply(self, logits: torch.Tensor) -> None:
        for part in self.parts:
            part.apply(logits)

    def sampled(self, tokens: torch.Tensor) -> None:
        for part in self.parts:
            part.sampled(tokens)


@dataclass(slots=True)
class Masks:
    """Several rules' masks of one step, applied in turn: a token stays only where every mask allows it."""

    parts: list[LogitsMask]

    def apply(self, logits: torch.Tensor) -> None:
        for part in self.parts:
            part.apply(logits)


def joined_masks(a: LogitsMask | None, b: LogitsMask | None) -> LogitsMask | None:
    """Both masks at once (one of them as it is where the other is None)."""
    if a is None or b is None:
        return a or b
    parts = a.parts if isinstance(a, Masks) else [a]
    return Masks([*parts, *(b.parts if isinstance(b, Masks) else [b])])


class RequestRule:
    """One request feature's hooks (see the module's docstring); each default does nothing, and the
    ``RuleSet`` calls only the hooks a rule overrides. ``name`` keys the rule's per-request state."""

    name: str = ""

    def check(self, params: SamplingParams, tokenizer: Any) -> None:
        """Refuse ``params`` (ValueError naming the problem) or prepare for them; before the request
        is made."""

    def admit(self, request: RuleRequest, tokenizer: Any) -> Any | None:
        """The request's state for this rule (None: the rule does not apply to it)."""
        return None

    def waits(
        self, samplers: Sequence[RuleSequence], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> bool:
        """Does the step's sampling read the tokens ahead of it on the host (launch-ahead)?"""
        return False

    def ban(
        self, samplers: Sequence[RuleSequence], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> TokenBan | None:
        """The tokens the step's rows may not choose (or must), or None."""
        return None

    def mask(
        self, samplers: Sequence[RuleSequence], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> LogitsMask | None:
        """A mask of the step's logits, or None."""
        return None

    def adjust(self, rows: Sequence[RuleSequence], params: Sequence[SamplingParams]) -> LogitsAdjust | None:
        """A change of the step's logits on the device, or None (see the module's docstring)."""
        return None

    def advance(
        self,
        samplers: Sequence[RuleSequence],
        indices: Sequence[int],
        tokens: Sequence[int],
        pending: Mapping[Any, Any],
        then: Sequence[RuleSequence] | None,
    ) -> None:
        """The step's tokens, before they are put in place (see the module's docstring)."""


HOOKS = ("check", "admit", "waits", "ban", "mask", "adjust", "advance")


class RuleSet:
    """The engine's rules, in order, each hook called for all of them: built once, at engine setup
    (``engine/request_rules.py``). Bans are joined in the rules' order (a ban beats a forced token
    whatever the order, ``TokenBan.apply``); masks are applied in turn; ``waits`` stops at the first
    rule that waits; ``check`` raises the first rule's refusal."""

    def __init__(self, rules: Iterable[RequestRule]) -> None:
        self.rules = tuple(rules)
        names = [rule.name for rule in self.rules]
        if not all(names) or len(set(names)) != len(names):
            raise ValueError(f"each request rule needs a name of its own; got {names}")
        # the rules that override each hook: a step calls no hook that would do nothing
        self._checks, self._admits, self._waits, self._bans, self._masks, self._adjusts, self._advances = (
            tuple(rule for rule in self.rules if _overrides(rule, hook)) for hook in HOOKS
        )

    def find(self, name: str) -> Any:
        """The rule called ``name``; KeyError if there is none."""
        for rule in self.rules:
            if rule.name == name:
                return rule
        raise KeyError(name)

    def check(self, params: SamplingParams, tokenizer: Any) -> None:
        for rule in self._checks:
            rule.check(params, tokenizer)

    def admit(self, request: RuleRequest, tokenizer: Any) -> None:
        """Each rule's state for ``request``, kept in ``request.rules`` where the rule applies."""
        states = request.rules
        for rule in self._admits:
            state = rule.admit(request, tokenizer)
            if state is not None:
                states[rule.name] = state

    def waits(
        self, samplers: Sequence[RuleSequence], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> bool:
        return any(rule.waits(samplers, indices, params) for rule in self._waits)

    def restrict(
        self, samplers: Sequence[RuleSequence], indices: Sequence[int], params: list[SamplingParams]
    ) -> tuple[LogitsMask | None, TokenBan | None]:
        """The step's mask and ban, every rule's joined (None where no rule has any)."""
        own = leading_rows(params, len(samplers))  # speculated rows follow, under no rule
        mask: LogitsMask | None = None
        for rule in self._masks:
            mask = joined_masks(mask, rule.mask(samplers, indices, own))
        ban: TokenBan | None = None
        for rule in self._bans:
            ban = joined(ban, rule.ban(samplers, indices, own))
        return mask, ban

    def adjust(self, rows: Sequence[RuleSequence], params: list[SamplingParams]) -> LogitsAdjust | None:
        """The step's adjusts, every rule's in order (None where no rule has any)."""
        parts = [a for rule in self._adjusts if (a := rule.adjust(rows, params)) is not None]
        return None if not parts else parts[0] if len(parts) == 1 else Adjusts(parts)

    def advance(
        self,
        samplers: Sequence[RuleSequence],
        indices: Sequence[int],
        tokens: Sequence[int],
        pending: Mapping[Any, Any],
        then: Sequence[RuleSequence] | None = None,
    ) -> None:
        for rule in self._advances:
            rule.advance(samplers, indices, tokens, pending, then)


def _overrides(rule: Any, hook: str) -> bool:
    """Does ``rule`` do anything on ``hook`` (a ``RequestRule`` that overrides it, or any other object
    that has it)?"""
    own = getattr(type(rule), hook, None)
    return own is not None and own is not getattr(RequestRule, hook)


__all__ = [
    "HOOKS",
    "Adjusts",
    "ChoosingMask",
    "LogitsAdjust",
    "LogitsMask",
    "Masks",
    "RequestRule",
    "RuleRequest",
    "RuleSequence",
    "RuleSet",
    "joined_masks",
]
