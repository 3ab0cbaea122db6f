"""A /v1/messages body (Anthropic's Messages API) -> the chat request the server already answers.

Claude's clients (the ``anthropic`` SDK, and tools built on it) speak this API; a message is one
chat turn. ``system`` becomes the system message; each message's content blocks become chat
messages: text joins, an assistant's ``tool_use`` blocks become its tool calls, a user's
``tool_result`` blocks become tool messages; a conversation that ends with the assistant's message
is a prefill that the model goes on with (``continue_final_message``). ``tools`` (custom tools with
an ``input_schema``) and ``tool_choice`` become chat tools; ``stop_sequences`` become ``stop``;
``output_config.format`` becomes ``response_format``. ``cache_control`` breakpoints hold their
prefixes' blocks for their TTLs (``cache_control.py``, ``engine/cache_pins.py``). The chat route
then checks everything, and its errors are renamed to this API's fields (``renamed``). What the
model cannot do (images, documents, server tools, MCP servers) is a 400 naming the field;
``thinking`` (which Claude's clients send unasked) is accepted and given to the template as
``enable_thinking``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefixserve.protocols.errors import APIError
from prefixserve.protocols.responses.request import CHAT_EXTENSIONS

# fields of this API for what a text model served here does not do: a 400 where set
REFUSED = {
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported: send the tools as custom tools",
    "context_management": "context management is not supported",
}
THINKING_TYPES = ("disabled", "enabled", "adaptive")
# a system block Claude Code sends with a value new every request: left out, or no prompt would ever
# share its first block with the last one (the prefix cache and the replicas' routing both miss)
BILLING_HEADER = "x-anthropic-billing-header:"
# the chat route's names for fields this API calls otherwise (error messages and params)
RENAMES = (
    ("max_completion_tokens", "max_tokens"),
    ("response_format.json_schema", "output_config.format"),
    ("response_format", "output_config.format"),
    ("function.parameters", "input_schema"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("reasoning_effort", "output_config.effort"),
    ("tool_choice 'required'", "tool_choice any"),
)
PARAM_RENAMES = {"stop": "stop_sequences"}
CHAT_TOOL_FIELD = re.compile(r"(tools\[\d+\])\.function\.name\b")  # a chat tool's name sits in "function"
MESSAGE_INDEX = re.compile(r"messages\[\d+\]")  # the chat's indices count the system and tool messages


class MessagesRequest(BaseModel):
    """The Messages API's own fields (strict types, as the chat models); others pass on unchecked."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None  # required to create a message; count_tokens takes none
    messages: list[dict[str, Any]] = Field(default=None)  # type: ignore[assignment]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None  # accepted: one tier here
    cache_control: dict[str, Any] | None = None  # a breakpoint after the last block (cache_control.py)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def check_refused(data: Any) -> None:
    """A 400 for each of this API's fields set to what a text model served here cannot do (before
    the chat route's own list, whose hints name the OpenAI fields)."""
    for name, reason in REFUSED.items():
        if isinstance(data, dict) and data.get(name) not in (None, [], {}):
            raise _bad(f"{name} is not supported: {reason}", name)


def check_supported(req: MessagesRequest) -> None:
    """A 400 for a field whose value this API does not define, or this server cannot honour."""
    kind = (req.thinking or {}).get("type") or "disabled"
    if kind not in THINKING_TYPES:  # accepted and left to the template: clients send it on their own
        raise _bad(f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}", "thinking.type")
    budget = (req.thinking or {}).get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise _bad(
            f"thinking.budget_tokens must be an integer >= 1, got {budget!r}", "thinking.budget_tokens"
        )
    if not isinstance((req.tool_choice or {}).get("disable_parallel_tool_use", False), bool):
        raise _bad(
            "tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use"
        )
    if req.max_tokens is not None and req.max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
    user = (req.metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise _bad("metadata.user_id must be a string", "metadata.user_id")


# ---- content blocks -> chat messages -----------------------------------------------------------
def _text_blocks(content: Any, param: str) -> str:
    """Text content: a string, or ``text`` blocks (a tool result's content, the system prompt)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content blocks", param)
    texts = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _unsupported(kind, f"{param}[{k}]")
        texts.append(block["text"])
    return "".join(texts)


def _unsupported(kind: Any, param: str) -> APIError:
    shown = f"of type {kind!r}" if kind is not None else "without a type"
    return _bad(f"a content block {shown} is not supported here: this model takes text", param)


def _user_turns(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """A user message's blocks: each tool result a tool message (they come first, as the API asks),
    the text blocks one user message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for k, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise _bad("a tool_result block needs a string tool_use_id", f"{param}[{k}].tool_use_id")
            result = _text_blocks(block.get("content", ""), f"{param}[{k}].content")
            if not isinstance(block.get("is_error", False), bool):
                raise _bad("a tool_result's is_error must be a boolean", f"{param}[{k}].is_error")
            if block.get("is_error") is True:
                result = f"Error: {result}"  # what the model reads of the flag: the chat has no field
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise _unsupported(kind, f"{param}[{k}]")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_turn(blocks: list[Any], param: str) -> dict[str, Any]:
    """An assistant message's blocks as one chat message: its text, its ``tool_use`` blocks as tool
    calls and its ``thinking`` as the template's reasoning (redacted thinking is left out)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for k, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            message["content"] += block["text"]
        elif kind == "tool_use":
            call_id, name, given = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(given, dict):
                raise _bad("a tool_use block needs a string id and name and an object input", f"{param}[{k}]")
            arguments = json.dumps(given, ensure_ascii=False)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            message.setdefault("tool_calls", []).append(call)
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _bad("a thinking block needs a string thinking", f"{param}[{k}].thinking")
            message["reasoning_content"] = block["thinking"]
        elif kind != "redacted_thinking":
            raise _unsupported(kind, f"{param}[{k}]")
    return message


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user or assistant messages as one turn each, as Anthropic combines them (a chat
    template may insist that roles alternate): texts joined by a blank line, tool calls in order."""
    out: list[dict[str, Any]] = []
    for m in messages:
        last = out[-1] if out else None
        if last is None or m["role"] != last["role"] or m["role"] not in ("user", "assistant"):
            out.append(dict(m))
            continue
        last["content"] = "\n\n".join(t for t in (last["content"], m["content"]) if t)
        if m.get("tool_calls"):
            last["tool_calls"] = [*last.get("tool_calls", []), *m["tool_calls"]]
        if m.get("reasoning_content"):
            last["reasoning_content"] = m["reasoning_content"]
    return out


def chat_messages(req: MessagesRequest) -> tuple[list[dict[str, Any]], bool]:
    """The conversation as chat messages, and whether its last message is the assistant's to go on
    with (a prefill: text only)."""
    out: list[dict[str, Any]] = []
    system = req.system
    if isinstance(system, list):
        system = [
            b
            for b in system
            if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))
        ]
    if system:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    if not req.messages:
        raise _bad("messages must not be empty", "messages")
    for i, m in enumerate(req.messages):
        param = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad("a message's role must be 'user' or 'assistant'", f"{param}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise _bad("content must be a string or a list of content blocks", f"{param}.content")
        elif role == "user":
            out += _user_turns(content, f"{param}.content")
        else:
            out.append(_assistant_turn(content, f"{param}.content"))
    out = _merged(out)
    last = out[-1]
    prefill = last["role"] == "assistant"
    if prefill and last.get("tool_calls"):
        message = "the last message may be the assistant's only as text to go on with, not tool_use"
        raise _bad(message, f"messages[{len(req.messages) - 1}].content")
    return out, prefill


# ---- tools and formats -------------------------------------------------------------------------
def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Custom tools (``name``, ``description``, ``input_schema``) as chat function tools; a server
    tool (web search, code execution, a computer) is a 400."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") or "custom"
        if kind != "custom":
            raise _bad(f"only custom tools are supported, got type {kind!r}", f"tools[{i}].type")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise _bad("a tool's description must be a string", f"tools[{i}].description")
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def chat_tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    message = "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}"
    raise _bad(message, "tool_choice")


