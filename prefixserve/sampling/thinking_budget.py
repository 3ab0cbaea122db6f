"""``thinking_token_budget`` (vLLM's): a reasoning model thinks for at most that many tokens.

A sample's thinking starts where its prompt left a ``<think>`` open (a template that opens it, a
prefill inside one: the prompt's tokens after the tag count too, as vLLM's budget counts them) or
where its output opens with ``<think>``, as the reasoning parser reads outputs
(``entrypoints/openai/reasoning.py``). Once ``budget`` tokens have followed the opening without a
``</think>``, the end tag's tokens are forced, one per step (every other logit -inf, on the logits
the choice is made from: logprobs stay the model's), and the answer follows as the model goes on.
A ``</think>`` the model writes itself ends the count. The output's tags are matched as token ids,
as vLLM's budget matches them: reasoning models write them as single tokens of their own.

A sample's reading of its output (``BudgetState``) advances over the tokens on the host since the
last step, so a step costs O(new tokens). Under launch-ahead the token just sampled is still on the
device: a step where it could decide a force (the count within reach of the budget, or the opening
still undecided) samples after the tokens ahead of it have arrived (``waits_for_tokens``), as grammar
rows do; the steps before that keep launching ahead.

A request rule (``ThinkingBudgetRule``, ``rules.py``): intake checks the request and makes its
``ThinkingBudget`` (its state, in ``Request.rules["thinking_budget"]``); each step forces by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixserve.sampling.params import THINKING_BUDGET, SamplingParams, flags_of
from prefixserve.sampling.rules import RequestRule, RuleRequest
from prefixserve.sampling.token_ban import TokenBan

THINK_START, THINK_END = "<think>", "</think>"  # both reasoning parsers' tags (vLLM's deepseek_r1, qwen3)
PROMPT_TAIL = 16  # prompt ids decoded to see whether it ends with <think>
NAME = "thinking_budget"  # the rule's name: a request's ``ThinkingBudget`` is ``Request.rules[NAME]``


@dataclass(frozen=True, slots=True)
class ThinkingTags:
    """The tags' token ids in the model's tokenizer."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    @classmethod
    def encode(cls, tokenizer: Any) -> ThinkingTags:
        start = tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
        end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
        return cls(start, end)


def prompt_thought(prompt: Sequence[int], tokenizer: Any, tags: ThinkingTags) -> int | None:
    """The prompt's own thought: where its last ``<think>`` is not closed after it (a template that
    opens it, an assistant's prefill that stopped inside it), the tokens after the tag, which count
    toward the budget, as vLLM's count them; None where the prompt opened no thought. The tags are
    found as token ids (vLLM's way), or as the text of the prompt's last ids ending with ``<think>``
    however its characters were split into tokens (then 0 tokens after it)."""
    start, end = _last(prompt, tags.start), _last(prompt, tags.end)
    if start > end:
        return len(prompt) - start - len(tags.start)
    tail = tokenizer.decode(list(prompt[-PROMPT_TAIL:]), skip_special_tokens=False)
    return 0 if tail.rstrip().endswith(THINK_START) else None


def _last(ids: Sequence[int], sub: tuple[int, ...]) -> int:
    """Where ``sub`` last starts in ``ids`` (-1: nowhere)."""
    n, first = len(sub), sub[0] if sub else None
    for at in range(len(ids) - n, -1, -1):
        if ids[at] == first and tuple(ids[at : at + n]) == sub:
            return at
    return -1


@dataclass(slots=True)
class BudgetState:
    """One sample's reading of its output: ``inside`` its thinking after the opening, ``count`` the
    tokens there so far, ``done`` once it closed (or never opened)."""

    seen: int = 0  # output tokens read
    inside: bool = False
    count: int = 0
    done: bool = False
    opened_at: int = 0  # where the thinking's own tokens start in the output (after its <think>)


@dataclass(slots=True)
class ThinkingBudget:
    """A request's budget, made at intake; each of its samples reads its own output."""

    budget: int
    tags: ThinkingTags
    opened: bool  # the prompt left a <think> open
    thought: int = 0  # the prompt's tokens after it, counted toward the budget
    states: dict[int, BudgetState] = field(default_factory=dict)

    def read(self, index: int, output: Sequence[int]) -> BudgetState:
        """Sample ``index``'s state after the known tokens of ``output`` (stopping at the first one still
        on the device, a negative placeholder)."""
        state = self.states.get(index)
        if state is None:
            state = self.states[index] = BudgetState(
                inside=self.opened, count=self.thought if self.opened else 0
            )
        start, end = self.tags.start, self.tags.end
        while not state.done and state.seen < len(output) and output[state.seen] >= 0:
            state.seen += 1
            if not state.inside:  # the output must open with the whole start tag
                if output[state.seen - 1] != start[state.seen - 1]:
                    state.done = True
                elif state.seen == len(start):
                    state.inside, state.opened_at = True, state.seen
            elif (
                state.seen - len(end) >= state.opened_at
                and tuple(output[state.seen - len(end) : state.seen]) == end
            ):
                state.done = True
            else:
                state.count += 1
        return state

    def forced(self, state: BudgetState, output: Sequence[int]) -> int | None:
        """The token the next choice must be (the end tag's next one), or None to choose freely."""
        if state.done or not state.inside or state.count < self.budget:
            return None
        end = self.tags.end
        tail = output[max(state.opened_at, state.seen - len(end) + 1) : state.seen]
        for k in range(min(len(end) - 1, len(tail)), 0, -1):  # the end tag's part already written
            if tuple(tail[len(tail) - k :]) == end[:k]:
                return end[k]
        return end[0]

    def unsure(self, state: BudgetState, unknown: int) -> bool:
        """Whether ``unknown`` tokens not yet on the host could make the next choice a forced one."""
        if state.done:
            return False
        if state.inside:
            return state.count + unknown >= self.budget
        return unknown - (len(self.tags.start) - state.seen) >= self.budget


