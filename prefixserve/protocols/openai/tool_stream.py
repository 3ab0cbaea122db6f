"""Streaming a chat whose output may be tool calls: ``delta.tool_calls`` as the OpenAI API sends them.

A choice whose output is (or may still become) a tool call is held back: with ``required`` or a named
function always, with ``auto`` while its text is empty or starts like ``<tool_call>`` (or ``{``, a
bare call). When it finishes, its calls go out as OpenAI streams them: per call, a first delta with
``index``, ``id``, ``type`` and the function's ``name`` (arguments ""), then the arguments in pieces,
then a last chunk with ``finish_reason: "tool_calls"``; an output that held no call after all goes
out as content (with its logprobs, when asked), and the first chunk of calls carries the logprobs
not yet sent. Any other choice streams its text as usual
(``format.StreamState``), up to a ``<tool_call>`` tag under ``auto`` (text that may be the start of
one is held back): a reply that opens with text and then calls streams the text, then the calls,
as the non-streamed reply holds both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from prefixserve.outputs import RequestOutput
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.tools import CALL_TAG, Tools, tool_message

ARGUMENT_PIECE = 16  # characters of arguments per delta


def _maybe_call(text: str) -> bool:
    head = text.lstrip()
    return not head or head.startswith((CALL_TAG, "{")) or CALL_TAG.startswith(head)


@dataclass
class ToolStreamState(fmt.StreamState):
    tools: Tools | None = None
    held: dict[int, bool] = field(default_factory=dict)  # choice index -> still held back

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        chunks: list[str] = []
        plain = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            self.count(out, c)
            held = self.held.get(index, True)
            if held and (self.tools.choice != "auto" or _maybe_call(c.text)):
                if c.finished and not self.choices.get(index, fmt._Choice()).done:
                    chunks += self._finish_held(index, c)
                continue
            self.held[index] = False
            if c.finished and CALL_TAG in c.text and not self.choices.get(index, fmt._Choice()).done:
                message, reason = tool_message(c.text, c.finish_reason, self.tools)
                if message.get("tool_calls"):  # text, then calls (else the rest goes out as text)
                    chunks += self._finish_after_text(index, c, message, reason)
                    continue
            plain.append(c)
        if plain:
            shown = copy.copy(out)
            shown.outputs = plain
            chunks += super().update(prompt_index, shown)
        return chunks

    def _settled(self, text: str) -> int:
        """As the plain stream's, and under ``auto`` never past a ``<tool_call>`` tag or a tail that may
        be the start of one (the tool calls go out when the choice finishes)."""
        upto = super()._settled(text)
        if self.tools is None or self.tools.choice != "auto":
            return upto
        at = text.find(CALL_TAG)
        if at >= 0:
            return min(upto, at)
        for k in range(min(len(CALL_TAG) - 1, upto), 0, -1):
            if text[:upto].endswith(CALL_TAG[:k]):
                return upto - k
        return upto

    def _finish_held(self, index: int, c: Any) -> list[str]:
        state = self.choices.setdefault(index, fmt._Choice())
        state.done = True
        message, reason = tool_message(c.text, c.finish_reason, self.tools)
        calls = message.get("tool_calls")
        if not calls:
            lp = None
            if self.want_logprobs:  # those not sent yet (a reasoning parser streamed its tokens')
                end = len(c.token_logprobs or ())
                lp = fmt.chat_logprobs(c, state.tokens, end, self.token_text)
                state.tokens = end
            choice = {"index": index, "delta": {"content": c.text}, "logprobs": lp, "finish_reason": reason}
            return [self.chunk([choice])]
        return self._calls(index, c, message, reason, message.get("content"))

    def _finish_after_text(
        self, index: int, c: Any, message: dict[str, Any], reason: str | None
    ) -> list[str]:
        """An ``auto`` choice that streamed text and then wrote ``<tool_call>``: the text not yet sent
        before the tag, then its calls."""
        state = self.choices.setdefault(index, fmt._Choice())
        state.done = True
        rest = c.text[state.chars : c.text.find(CALL_TAG)]  # the streamed text held no tag's start
        return self._calls(index, c, message, reason, rest or None)

    def _calls(
        self, index: int, c: Any, message: dict[str, Any], reason: str | None, content: str | None
    ) -> list[str]:
        """The rest of the content, then the calls; the logprobs not yet sent ride on the first chunk
        (the non-streamed reply holds every token's)."""
        state = self.choices.setdefault(index, fmt._Choice())
        lp = None
        if self.want_logprobs:
            end = len(c.token_logprobs or ())
            lp = fmt.chat_logprobs(c, state.tokens, end, self.token_text)
            state.tokens = end
        calls = message["tool_calls"]
        chunks = []
        if content:
            chunks.append(self._delta(index, {"content": content}, lp))
            lp = None
        for k, call in enumerate(calls):
            fn = call["function"]
            head = {
                "index": k,
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": ""},
            }
            chunks.append(self._delta(index, {"tool_calls": [head]}, lp))
            lp = None
            args = fn["arguments"]
            for at in range(0, len(args), ARGUMENT_PIECE):
                piece = {"index": k, "function": {"arguments": args[at : at + ARGUMENT_PIECE]}}
                chunks.append(self._delta(index, {"tool_calls": [piece]}))
        chunks.append(self.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
        return chunks

    def _delta(self, index: int, delta: dict[str, Any], logprobs: Any = None) -> str:
        return self.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])


__all__ = ["ToolStreamState"]
