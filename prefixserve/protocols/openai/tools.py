"""Tool calling on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

Rendering: a chat template that knows tools (it mentions ``tools``) gets them through
``apply_chat_template(..., tools=...)`` and earlier calls and tool results as its messages; a template
that does not (SmolLM2's) gets the Hermes format written into the system message: the function
signatures inside ``<tools></tools>``, and the instruction to answer with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format Hermes and Qwen2.5 models
are trained on; earlier calls are rendered in it and tool results as ``<tool_response>`` user turns.

Reading the output, as vLLM does: ``auto`` parses ``<tool_call>`` blocks (or one bare call object)
from the text; ``required`` constrains the output to a JSON array of calls (``name`` one of the
tools, ``arguments`` its parameters schema; one call when ``parallel_tool_calls`` is false) and a
named function to its arguments alone, so both always parse; under ``none`` the tools are rendered
(the prompt stays the one the conversation's other turns share) and the output is plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.request_models import ChatCompletionRequest, ChatMessage
from prefixserve.protocols.openai.structured import checked
from prefixserve.sampling.structured_outputs import StructuredOutputs

CALL_TAG = "<tool_call>"  # opens a call in the output (Hermes / Qwen2.5)
TOOL_CALL = re.compile(re.escape(CALL_TAG) + r"\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ANY_OBJECT = {"type": "object"}


@dataclass(slots=True)
class Tools:
    """A request's functions and how its output is read: ``choice`` is auto, required or named."""

    functions: dict[str, dict[str, Any]]  # name -> {"name", "description"?, "parameters"?}
    choice: str
    named: str | None = None
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        return self.functions[name].get("parameters") or ANY_OBJECT

    def constraint(self) -> StructuredOutputs | None:
        """What ``required`` and a named function constrain the output to (None for ``auto``)."""
        if self.choice == "named":
            return checked(StructuredOutputs(json=self.parameters(self.named)), "tool_choice")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                "required": ["name", "arguments"],
            }
            for name in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return checked(StructuredOutputs(json=schema), "tools")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def read_tools(req: ChatCompletionRequest) -> Tools | None:
    """The request's tools, checked (a 400 names the field); None without tools. Under ``none`` they
    are in the prompt, as OpenAI and vLLM put them, and the output is never read as calls."""
    choice = req.tool_choice
    if req.tools is not None and not req.tools:
        raise _bad("tools must not be empty (leave the field out for no tools)", "tools")
    if not req.tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise _bad("each tool must be {'type': 'function', 'function': {...}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise _bad(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ . -", f"tools[{i}].function.name"
            )
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise _bad(
                    f"tools[{i}].function.parameters must be an object", f"tools[{i}].function.parameters"
                )
            checked(StructuredOutputs(json=params), f"tools[{i}].function.parameters")
        functions[name] = fn
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("auto", "required"):
        return Tools(functions, choice or "auto", parallel=parallel)
    if choice == "none":  # rendered still (the prompt stays the one other turns share), never read
        return Tools(functions, "none", parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    named = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        message = (
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}"
        )
        raise _bad(message, "tool_choice")
    if named not in functions:
        raise _bad(
            f"tool_choice names an unknown function {named!r} (tools: {sorted(functions)})", "tool_choice"
        )
    return Tools(functions, "named", named, parallel)


# ---- rendering ---------------------------------------------------------------------------------
def template_knows_tools(tokenizer: Any, template: str | None = None) -> bool:
    """Whether the chat template (``template``, else the tokenizer's) renders ``tools`` itself."""
    template = template if template is not None else getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def hermes_system(tools: Tools) -> str:
    signatures = "\n".join(
        json.dumps({"type": "function", "function": fn}) for fn in tools.functions.values()
    )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _arguments(call: dict[str, Any]) -> Any:
    args = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def conversation(messages: list[ChatMessage], tools: Tools | None, native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; ``native``: the template renders tools itself."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.reasoning_content is not None:
            entry["reasoning_content"] = m.reasoning_content
        if native:
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {
                        "name": c.get("function", {}).get("name"), "arguments": _arguments(c)}}
                    for c in m.tool_calls
                ]  # fmt: skip
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
        elif m.tool_calls:
            blocks = [
                json.dumps({"name": c.get("function", {}).get("name"), "arguments": _arguments(c)})
                for c in m.tool_calls
            ]
            entry["content"] = "\n".join(
                [m.text(), *(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)]
            ).strip()
        elif role == "tool":
            entry = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        out.append(entry)
    if tools is not None and not native:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + hermes_system(tools)}
        else:
            out.insert(0, {"role": "system", "content": hermes_system(tools)})
    return out


# ---- reading the output ------------------------------------------------------------------------
def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def parse_calls(text: str, tools: Tools) -> list[dict[str, Any]] | None:
    """The tool calls in an output, or None if it holds none (then it is a plain answer)."""
    try:
        if tools.choice == "named":
            json.loads(text)
            return [_call(tools.named, text)]
        if tools.choice == "required":
            return [_call(c["name"], c["arguments"]) for c in json.loads(text)]
    except (ValueError, KeyError, TypeError):
        return None
    found = [m.group(1) for m in TOOL_CALL.finditer(text)] or [text.strip()]
    calls = []
    for raw in found:
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("name") in tools.functions:
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    return (calls if tools.parallel else calls[:1]) or None  # parallel_tool_calls false: the first


def tool_message(text: str, finish_reason: str | None, tools: Tools) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message and finish reason, with ``tool_calls`` when the output made any."""
    calls = parse_calls(text, tools) if finish_reason in ("stop", "length") else None
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    # under auto the text before the first call is the content (vLLM's Hermes parser); a bare call
    # object, not in tags, has none; the stream sends the same (tool_stream.py)
    at = text.find(CALL_TAG) if tools.choice == "auto" else -1
    content = text[:at] if at > 0 else ""
    # a named function's call ends as the output ended ("stop"), as OpenAI's and vLLM's do; only auto
    # and required calls end with "tool_calls"
    reason = finish_reason if tools.choice == "named" else "tool_calls"
    return {
        "role": "assistant",
        "content": content if content.strip() else None,
        "tool_calls": calls,
    }, reason


def template_kwargs(req: Any, tools: Tools | None, native: bool) -> dict[str, Any]:
    """The keyword arguments a chat request gives ``apply_chat_template`` besides its messages: its
    template variables, documents, reasoning effort and own template, and the tools where the
    template writes them itself (``native``). ``continue_final_message`` is the caller's: it concerns
    the last message only."""
    extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        extra["documents"] = req.documents
    if req.reasoning_effort is not None:
        extra["reasoning_effort"] = req.reasoning_effort
    if req.chat_template is not None:  # the request's own (--trust-request-chat-template)
        extra["chat_template"] = req.chat_template
    if native and tools is not None:  # the template renders the tools itself
        extra["tools"] = [{"type": "function", "function": f} for f in tools.functions.values()]
    return extra


__all__ = [
    "Tools",
    "conversation",
    "parse_calls",
    "read_tools",
    "template_knows_tools",
    "template_kwargs",
    "tool_message",
]
