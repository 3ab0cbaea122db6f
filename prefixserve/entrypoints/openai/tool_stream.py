"""Streaming a chat whose output may be tool calls: ``delta.tool_calls`` as the OpenAI API sends them.

A choice whose output is (or may still become) a tool call is held back: with ``required`` or a named
function always, with ``auto`` while its text is empty or starts like ``<tool_call>`` (or ``{``, a
bare call). When it finishes, its calls go out as OpenAI streams them: per call, a first delta with
``index``, ``id``, ``type`` and the function's ``name`` (arguments ""), then the arguments in pieces,
then a last chunk with ``finish_reason: "tool_calls"``; an output that held no call after all goes
out as content. Any other choice streams its text as usual (``format.StreamState``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from prefixserve.entrypoints.openai import format as fmt
from prefixserve.entrypoints.openai.tools import Tools, tool_message
from prefixserve.outputs import RequestOutput

ARGUMENT_PIECE = 16  # characters of arguments per delta


def _maybe_call(text: str) -> bool:
    head = text.lstrip()
    return not head or head.startswith(("<tool_call>", "{")) or "<tool_call>".startswith(head)


@dataclass
class ToolStreamState(fmt.StreamState):
    tools: Tools | None = None
    held: dict[int, bool] = field(default_factory=dict)  # choice index -> still held back

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        chunks: list[str] = []
        plain = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            held = self.held.get(index, True)
            if held and (self.tools.choice != "auto" or _maybe_call(c.text)):
                if c.finished and not self.choices.get(index, fmt._Choice()).done:
                    chunks += self._finish_held(index, c.text, c.finish_reason)
                continue
            self.held[index] = False
            plain.append(c)
        if plain:
            shown = copy.copy(out)
            shown.outputs = plain
            chunks += super().update(prompt_index, shown)
        return chunks

    def _finish_held(self, index: int, text: str, finish: str | None) -> list[str]:
        self.choices.setdefault(index, fmt._Choice()).done = True
        message, reason = tool_message(text, finish, self.tools)
        calls = message.get("tool_calls")
        if not calls:
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
            return [self.chunk([choice])]
        chunks = []
        if message.get("content"):
            chunks.append(self._delta(index, {"content": message["content"]}))
        for k, call in enumerate(calls):
            fn = call["function"]
            head = {
                "index": k,
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": ""},
            }
            chunks.append(self._delta(index, {"tool_calls": [head]}))
            args = fn["arguments"]
            for at in range(0, len(args), ARGUMENT_PIECE):
                piece = {"index": k, "function": {"arguments": args[at : at + ARGUMENT_PIECE]}}
                chunks.append(self._delta(index, {"tool_calls": [piece]}))
        chunks.append(self.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
        return chunks

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        return self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])


__all__ = ["ToolStreamState"]
