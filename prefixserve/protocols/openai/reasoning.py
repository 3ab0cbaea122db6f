"""Reasoning outputs (vLLM's ``--reasoning-parser``): a thinking model's ``<think> ... </think>``
apart from its answer, as ``reasoning_content`` (the DeepSeek API's name; ``reasoning`` too, vLLM's
newer one) beside ``content``.

The reasoning runs from the start of the output, or from a leading ``<think>``, to ``</think>``, and
the answer is what follows; an output cut before ``</think>`` is all reasoning. ``deepseek_r1`` (R1,
its Qwen and Llama distills, QwQ) reads every output so, as vLLM's: R1 may start thinking without
the tag. ``qwen3`` reads an output as reasoning only where the template opened ``<think>`` after the
last message (the R1 distills' templates do) or the output opens with it; otherwise (thinking off)
the output is all answer. Tool calls and the answer's other reading happen
on the answer alone. Streamed, the reasoning goes out as ``delta.reasoning_content`` as it settles
(never a half tag), then the answer through the usual stream state (``ReasoningStream``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.config import REASONING_PARSERS as PARSERS  # vLLM's names; both take the rule above
from prefixserve.outputs import RequestOutput
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.text_tokens import TextTokens
from prefixserve.sampling.thinking_budget import THINK_END, THINK_START

START, END = THINK_START, THINK_END


@dataclass(frozen=True, slots=True)
class Thinking:
    """How one chat's output is read: ``opened`` where its prompt ended inside ``<think>``."""

    opened: bool

    @classmethod
    def for_prompt(
        cls, prompt: str, last: str = "", continued: bool = False, parser: str = "qwen3"
    ) -> Thinking:
        """Opened where the prompt's last ``<think>`` is not closed in what the template wrote after
        the last message (``last``, its text) or, for an assistant's prefill (``continued``:
        ``continue_final_message``), in that message and after: a ``<think>`` inside a message's
        text opens nothing (a user asking about the tag). ``deepseek_r1``: always opened."""
        if parser == "deepseek_r1":
            return cls(opened=True)
        at = prompt.rfind(last) if last else -1
        tail = prompt if at < 0 else prompt[at if continued else at + len(last) :]
        return cls(opened=tail.rfind(START) > tail.rfind(END))

    def answer_at(self, text: str) -> int:
        """Where the answer starts in a whole output (0 where it has no reasoning)."""
        reasoning, answer = self.split(text)
        return 0 if reasoning is None else len(text) - len(answer)

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning or None, the answer) of a whole output."""
        head = text.lstrip()
        if not self.opened and not head.startswith(START):
            return None, text
        body = head[len(START) :] if head.startswith(START) else text
        at = body.find(END)
        if at < 0:
            return body, ""
        return body[:at], body[at + len(END) :]


@dataclass(slots=True)
class _Choice:
    """Where one streamed choice stands: ``phase`` None (not known yet: the output may still open
    with ``<think>``), "reasoning" from ``start`` on, or "answer" from ``start`` on."""

    phase: str | None = None
    start: int = 0
    sent: int = 0  # reasoning characters sent (from ``start``)


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may be the start of ``tag`` (or half a character)."""
    upto = len(text.rstrip("\ufffd"))
    for k in range(min(len(tag) - 1, upto), 0, -1):
        if text[:upto].endswith(tag[:k]):
            return len(text) - upto + k
    return len(text) - upto


