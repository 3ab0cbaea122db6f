"""Anthropic's Messages API (``/v1/messages``) over the chat route: prepare, answer, count, errors.

A message runs as one chat turn (``request.py`` turns its body into a chat body), so the
template, tools, structured outputs, sampling and every check are the chat route's. Its answer is
the Messages shape: content blocks (``text``, and ``tool_use`` per tool call with its ``input`` as
an object), ``stop_reason`` (``end_turn``, ``stop_sequence`` naming the sequence, ``max_tokens``,
``tool_use``) and usage where ``input_tokens`` are the prompt tokens the prefix cache did not hold
and ``cache_read_input_tokens`` those it did (so that their sum is the prompt, as Anthropic counts).
Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from prefixserve.outputs import RequestOutput
from prefixserve.protocols.anthropic.cache_control import prefix_texts
from prefixserve.protocols.anthropic.request import (
    MessagesRequest,
    chat_request,
    check_refused,
    check_supported,
    renamed,
)
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.prepare import (
    OpenAIContext,
    Prepared,
    prepare_chat,
    prompt_ids,
    response_body,
)
from prefixserve.protocols.openai.reasoning import END
from prefixserve.protocols.openai.request_models import check_not_done, parse_request
from prefixserve.protocols.openai.tools import Tools

MESSAGES_ROUTE = "/v1/messages"
CALL_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')  # a constrained call's name, in its JSON
COUNT_ROUTE = MESSAGES_ROUTE + "/count_tokens"
# Anthropic's error types by HTTP status (``error.type``; the SDK raises by status)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
SHARED_TYPES = ("invalid_request_error", "authentication_error", "permission_error", "rate_limit_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error answer's body, for its HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_of(openai_type: str | None, message: str) -> dict[str, str]:
    """A stream's ``error`` event's error, from the server's (OpenAI-typed) error: the types both
    APIs name alike are kept; a failure of the server is Anthropic's ``api_error``."""
    kind = openai_type if openai_type in SHARED_TYPES else "api_error"
    return {"type": kind, "message": message}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as ``tool_use.input`` (an object): arguments that are not a JSON object
    (a model's own writing under ``auto``) are kept whole under ``"arguments"``."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": tool_input(fn["arguments"])}


def cut_call(text: str, tools: Tools) -> dict[str, Any]:
    """A forced call (``tool_choice`` any or a tool) that ``max_tokens`` cut: a ``tool_use`` block
    with the name it was writing and an empty input, as Anthropic answers an incomplete tool use,
    never the constrained output's own text."""
    named = tools.named
    if named is None:
        found = CALL_NAME.search(text)
        named = found.group(1) if found and found.group(1) in tools.functions else next(iter(tools.functions))
    return {"type": "tool_use", "id": f"call_{uuid.uuid4().hex[:24]}", "name": named, "input": {}}


def thinking_block(text: str) -> dict[str, Any]:
    """A thinking model's reasoning as Claude answers its own (no signature: nothing to verify)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def forced(tools: Tools | None) -> bool:
    return tools is not None and tools.choice in ("named", "required")


def stop_of(chat_reason: str | None, final: RequestOutput, called: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) from the chat's finish reason, whether the answer holds a
    whole call (``called``: a named function's ends as the output did, "stop", where Anthropic's
    ends "tool_use" as any call does) and the engine's output."""
    if chat_reason == "length":
        return "max_tokens", None
    if called or chat_reason == "tool_calls":
        return "tool_use", None
    stopped_by = final.outputs[0].stop_reason
    if isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return "end_turn", None


def message_usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """Anthropic's usage: the prompt split into tokens read from the cache, tokens written to it up to
    the honoured breakpoints (``engine/cache_pins.py``), and the rest."""
    prompt = sum(f.num_prompt_tokens for f in finals)
    cached = sum(f.num_cached_tokens for f in finals)
    written = sum(f.cache_written_tokens for f in finals)
    return {
        "input_tokens": prompt - cached - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "output_tokens": sum(len(c.token_ids) for f in finals for c in f.outputs),
    }


@dataclass
class MessageCall:
    """A checked /v1/messages request: the chat work to queue, and how to answer it."""

    ctx: OpenAIContext
    req: MessagesRequest
    prep: Prepared

    @property
    def rid(self) -> str:
        return self.prep.rid

    def skeleton(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The message without content or stop reason (``message_start`` sends this)."""
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }

    def body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed answer."""
        choice = response_body(self.ctx, self.prep, finals)["choices"][0]
        message, reason = choice["message"], choice["finish_reason"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):  # a thinking model's, read apart (reasoning.py); as streamed
            content.append(thinking_block(message["reasoning_content"]))
        tools = self.prep.tools
        # cut inside the thought: no call was begun, as the stream sends it (only the thinking block)
        in_thought = bool(message.get("reasoning_content")) and END not in finals[0].outputs[0].text
        if reason == "length" and forced(tools) and not message.get("tool_calls") and not in_thought:
            assert tools is not None
            content.append(cut_call(message.get("content") or "", tools))
        elif message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        content += [tool_use_block(call) for call in message.get("tool_calls") or ()]
        body = self.skeleton(message_usage(finals))
        body["content"] = content
        called = bool(message.get("tool_calls"))
        body["stop_reason"], body["stop_sequence"] = stop_of(reason, finals[0], called)
        return body


def _parsed(ctx: OpenAIContext, data: Any, required: tuple[str, ...]) -> tuple[MessagesRequest, Prepared]:
    check_refused(data)
    check_not_done(data)
    for name in required[1:]:
        if isinstance(data, dict) and data.get(name) is None:
            raise APIError(400, f"'{name}' is a required field", param=name, code="missing_required_field")
    req: MessagesRequest = parse_request(MessagesRequest, data, required[0])
    check_supported(req)
    body = chat_request(req, data, ctx.reasoning_parser is not None)  # its errors name this API's fields
    try:
        prep = prepare_chat(ctx, body)
    except APIError as exc:
        raise renamed(exc) from None
    prep.rid = f"msg_{uuid.uuid4().hex}"
    return req, prep


def prepare_message(ctx: OpenAIContext, data: Any) -> MessageCall:
    """Check a /v1/messages body; a 400 names the field in this API's words. Its ``cache_control``
    breakpoints' prefixes are rendered as the whole is (``cache_control.py``)."""
    req, prep = _parsed(ctx, data, ("messages", "max_tokens"))
    prep.pin_texts = prefix_texts(data, lambda cut: _parsed(ctx, cut, ("messages",))[1].prompts[0])
    return MessageCall(ctx, req, prep)


def count_tokens(ctx: OpenAIContext, data: Any) -> dict[str, int]:
    """``/v1/messages/count_tokens``: the prompt's tokens as the engine would take them (a pinned
    application prompt counted), without running it."""
    _, prep = _parsed(ctx, data, ("messages",))
    ids = prompt_ids(ctx, prep, prep.prompts[0])
    if ids is None:
        raise APIError(400, "a Prompt Cache conversation is laid out by the engine: not counted here")
    return {"input_tokens": len(ctx.engine_ids(ids, prep.application))}


__all__ = [
    "COUNT_ROUTE",
    "MESSAGES_ROUTE",
    "MessageCall",
    "count_tokens",
    "error_body",
    "error_of",
    "prepare_message",
]