def thinking_budget(
    params: SamplingParams, tokenizer: Any, prompt: Sequence[int], parser: str | None
) -> ThinkingBudget | None:
    """A request's budget at intake (None without one). ``deepseek_r1`` outputs think from their
    start, as that parser reads them (a leading ``<think>`` then counts as thought)."""
    if params.thinking_token_budget is None:
        return None
    tags = ThinkingTags.encode(tokenizer)
    thought = prompt_thought(prompt, tokenizer, tags)
    opened = parser == "deepseek_r1" or thought is not None
    return ThinkingBudget(params.thinking_token_budget, tags, opened, thought or 0)


class Asked(Protocol):
    rules: dict[str, Any]  # a budget at NAME


class Sampling(Protocol):
    """What the force reads of a sampling sequence (the engine's ``Sequence``)."""

    index: int
    num_prompt_tokens: int
    token_ids: Any
    request: Asked


class _Output(Sequence[int]):
    """A sequence's output tokens before ``end``, read in place: the reading each step touches only
    the new ones and the end tag's width, where a slice would copy the whole thought."""

    __slots__ = ("end", "first", "ids")

    def __init__(self, ids: Any, first: int, end: int) -> None:
        self.ids, self.first, self.end = ids, first, end

    def __len__(self) -> int:
        return self.end - self.first

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, _ = i.indices(len(self))
            return self.ids[self.first + start : self.first + stop]
        return self.ids[self.first + i]


def _rows(samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]) -> Any:
    """(row, sequence, its budget, its output before the sampled token) of each row with a budget
    whose thought may still be cut."""
    if not flags_of(params) & THINKING_BUDGET:
        return
    for r, (seq, at) in enumerate(zip(samplers, indices, strict=True)):
        budget = seq.request.rules.get(NAME)
        state = None if budget is None else budget.states.get(seq.index)
        if budget is not None and (state is None or not state.done):
            yield r, seq, budget, _Output(seq.token_ids, seq.num_prompt_tokens, at)


def waits_for_tokens(
    samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
) -> bool:
    """Does a step's sampling need the tokens ahead of it to know whether a row is forced?"""
    for _, seq, budget, output in _rows(samplers, indices, params):
        state = budget.read(seq.index, output)
        if budget.unsure(state, len(output) - state.seen):
            return True
    return False


def thinking_force(
    samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
) -> TokenBan | None:
    """The rows whose next token is forced to end their thinking (``samplers[i]`` samples the token at
    ``indices[i]`` of its ids), as a ``TokenBan`` of forced rows; None when there are none."""
    rows: list[int] = []
    ids: list[int] = []
    for r, seq, budget, output in _rows(samplers, indices, params):
        token = budget.forced(budget.read(seq.index, output), output)
        if token is not None:
            rows.append(r)
            ids.append(token)
    return TokenBan([], [], rows, ids) if rows else None


class ThinkingBudgetRule(RequestRule):
    """``thinking_token_budget`` as a request rule: checked and made at intake, forced each step.

    ``reasoning_parser``: the engine's (``EngineConfig.reasoning_parser``), which says where a model's
    thinking is; a budget needs one."""

    name = NAME

    def __init__(self, reasoning_parser: str | None) -> None:
        self.reasoning_parser = reasoning_parser

    def check(self, params: SamplingParams, tokenizer: Any) -> None:
        """A budget needs a reasoning parser and a tokenizer (the tags' ids); beside a grammar, the
        grammar must start after the thought (the forced end tag would break it)."""
        if params.thinking_token_budget is None:
            return
        if self.reasoning_parser is None:
            raise ValueError(
                "thinking_token_budget needs a reasoning parser: start the engine with one "
                "(--reasoning-parser, EngineConfig.reasoning_parser)"
            )
        if tokenizer is None:
            raise ValueError("thinking_token_budget needs a tokenizer: this model has none")
        so = params.structured_outputs
        if so is not None and so.after_thinking is None:
            raise ValueError(
                "thinking_token_budget with structured outputs needs the constraint after the thought: "
                "set structured_outputs.after_thinking ('opened' or 'optional'; chats set it themselves)"
            )

    def admit(self, request: RuleRequest, tokenizer: Any) -> ThinkingBudget | None:
        params = request.params
        return thinking_budget(params, tokenizer, request.prompt_token_ids, self.reasoning_parser)

    def waits(
        self, samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> bool:
        return waits_for_tokens(samplers, indices, params)

    def ban(
        self, samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> TokenBan | None:
        return thinking_force(samplers, indices, params)


__all__ = [
    "NAME",
    "THINK_END",
    "THINK_START",
    "BudgetState",
    "ThinkingBudget",
    "ThinkingBudgetRule",
    "ThinkingTags",
    "prompt_thought",
    "thinking_budget",
    "thinking_force",
    "waits_for_tokens",
]
