"""Streaming a response: the Responses API's events, from the chat stream's choices.

The chat stream states decide what text is settled (``format.StreamState``: no half character, no
possible start of a stop string) and when a tool call is whole (``tool_stream.ToolStreamState``);
each chat choice they would send becomes the events OpenAI sends for a response instead:
``response.created`` and ``response.in_progress`` first; per output item ``output_item.added``,
its deltas (``output_text.delta`` with the tokens' logprobs where asked, or
``function_call_arguments.delta``) and its ``done`` events; ``response.completed`` (or
``response.incomplete``) with the whole response last, which is what a non-streamed request answers
and what is stored. Every event carries its ``sequence_number``; there is no ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prefixserve.entrypoints.openai import format as fmt
from prefixserve.entrypoints.openai.prepare import stream_state
from prefixserve.entrypoints.openai.responses import (
    ResponseCall,
    call_item,
    item_status,
    message_item,
    new_id,
)
from prefixserve.entrypoints.openai.tool_stream import ToolStreamState
from prefixserve.outputs import RequestOutput


@dataclass
class ResponseEvents:
    """One streamed response's output items as they grow, and its events' sequence."""

    call: ResponseCall
    want_logprobs: bool
    sequence: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)
    message: int | None = None  # output index of the message item still open
    calls: dict[int, int] = field(default_factory=dict)  # open calls: the chat's call index -> output index

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        body = self.call.skeleton("in_progress")
        return [
            self.event("response.created", response=body) + self.event("response.in_progress", response=body)
        ]

    def choice(self, choice: dict[str, Any]) -> str:
        """The events for one chat choice (its text, tool-call pieces and finish)."""
        out: list[str] = []
        delta = choice.get("delta") or {}
        calls = delta.get("tool_calls") or ()
        lp = (choice.get("logprobs") or {}).get("content") if self.want_logprobs and not calls else None
        if delta.get("content") or lp:
            out += self._text(delta.get("content") or "", lp or [])
        for piece in calls:
            out += self._call_piece(piece)
        if choice.get("finish_reason") is not None:
            out += self._close(item_status(choice["finish_reason"]))
        return "".join(out)

    def _open_message(self) -> list[str]:
        index = self.message = len(self.items)
        item = message_item(new_id("msg"), "", "in_progress", [] if self.want_logprobs else None)
        self.items.append(item)
        part = item["content"][0]
        return [
            self.event("response.output_item.added", output_index=index, item={**item, "content": []}),
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _text(self, text: str, logprobs: list[Any]) -> list[str]:
        out = self._open_message() if self.message is None else []
        index = self.message
        assert index is not None
        item = self.items[index]
        part = item["content"][0]
        part["text"] += text
        if self.want_logprobs:
            part["logprobs"] += logprobs
        fields: dict[str, Any] = {
            "item_id": item["id"],
            "output_index": index,
            "content_index": 0,
            "delta": text,
        }
        out.append(self.event("response.output_text.delta", **fields, logprobs=logprobs))
        return out

    def _close_message(self, status: str) -> list[str]:
        index, self.message = self.message, None
        if index is None:
            return []
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self.event(
                "response.output_text.done", **where, text=part["text"], logprobs=part.get("logprobs", [])
            ),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _call_piece(self, piece: dict[str, Any]) -> list[str]:
        """A call's first piece (its id and name) opens its item; later pieces carry its arguments."""
        out: list[str] = []
        fn = piece.get("function") or {}
        if "id" in piece:
            out += self._close_message("completed")  # the text before the calls is whole
            index = self.calls[piece["index"]] = len(self.items)
            item = call_item(new_id("fc"), piece["id"], fn["name"], "", "in_progress")
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        if fn.get("arguments"):
            index = self.calls[piece["index"]]
            item = self.items[index]
            item["arguments"] += fn["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=fn["arguments"],
                )
            )
        return out

    def _close(self, status: str) -> list[str]:
        """Every open item done; an answer without any (no token of text) is one empty message, as
        the non-streamed answer has it."""
        out = self._open_message() if not self.items else []
        out += self._close_message(status)
        for index in self.calls.values():
            item = self.items[index]
            item["status"] = "completed"
            where = {"item_id": item["id"], "output_index": index}
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.calls = {}
        return out

    def closing(self, finals: list[RequestOutput]) -> list[str]:
        body = self.call.finished(self.items, finals)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [self.event(kind, response=body)]

    def failed(self, error: dict[str, Any]) -> str:
        """An ``error`` event and ``response.failed`` (the stream ends there)."""
        err = error.get("error", {})
        code = err.get("code") or err.get("type")
        body = self.call.skeleton("failed")
        body["error"] = {"code": code, "message": err.get("message")}
        return self.event(
            "error", code=code, message=err.get("message"), param=err.get("param")
        ) + self.event("response.failed", response=body)


class _AsEvents:
    """Sends a chat stream state's choices as a response's events (mixed in before the state)."""

    events: ResponseEvents

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        return "".join(self.events.choice(c) for c in choices)

    def _plain_chunk(self, index: int, delta: str, finish: str | None) -> str:
        return self.events.choice({"delta": {"content": delta} if delta else {}, "finish_reason": finish})

    def opening(self) -> list[str]:
        return self.events.opening()

    def closing(self, finals: list[RequestOutput]) -> list[str]:
        return self.events.closing(finals)

    def error_event(self, error: dict[str, Any]) -> str:
        return self.events.failed(error)


@dataclass
class ResponseStream(_AsEvents, fmt.StreamState):
    events: Any = None


@dataclass
class ResponseToolStream(_AsEvents, ToolStreamState):
    events: Any = None


def response_stream(call: ResponseCall) -> fmt.StreamState:
    """The stream state for a response: the chat's, sending events."""
    state = stream_state(call.ctx, call.prep, ResponseStream, ResponseToolStream)
    state.events = ResponseEvents(call, call.prep.want_logprobs)  # type: ignore[attr-defined]
    return state


__all__ = ["ResponseEvents", "response_stream"]
