"""The Responses API's items and usage: a chat choice as output items (reasoning, message, function
calls), a request's ``input`` as the items ``input_items`` lists, and usage as input / output tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prefixserve.outputs import RequestOutput
from prefixserve.protocols.ids import object_id
from prefixserve.protocols.openai import format as fmt


def new_id(kind: str) -> str:
    return object_id(kind)


def message_item(item_id: str, text: str, status: str, logprobs: list[Any] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A thinking model's reasoning (read apart: ``reasoning.py``) as the API's reasoning item."""
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def item_status(finish_reason: str | None) -> str:
    return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"


def output_items(
    choice: dict[str, Any], want_logprobs: bool, text_tokens: Callable[[int], int], skip: int = 0
) -> list[dict[str, Any]]:
    """A chat choice as output items: its reasoning (``reasoning.py``), its text (where it has any,
    or no calls) and its calls. ``text_tokens(chars)``: how many output tokens wrote the output up
    to the text's first ``chars`` characters; ``skip``: the tokens before the text (the reasoning's)."""
    message, status = choice["message"], item_status(choice["finish_reason"])
    calls = message.get("tool_calls") or []
    items = []
    if message.get("reasoning_content"):  # as the stream has it: an item where there is reasoning
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    text = message.get("content") or ""
    if text or not calls:
        lp = (choice.get("logprobs") or {}).get("content", []) if want_logprobs else None
        if lp and (calls or skip):  # the tokens that wrote the reasoning or the calls are not the text's
            lp = lp[skip : text_tokens(len(text))]
        items.append(message_item(new_id("msg"), text, status, lp))
    for call in calls:
        fn = call["function"]
        items.append(call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
    return items


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as the items ``GET /v1/responses/{id}/input_items`` lists (ids added)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    kinds = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
    out = []
    for item in given:
        kind = item.get("type", "message")
        entry = {"type": kind, "status": "completed", **item}
        if kind == "message":
            entry["content"] = _listed_parts(entry.get("role"), entry.get("content"))
        if kind == "function_call" and not isinstance(entry.get("arguments"), str):
            entry["arguments"] = json.dumps(entry.get("arguments", {}), ensure_ascii=False)
        entry.setdefault("id", new_id(kinds.get(kind, "item")))
        out.append(entry)
    return out


def _listed_parts(role: Any, content: Any) -> list[dict[str, Any]]:
    """A message's content as the item list shows it: an assistant's as ``output_text`` parts,
    anyone else's as ``input_text`` (``input_messages`` has checked that they are text)."""
    parts = [{"text": content}] if isinstance(content, str) else content
    out = []
    for part in parts:
        text = part.get("text", part.get("refusal", ""))
        if role == "assistant":
            out.append({"type": "output_text", "text": text, "annotations": []})
        else:
            out.append({"type": "input_text", "text": text})
    return out


# a failure's error code as the Responses API names it, by the server's error type
FAILURE_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}


def response_usage(finals: list[RequestOutput], reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``reasoning_tokens``: those that wrote the reasoning item."""
    u = fmt.usage(finals)
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"],
        # the prompt tokens computed now: their blocks enter the prefix cache as they fill
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": u["prompt_tokens"] - cached},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u["total_tokens"],
    }