def response_format(config: dict[str, Any]) -> dict[str, Any] | None:
    """``output_config.format`` (a JSON schema) as the chat's ``response_format``."""
    fmt = config.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        message = "output_config.format must be {'type': 'json_schema', 'schema': {...}}"
        raise _bad(message, "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_request(req: MessagesRequest, data: dict[str, Any], reasoning: bool = False) -> dict[str, Any]:
    """The chat body for this message. ``reasoning``: the server reads thinking apart (a reasoning
    parser), so ``thinking.budget_tokens`` bounds it (``thinking_token_budget``)."""
    messages, prefill = chat_messages(req)
    body: dict[str, Any] = {k: data[k] for k in CHAT_EXTENSIONS if data.get(k) is not None}
    body.update(
        {
            "model": req.model,
            "messages": messages,
            "stream": req.stream,
            "max_completion_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
        }
    )
    if req.stop_sequences is not None:
        body["stop"] = req.stop_sequences
    user = (req.metadata or {}).get("user_id")
    if user is not None:
        body["user"] = user
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    choice = req.tool_choice
    if choice is not None:
        if not req.tools and choice.get("type") in ("auto", "none"):
            choice = None  # an explicit default without tools: nothing to choose from
        else:
            body["tool_choice"] = chat_tool_choice(choice)
            if choice.get("disable_parallel_tool_use") is True:
                body["parallel_tool_calls"] = False
    # templates that think (Qwen3's) read it, the others ignore it; left out, thinking is off, as
    # Anthropic's API has it (a template's own default is not asked for)
    thinking = req.thinking or {}
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs.setdefault("enable_thinking", (thinking.get("type") or "disabled") != "disabled")
    body["chat_template_kwargs"] = kwargs
    if reasoning and thinking.get("type") == "enabled" and thinking.get("budget_tokens") is not None:
        body.setdefault("thinking_token_budget", thinking["budget_tokens"])
    config = req.output_config or {}
    if config.get("format") is not None:
        body["response_format"] = response_format(config)
    if config.get("effort") is not None:
        body["reasoning_effort"] = config["effort"]  # given to the template, as a chat's is
    return {k: v for k, v in body.items() if v is not None}


def renamed(exc: APIError) -> APIError:
    """The chat route's error with this API's names for the fields (a chat message's index counts
    the system message and each tool result, so ``messages[k]`` becomes ``messages`` alone)."""
    message, param = CHAT_TOOL_FIELD.sub(r"\1.name", exc.message), exc.param
    message = MESSAGE_INDEX.sub("messages", message)
    for chat_name, name in RENAMES:
        message = message.replace(chat_name, name)
    if param is not None:
        param = MESSAGE_INDEX.sub("messages", CHAT_TOOL_FIELD.sub(r"\1.name", param))
        for chat_name, name in RENAMES:
            param = param.replace(chat_name, name)
        if param.startswith("messages"):
            param = "messages"
        param = PARAM_RENAMES.get(param, param)
    exc.message, exc.param, exc.args = message, param, (message,)
    return exc


__all__ = ["MessagesRequest", "chat_request", "check_refused", "check_supported", "renamed"]
