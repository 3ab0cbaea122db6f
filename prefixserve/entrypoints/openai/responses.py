"""OpenAI's Responses API (``/v1/responses``) over the chat route: prepare, answer, store.

A response runs as one chat turn (``responses_request.py`` turns its body into a chat body), so the
template, tools, structured outputs, sampling and every check are the chat route's. Its answer is
the Responses shape: output items (an assistant ``message`` with ``output_text``, and a
``function_call`` per tool call), ``status`` ``incomplete`` where ``max_output_tokens`` cut it, and
usage as input / output tokens. Stored responses (``store``, on by default as in OpenAI's API) are
kept in this process, a bounded number, so that ``previous_response_id`` goes on with a
conversation: its turns come back in front of the new input, and the prefix cache holds them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixserve.entrypoints.openai import format as fmt
from prefixserve.entrypoints.openai.prepare import (
    OpenAIContext,
    Prepared,
    prepare_chat,
    prompt_ids,
    response_body,
)
from prefixserve.entrypoints.openai.protocol import APIError, check_not_done, object_id, parse_request
from prefixserve.entrypoints.openai.responses_request import (
    ResponsesRequest,
    chat_request,
    check_supported,
    input_messages,
    renamed,
)
from prefixserve.entrypoints.openai.text_tokens import TextTokens
from prefixserve.outputs import RequestOutput

MAX_STORED = 1024  # responses kept for previous_response_id (oldest dropped first)
MAX_STORED_CHARS = 64 << 20  # and at most this many characters of their conversations
FINISHED = ("completed", "incomplete")  # statuses of a stored response that a conversation goes on from
ACTIVE = ("queued", "in_progress")  # a background response's statuses while it may still change


def new_id(kind: str) -> str:
    return object_id(kind)


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as answered
    history: list[dict[str, Any]]  # its conversation as chat messages (earlier turns, input, output)
    input_items: list[dict[str, Any]]  # its own input, as items with ids (``input_items`` lists them)
    chars: int


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: the least
    recently used leave first once either bound is passed (``max_responses`` 0: nothing is kept)."""

    def __init__(
        self, max_responses: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS, tag: str | None = None
    ) -> None:
        """``tag``: written into every id this store gives (``resp_<tag>_<hex>``): behind the Ray
        Serve ingress, the replica's name, so that a later request naming the id goes to it."""
        if tag is not None and not re.fullmatch(r"[A-Za-z0-9-]+", tag):
            raise ValueError(f"a response store's tag takes letters, digits and '-', got {tag!r}")
        self.max_responses, self.max_chars, self.tag = max_responses, max_chars, tag
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # ``truncation: auto`` reads it from a worker thread

    def new_id(self) -> str:
        return object_id("resp", self.tag)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            found = self._items.get(rid)
            if found is not None:
                self._items.move_to_end(rid)
            return found

    def put(
        self, rid: str, body: dict[str, Any], history: list[dict[str, Any]], input_items: list[dict[str, Any]]
    ) -> None:
        chars = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in history)
        with self._lock:
            self._drop(rid)
            self._items[rid] = StoredResponse(body, history, input_items, chars)
            self._chars += chars
            while len(self._items) > self.max_responses or self._chars > self.max_chars:
                # the least recently used that has ended: a background one still running stays
                # pollable and cancellable, past the bounds if need be (the engine bounds those)
                ended = next(
                    (r for r, item in self._items.items() if item.body.get("status") not in ACTIVE), None
                )
                if ended is None:
                    break
                self._drop(ended)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        found = self._items.pop(rid, None)
        if found is not None:
            self._chars -= found.chars
        return found is not None


# ---- output items ------------------------------------------------------------------------------
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