@dataclass
class ReasoningSplit:
    """Splits a stream's cumulative outputs: reasoning deltas out, the answer's text left.
    ``counter``: makes a choice's ``TextTokens`` (where logprobs go with the reasoning chunks)."""

    thinking: Thinking
    counter: Callable[[], TextTokens] | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    counters: dict[int, TextTokens] = field(default_factory=dict)

    def reasoned(self, index: int) -> int:
        """Characters of choice ``index``'s output up to the end of the reasoning sent."""
        state = self.choices[index]
        return state.start + state.sent if state.phase == "reasoning" else state.start

    def tokens_within(self, index: int, ids: Sequence[int], chars: int) -> int:
        assert self.counter is not None
        counter = self.counters.get(index)
        if counter is None:
            counter = self.counters[index] = self.counter()
        return counter.within(ids, chars)

    def advance(self, index: int, text: str, finished: bool) -> tuple[str, str | None]:
        """(the reasoning settled since the last call, the answer's text so far or None while the
        output is still reasoning, or may still open with ``<think>``)."""
        state = self.choices.setdefault(index, _Choice())
        if state.phase is None:
            head = text.lstrip()
            if head.startswith(START):
                state.phase, state.start = "reasoning", len(text) - len(head) + len(START)
            elif not finished and START.startswith(head):
                return "", None  # nothing yet, or what may still be the tag
            else:  # from the first character: reasoning where the prompt opened it, else the answer
                state.phase = "reasoning" if self.thinking.opened else "answer"
        if state.phase == "answer":
            return "", text[state.start :]
        body = text[state.start :]
        at = body.find(END)
        upto = at if at >= 0 else len(body) if finished else len(body) - _held(body, END)
        delta, state.sent = body[state.sent : max(upto, state.sent)], max(upto, state.sent)
        if at < 0:
            return delta, "" if finished else None
        state.phase, state.start = "answer", state.start + at + len(END)
        return delta, text[state.start :]


class ReasoningStream:
    """Mixed in before a chat stream state: each choice's reasoning as ``reasoning_content`` deltas,
    its answer through the state's own ``update`` (text, tool calls, logprobs, finish)."""

    reasoning: ReasoningSplit
    n: int

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        chunks: list[str] = self.before(out)  # type: ignore[attr-defined]
        answers = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            delta, answer = self.reasoning.advance(index, c.text, c.finished)
            if delta:
                self.count(out, c)  # type: ignore[attr-defined]  # continuous usage: these chunks' too
                choice = reasoning_choice(index, delta, self._logprobs(index, c))
                chunks.append(self.chunk([choice]))  # type: ignore[attr-defined]
            if answer is not None:
                answers.append(dataclasses.replace(c, text=answer))
        if answers:
            shown = copy.copy(out)
            shown.outputs = answers
            chunks += super().update(prompt_index, shown)  # type: ignore[misc]
        return chunks

    def _logprobs(self, index: int, c: Any) -> dict[str, Any] | None:
        """The logprobs of the tokens that wrote the reasoning sent so far and were not sent yet;
        the stream state's own count moves past them (the answer's chunks carry the rest)."""
        if not self.want_logprobs or self.reasoning.counter is None:  # type: ignore[attr-defined]
            return None
        split = self.reasoning
        end = split.tokens_within(index, c.token_ids, split.reasoned(index))
        sent = self.choices.setdefault(index, fmt._Choice())  # type: ignore[attr-defined]
        if end <= sent.tokens:
            return None
        lp = fmt.chat_logprobs(c, sent.tokens, end, self.token_text)  # type: ignore[attr-defined]
        sent.tokens = end
        return lp


@functools.cache
def reasoning_kind(kind: type) -> type:
    """``kind`` (a stream state class) with its reasoning apart."""
    return type(f"Reasoning{kind.__name__}", (ReasoningStream, kind), {})


def reasoning_choice(index: int, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    delta = {"reasoning_content": text, "reasoning": text}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}


def with_reasoning(message: dict[str, Any], reasoning: str) -> dict[str, Any]:
    """A non-streamed chat message with its reasoning beside it (``content`` None where the answer
    is empty, as vLLM answers)."""
    return {**message, "content": message.get("content") or None, "reasoning_content": reasoning,
            "reasoning": reasoning}  # fmt: skip


__all__ = ["PARSERS", "ReasoningSplit", "ReasoningStream", "Thinking", "reasoning_kind", "with_reasoning"]
