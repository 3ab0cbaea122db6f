"""Streaming a message: the Messages API's events, from the chat stream's choices.

The chat stream states decide what text is settled (``format.StreamState``: no half character, no
possible start of a stop sequence) and when a tool call is whole (``tool_stream.ToolStreamState``);
each chat choice they would send becomes the events Anthropic sends instead: ``message_start``
(the message without content, its usage so far) with the first output; per content block
``content_block_start``, its deltas (``text_delta``, or ``input_json_delta`` holding the tool's
input) and ``content_block_stop``; ``message_delta`` (the stop reason and the usage) and
``message_stop`` last. An error after the start is an ``error`` event, and the stream ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prefixserve.outputs import RequestOutput
from prefixserve.protocols.anthropic.prepare import (
    MessageCall,
    cut_call,
    error_of,
    forced,
    message_usage,
    stop_of,
    thinking_block,
    tool_input,
)
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.event_stream import AsEvents
from prefixserve.protocols.openai.prepare import stream_state
from prefixserve.protocols.openai.tool_stream import ToolStreamState


def event(kind: str, payload: dict[str, Any]) -> str:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


@dataclass
class MessageEvents:
    """One streamed message's content blocks as they grow."""

    call: MessageCall
    started: bool = False
    blocks: int = 0  # content blocks opened so far
    open_kind: str | None = None  # "text" or "tool_use": the block still open
    arguments: str = ""  # the open tool_use block's arguments so far (sent whole when it closes)
    reason: str | None = None  # the chat's finish reason
    called: bool = False  # a tool_use block was opened (a call)

    def opening(self) -> list[str]:
        return []  # message_start goes with the first output (``before``), which has the usage

    def before(self, out: RequestOutput) -> list[str]:
        """``message_start`` with the first output: the prompt's usage is known from it."""
        if self.started:
            return []
        self.started = True
        usage = message_usage([out])
        return [event("message_start", {"message": self.call.skeleton(usage)})]

    def choice(self, choice: dict[str, Any]) -> str:
        """The events for one chat choice (its text, tool-call pieces and finish)."""
        out: list[str] = []
        delta = choice.get("delta") or {}
        tools = self.call.prep.tools
        if choice.get("finish_reason") == "length" and forced(tools) and delta.get("content"):
            assert tools is not None  # a forced call cut short: held until now, sent as the answer's
            block = cut_call(delta["content"], tools)
            delta = {"tool_calls": [{"id": block["id"], "function": {"name": block["name"]}}]}
        if delta.get("reasoning_content"):  # a thinking model's reasoning (reasoning.py): a thinking block
            if self.open_kind != "thinking":
                out += self._close() + self._open(thinking_block(""), "thinking")
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            out.append(event("content_block_delta", {"index": self.blocks - 1, "delta": thinking}))
        if delta.get("content"):
            if self.open_kind != "text":
                out += self._close() + self._open({"type": "text", "text": ""}, "text")
            text_delta = {"type": "text_delta", "text": delta["content"]}
            out.append(event("content_block_delta", {"index": self.blocks - 1, "delta": text_delta}))
        for piece in delta.get("tool_calls") or ():
            fn = piece.get("function") or {}
            if "id" in piece:
                self.called = True
                block = {"type": "tool_use", "id": piece["id"], "name": fn["name"], "input": {}}
                out += self._close() + self._open(block, "tool_use")
            elif self.open_kind == "tool_use":
                self.arguments += fn.get("arguments") or ""
        if choice.get("finish_reason") is not None:
            self.reason = choice["finish_reason"]
            out += self._close()
        return "".join(out)

    def _open(self, block: dict[str, Any], kind: str) -> list[str]:
        self.open_kind, self.arguments = kind, ""
        self.blocks += 1
        return [event("content_block_start", {"index": self.blocks - 1, "content_block": block})]

    def _close(self) -> list[str]:
        """The open block's stop; a tool_use block's input goes first, as one JSON object (the chat
        stream sends a call only once it is whole, so nothing waits for it)."""
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "tool_use":
            partial = json.dumps(tool_input(self.arguments), ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": partial}
            out.append(event("content_block_delta", {"index": self.blocks - 1, "delta": delta}))
        self.open_kind = None
        return [*out, event("content_block_stop", {"index": self.blocks - 1})]

    def closing(self, finals: list[RequestOutput]) -> list[str]:
        reason, sequence = stop_of(self.reason, finals[0], self.called)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [
            *self._close(),
            event("message_delta", {"delta": delta, "usage": message_usage(finals)}),
            event("message_stop", {}),
        ]

    def failed(self, error: dict[str, Any]) -> str:
        """An error event in Anthropic's shape (``error`` is an ``APIError.body()``)."""
        err = error.get("error", {})
        return event("error", {"error": error_of(err.get("type"), str(err.get("message")))})


@dataclass
class MessageStream(AsEvents, fmt.StreamState):
    events: Any = field(default=None)


@dataclass
class MessageToolStream(AsEvents, ToolStreamState):
    events: Any = field(default=None)


def message_stream(call: MessageCall) -> fmt.StreamState:
    """The stream state for a message: the chat's, sending events."""
    state = stream_state(call.ctx, call.prep, MessageStream, MessageToolStream)
    state.events = MessageEvents(call)  # type: ignore[attr-defined]
    return state


__all__ = ["MessageEvents", "message_stream"]
