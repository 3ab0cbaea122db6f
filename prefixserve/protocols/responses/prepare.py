"""OpenAI's Responses API (``/v1/responses``) over the chat route: one body prepared, answered, stored.

A response runs as one chat turn (``request.py`` turns its body into a chat body), so the template,
tools, structured outputs, sampling and every check are the chat route's. Its answer is the Responses
shape (``items.py``): output items (an assistant ``message`` with ``output_text``, and a
``function_call`` per tool call), ``status`` ``incomplete`` where ``max_output_tokens`` cut it, and
usage as input / output tokens. A stored response (``store.py``) lets ``previous_response_id`` go on
with its conversation: its turns come back in front of the new input, and the prefix cache holds them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prefixserve.outputs import RequestOutput
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.prepare import (
    OpenAIContext,
    Prepared,
    prepare_chat,
    prompt_ids,
    response_body,
)
from prefixserve.protocols.openai.request_models import check_not_done, parse_request
from prefixserve.protocols.openai.text_tokens import TextTokens
from prefixserve.protocols.responses.items import input_items, new_id, output_items, response_usage
from prefixserve.protocols.responses.request import (
    ResponsesRequest,
    chat_request,
    check_supported,
    input_messages,
    renamed,
)
from prefixserve.protocols.responses.store import FINISHED, ResponseStore

RESPONSES_ROUTE = "/v1/responses"


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


__all__ = ["RESPONSES_ROUTE", "ResponseCall", "prepare_response"]
