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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.outputs import RequestOutput
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.event_stream import AsEvents
from prefixserve.protocols.openai.prepare import stream_state
from prefixserve.protocols.openai.text_tokens import TextTokens
from prefixserve.protocols.openai.tool_stream import ToolStreamState
from prefixserve.protocols.responses.items import (
    FAILURE_CODES,
    call_item,
    item_status,
    message_item,
    new_id,
    reasoning_item,
)
from prefixserve.protocols.responses.prepare import ResponseCall


@dataclass
class ResponseEvents:
    """One streamed response's output items as they grow, and its events' sequence.

    Logprobs ride on the text deltas that hold their tokens' text: the chat stream sends every
    token's as it comes, text held back (a possible tool call) included, so they wait here until
    the text they belong to is sent; a reply that turns out to be calls drops the calls' own, as
    the non-streamed answer does (``text_tokens.TextTokens``)."""

    call: ResponseCall
    want_logprobs: bool
    sequence: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)
    message: int | None = None  # output index of the message item still open
    reasoning: int | None = None  # output index of the reasoning item still open
    call_at: int | None = None  # output index of the function call still open
    pending: list[Any] = field(default_factory=list)  # logprobs not yet sent with their text
    sent: int = 0  # tokens whose logprobs were sent or dropped
    token_ids: Sequence[int] = ()  # the reply's tokens so far (the latest output's)
    counter: TextTokens | None = None
    lead: int = 0  # characters of the output before the answer (a thinking model's reasoning)
    skipped: bool = False  # the reasoning's logprobs are dropped (they are no text's)
    queued: bool = False  # a background response's: created and queued went out when it was queued

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def before(self, out: RequestOutput) -> list[str]:
        self.token_ids = out.outputs[0].token_ids  # one reply (a response has no n)
        text = out.outputs[0].text
        if self.call.prep.thinking is not None and "</think>" in text:  # the raw output's, once it is known
            self.lead = max(self.lead, self.call.answer_at(text))  # (not an answer-only copy's: 0)
        return []

    def opening(self) -> list[str]:
        body = self.call.skeleton("in_progress")
        if self.queued:
            return [self.event("response.in_progress", response=body)]
        return [
            self.event("response.created", response=body) + self.event("response.in_progress", response=body)
        ]

    def queued_events(self) -> str:
        """A background response's first events, sent when it is queued (``opening`` then sends
        ``in_progress`` alone, with its first output)."""
        self.queued = True
        body = self.call.skeleton("queued")
        return self.event("response.created", response=body) + self.event("response.queued", response=body)

    def choice(self, choice: dict[str, Any]) -> str:
        """The events for one chat choice (its text, tool-call pieces and finish)."""
        out: list[str] = []
        delta = choice.get("delta") or {}
        if self.want_logprobs:
            self.pending += (choice.get("logprobs") or {}).get("content") or ()
        if delta.get("reasoning_content"):
            out += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            out += self._close_reasoning() + self._text(delta["content"])
        for piece in delta.get("tool_calls") or ():
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

    def _text(self, text: str, rest: bool = False) -> list[str]:
        """A text delta, with the logprobs whose tokens' text it completes (``rest``: all left)."""
        out = self._open_message() if self.message is None else []
        index = self.message
        assert index is not None
        item = self.items[index]
        part = item["content"][0]
        part["text"] += text
        logprobs: list[Any] = []
        if self.want_logprobs:
            if self.counter is None:
                self.counter = self.call.text_tokens()
            if self.lead and not self.skipped:  # the reasoning's tokens: no text's logprobs
                self.skipped = True
                drop = max(
                    0, min(len(self.pending), self.counter.within(self.token_ids, self.lead) - self.sent)
                )
                self.pending, self.sent = self.pending[drop:], self.sent + drop
            within = self.counter.within(self.token_ids, self.lead + len(part["text"]))
            take = len(self.pending) if rest else max(0, min(len(self.pending), within - self.sent))
            logprobs, self.pending = self.pending[:take], self.pending[take:]
            self.sent += take
            part["logprobs"] += logprobs
        fields: dict[str, Any] = {
            "item_id": item["id"],
            "output_index": index,
            "content_index": 0,
            "delta": text,
        }
        out.append(self.event("response.output_text.delta", **fields, logprobs=logprobs))
        return out

    def _reasoning(self, text: str) -> list[str]:
        """A thinking model's reasoning (``reasoning.py``): its item opened first, then the delta."""
        out = []
        if self.reasoning is None:
            index = self.reasoning = len(self.items)
            item = reasoning_item(new_id("rs"), "", "in_progress")
            self.items.append(item)
            out.append(
                self.event("response.output_item.added", output_index=index, item={**item, "content": []})
            )
        item = self.items[self.reasoning]
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": self.reasoning, "content_index": 0}
        return [*out, self.event("response.reasoning_text.delta", **where, delta=text)]

    def _close_reasoning(self) -> list[str]:
        index, self.reasoning = self.reasoning, None
        if index is None:
            return []
        item = self.items[index]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.reasoning_text.done", **where, text=item["content"][0]["text"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

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
        """A call's first piece (its id and name) ends what was open and opens its item; later
        pieces carry its arguments."""
        out: list[str] = []
        fn = piece.get("function") or {}
        if "id" in piece:
            self.sent += len(self.pending)
            self.pending = []  # the calls' tokens: no text holds them
            out += self._close_reasoning() + self._close_message("completed") + self._close_call()
            index = self.call_at = len(self.items)
            item = call_item(new_id("fc"), piece["id"], fn["name"], "", "in_progress")
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        if fn.get("arguments") and self.call_at is not None:
            item = self.items[self.call_at]
            item["arguments"] += fn["arguments"]
            where = {"item_id": item["id"], "output_index": self.call_at}
            out.append(self.event("response.function_call_arguments.delta", **where, delta=fn["arguments"]))
        return out

    def _close_call(self) -> list[str]:
        index, self.call_at = self.call_at, None
        if index is None:
            return []
        item = self.items[index]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        return [
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _close(self, status: str) -> list[str]:
        """Every open item done; the logprobs still waiting go with the text (a last empty delta);
        an answer without any item (no token of text) is one empty message, as the non-streamed
        answer has it."""
        out = self._close_reasoning()
        if not any(item["type"] != "reasoning" for item in self.items):
            out += self._open_message()
        if self.pending and self.message is not None:
            out += self._text("", rest=True)
        return out + self._close_message(status) + self._close_call()

    def closing(self, finals: list[RequestOutput]) -> list[str]:
        body = self.call.finished(self.items, finals)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [self.event(kind, response=body)]

    def failed(self, error: dict[str, Any]) -> str:
        """An ``error`` event (the server's own code) and ``response.failed``, whose error code is one
        of the API's (the stream ends there)."""
        err = error.get("error", {})
        code = err.get("code") or err.get("type")
        body = self.call.skeleton("failed")
        body["error"] = {
            "code": FAILURE_CODES.get(err.get("type"), "server_error"),
            "message": err.get("message"),
        }
        return self.event(
            "error", code=code, message=err.get("message"), param=err.get("param")
        ) + self.event("response.failed", response=body)


@dataclass
class ResponseStream(AsEvents, fmt.StreamState):
    events: Any = None


@dataclass
class ResponseToolStream(AsEvents, ToolStreamState):
    events: Any = None


def response_stream(call: ResponseCall) -> fmt.StreamState:
    """The stream state for a response: the chat's, sending events."""
    state = stream_state(call.ctx, call.prep, ResponseStream, ResponseToolStream)
    state.events = ResponseEvents(call, call.prep.want_logprobs)  # type: ignore[attr-defined]
    return state


__all__ = ["ResponseEvents", "response_stream"]