# ---- one response ------------------------------------------------------------------------------
@dataclass
class ResponseCall:
    """A checked /v1/responses request: the chat work to queue, and how to answer and store it."""

    ctx: OpenAIContext
    req: ResponsesRequest
    prep: Prepared
    history: list[dict[str, Any]]  # the conversation before the output (no instructions)
    store: ResponseStore | None
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def rid(self) -> str:
        return self.prep.rid

    @property
    def stored(self) -> bool:
        return self.req.store and self.store is not None and self.store.enabled

    def skeleton(self, status: str) -> dict[str, Any]:
        """The response object without its output and usage (``response.created`` sends this)."""
        req, params = self.req, self.prep.params
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": req.background,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": self.ctx.model,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": self.stored,
            "temperature": params.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": params.top_p,
            "truncation": req.truncation,
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def finished(self, items: list[dict[str, Any]], finals: list[RequestOutput]) -> dict[str, Any]:
        """The whole response from its output items; stored where asked."""
        reasons = {c.finish_reason for f in finals for c in f.outputs}
        status = "cancelled" if "abort" in reasons else "incomplete" if "length" in reasons else "completed"
        body = self.skeleton(status)
        body["output"] = items
        body["usage"] = response_usage(finals, self.reasoning_tokens(finals))
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.stored and status != "cancelled":  # an aborted answer is no turn to go on from
            assert self.store is not None
            self.store.put(self.rid, body, self.history + input_messages(items), input_items(self.req.input))
        return body

    def body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed answer, from the chat answer's one choice."""
        chat = response_body(self.ctx, self.prep, finals)
        out = finals[0].outputs[0]
        ids, counter, lead = out.token_ids, self.text_tokens(), self.answer_at(out.text)
        skip = counter.within(ids, lead) if lead else 0
        items = output_items(
            chat["choices"][0], self.prep.want_logprobs, lambda chars: counter.within(ids, lead + chars), skip
        )
        return self.finished(items, finals)

    def reasoning_tokens(self, finals: list[RequestOutput]) -> int:
        """The output tokens that wrote the reasoning (before the answer's first character)."""
        out = finals[0].outputs[0] if finals and finals[0].outputs else None
        lead = 0 if out is None else self.answer_at(out.text)
        return self.text_tokens().within(out.token_ids, lead) if out is not None and lead else 0

    def answer_at(self, text: str) -> int:
        """Where the answer starts in the output's text (past a thinking model's reasoning)."""
        return 0 if self.prep.thinking is None else self.prep.thinking.answer_at(text)

    def text_tokens(self) -> TextTokens:
        return TextTokens(self.ctx.tokenizer, self.prep.params.skip_special_tokens)


def prepare_response(ctx: OpenAIContext, data: Any, store: ResponseStore | None) -> ResponseCall:
    """Check a /v1/responses body; a 400 (or a 404 for an unknown ``previous_response_id``) names
    the field in this API's words."""
    check_not_done(data)
    req: ResponsesRequest = parse_request(ResponsesRequest, data, "input")
    check_supported(req)
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id) if store is not None else None
        if found is None:
            message = f"previous response {req.previous_response_id!r} is not stored here"
            if store is None or not store.enabled:
                message += " (this server stores no responses)"
            raise APIError(400, message, param="previous_response_id", code="previous_response_not_found")
        if found.body.get("status") not in FINISHED:
            status = found.body.get("status")
            message = f"previous response {req.previous_response_id!r} is {status}: no turn to go on from"
            raise APIError(400, message, param="previous_response_id", code="previous_response_not_finished")
        earlier = found.history
    if req.background and (store is None or not store.enabled):
        raise APIError(
            400,
            "this server stores no responses: a background response could not be polled",
            param="background",
            code="invalid_value",
        )
    given = input_messages(req.input)
    try:
        prep = _fitted(ctx, req, data, earlier + given) if req.truncation == "auto" else None
        prep = prep or prepare_chat(ctx, chat_request(req, data, earlier + given))
    except APIError as exc:
        raise renamed(exc) from None
    prep.rid = store.new_id() if store is not None else new_id("resp")
    return ResponseCall(ctx, req, prep, earlier + given, store)


def _fitted(
    ctx: OpenAIContext, req: ResponsesRequest, data: dict[str, Any], turns: list[dict[str, Any]]
) -> Prepared:
    """``truncation: auto``: the fewest oldest turns after the leading system messages are dropped,
    a user turn at a time, for the prompt to leave room for the output; the last user turn always
    stays (then the usual 400 if it alone does not fit). A prompt shrinks as turns go, so the cut is
    found by bisection: a few renders of the conversation, not one per turn. Without the context
    length (a router) or a tokenizer nothing is dropped."""
    max_model_len = getattr(ctx, "max_model_len", None)
    lead = next((i for i, m in enumerate(turns) if m["role"] not in ("system", "developer")), len(turns))
    head, rest = turns[:lead], turns[lead:]
    starts = [0] + [i for i, m in enumerate(rest) if i > 0 and m["role"] == "user"]

    def attempt(k: int) -> tuple[Prepared, bool]:
        prep = prepare_chat(ctx, chat_request(req, data, head + rest[starts[k] :]))
        ids = prompt_ids(ctx, prep, prep.prompts[0]) if max_model_len is not None else None
        if ids is None:
            return prep, True
        room = max_model_len - len(ctx.engine_ids(ids, prep.application))
        return prep, room >= (prep.params.max_tokens or 1)

    prep, fits = attempt(0)
    if fits or len(starts) == 1:
        return prep
    low, high = 1, len(starts) - 1  # the answer is in [low, high]; high is the last resort
    best = None
    while low <= high:
        mid = (low + high) // 2
        tried, fits = attempt(mid)
        if fits:
            best, high = tried, mid - 1
        else:
            low = mid + 1
    return best if best is not None else attempt(len(starts) - 1)[0]


__all__ = ["ResponseCall", "ResponseStore", "prepare_response"]
