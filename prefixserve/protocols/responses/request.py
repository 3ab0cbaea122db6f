"""A /v1/responses body (OpenAI's Responses API) -> the chat request the server already answers.

A response is one chat turn: ``instructions``, the conversation of ``previous_response_id`` and
``input`` (a string, or items: messages, earlier function calls and their outputs) become the chat's
messages; ``text.format`` becomes ``response_format``; the flat function tools become chat tools;
``max_output_tokens`` becomes ``max_completion_tokens``. The chat route then checks everything, and
its errors are renamed to this API's fields (``renamed``). What this API has and the model cannot do
(hosted tools, images, files) is a 400 naming the field; ``reasoning.effort`` goes to the template.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefixserve.protocols.errors import APIError

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value a text model has
# vLLM's sampling extensions a response takes as a chat does (passed on under the same names)
CHAT_EXTENSIONS = (
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "include_stop_str_in_output",
    "cache_salt", "cache_salt_scope", "application", "module_recompute", "allowed_token_ids", "bad_words",
    "prompt_cache_key",
    "skip_special_tokens", "chat_template_kwargs", "priority", "user", "truncate_prompt_tokens",
    "return_tokens_as_token_ids", "structured_outputs", "thinking_token_budget",
)  # fmt: skip
# the chat route's names for fields this API calls otherwise (error messages and params)
RENAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("messages", "input"),
)
CHAT_TOOL_FIELD = re.compile(r"(tools\[\d+\])\.function\b")  # a chat tool's fields sit in "function"
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The Responses API's own fields (strict types, as the chat models); others pass on unchecked."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default=None)  # type: ignore[assignment]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    service_tier: str | None = None
    max_tool_calls: int | None = None  # bounds hosted tools' calls: this server has none
    prompt: dict[str, Any] | None = None  # a stored prompt template: refused
    conversation: str | dict[str, Any] | None = None  # the Conversations API: refused

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def check_supported(req: ResponsesRequest) -> None:
    """A 400 for each field set to what a text model served here cannot do."""
    if req.background and not req.store:
        raise _bad("a background response must be stored (store: true) to be polled", "background")
    if req.prompt is not None:
        raise _bad("stored prompt templates are not supported: send the input", "prompt")
    if req.conversation is not None:
        raise _bad("conversations are not supported: use previous_response_id", "conversation")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _bad("reasoning.effort must be a string", "reasoning.effort")
    for i, name in enumerate(req.include or ()):
        if name != LOGPROBS_INCLUDE:
            raise _bad(f"include may only hold {LOGPROBS_INCLUDE!r}, got {name!r}", f"include[{i}]")
    if req.metadata is not None:
        if len(req.metadata) > 16:
            raise _bad("metadata may hold at most 16 keys", "metadata")
        for key, value in req.metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise _bad("metadata keys may have at most 64 characters, values 512", f"metadata.{key[:64]}")


# ---- input -> chat messages --------------------------------------------------------------------
def _text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content parts", param)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = f"of type {kind!r}" if kind is not None else "without a type"
            message = f"a content part {shown} is not supported: this model takes text parts only"
            raise _bad(message, f"{param}[{k}]")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(item: dict[str, Any], param: str) -> str:
    args = item.get("arguments", "{}")
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise _bad("a function call's arguments must be a JSON string", f"{param}.arguments")
    return args


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: messages keep their roles; a function call joins the assistant
    message before it (or opens one) as a tool call; a function call's output is a tool message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad("a message's role must be user, assistant, system or developer", f"{param}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise _bad("a function_call item needs a string call_id and name", param)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _arguments(item, param)},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad("a function_call_output item needs a string call_id", f"{param}.call_id")
            text = output if isinstance(output, str) else _text(output, f"{param}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":  # an earlier turn's reasoning, sent back: the templates drop it
            continue
        else:
            raise _bad(f"input items of type {kind!r} are not supported", f"{param}.type")
    return out


# ---- tools and formats -------------------------------------------------------------------------
def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The flat function tools (``{"type": "function", "name", "parameters"}``) as chat tools."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"only function tools are supported, got type {kind!r}", f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if choice in ("none", "auto", "required"):
        return choice
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(choice.get("name"), str)
    ):
        message = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}"
        raise _bad(message, "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as the chat's ``response_format`` (None for plain text)."""
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _bad(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "text.format.type",
        )
    for required in ("name", "schema"):
        if required not in fmt:
            raise _bad(f"text.format of type json_schema needs a '{required}'", f"text.format.{required}")
    if not isinstance(fmt["name"], str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fmt["name"]):
        raise _bad("text.format.name must be 1-64 letters, digits, _ or -", "text.format.name")
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def chat_request(req: ResponsesRequest, data: dict[str, Any], turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body for this response: ``turns`` (earlier responses' turns, then the input as
    ``input_messages`` reads it) behind the instructions."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": head + turns,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    body.update({k: data[k] for k in CHAT_EXTENSIONS if data.get(k) is not None})
    if (req.reasoning or {}).get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]  # given to the template, as a chat's is
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.text is not None:
        body["response_format"] = response_format(req.text)
    return {k: v for k, v in body.items() if v is not None}


def renamed(exc: APIError) -> APIError:
    """The chat route's error with this API's names for the fields (a message's index in the chat
    counts the instructions and earlier turns, so ``messages[k]`` becomes ``input`` alone)."""
    message, param = CHAT_TOOL_FIELD.sub(r"\1", exc.message), exc.param
    for chat_name, name in RENAMES:
        message = message.replace(chat_name, name)
    if param is not None:
        param = CHAT_TOOL_FIELD.sub(r"\1", param)
        for chat_name, name in RENAMES:
            if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
                param = name if chat_name == "messages" else name + param[len(chat_name) :]
                break
    exc.message, exc.param, exc.args = message, param, (message,)
    return exc


__all__ = ["ResponsesRequest", "chat_request", "check_supported", "input_messages", "renamed"]
