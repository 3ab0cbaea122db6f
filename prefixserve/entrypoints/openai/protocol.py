"""OpenAI request models and the error shape the server answers with.

Requests are validated in strict mode so that a wrong type (``"temperature": "hot"``, ``"n": "3"``) is a
400 naming the field, as OpenAI does, instead of being coerced. Unknown fields are ignored (clients send
``user``, ``metadata`` and friends).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from prefixserve.outputs import RequestOutput

# prompts in one /v1/completions request (vLLM sets none): many questions on one document may come
# as one request; each prompt is an engine request, which the waiting queue's bounds still count
MAX_PROMPTS = 2048

# Fields OpenAI or vLLM define that change what a client gets and that this server does not do: set
# to anything but their "off" value, they are a 400 naming the field, never silently ignored
NOT_DONE = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "web_search_options": "this server has no hosted web search",
    "audio": "this model writes text only",
    "moderation": "this server does not moderate",
    "prediction": "predicted outputs are not supported",
    "structural_tag": "send it as response_format (type structural_tag) or structured_outputs",
    "guided_whitespace_pattern": "the JSON grammar's whitespace is fixed",
    "logits_processors": "custom logits processors are not supported",
    "vllm_xargs": "custom logits processors are not supported",
    "logprob_token_ids": "use logprobs",
    "repetition_detection": "not supported",
    "kv_transfer_params": "disaggregated prefill is not supported",
    "prompt_embeds": "prompts are text or token ids",
    "previous_input_messages": "send the conversation as input, or use previous_response_id",
    "previous_response": "use previous_response_id",
    "context_management": "use truncation",
}
OFF_VALUES = {"modalities": (["text"],), "truncation_side": ("left",)}


def check_not_done(data: Any) -> None:
    """A 400 for the first field of ``NOT_DONE`` (or ``OFF_VALUES``) a body sets."""
    if not isinstance(data, dict):
        return
    for name, reason in NOT_DONE.items():
        if data.get(name) not in (None, False, [], {}):
            raise APIError(
                400, f"{name} is not supported: {reason}", param=name, code="unsupported_parameter"
            )
    for name, off in OFF_VALUES.items():
        if data.get(name) is not None and data[name] not in off:
            message = f"{name} must be {off[0]!r} (or unset) here, got {data[name]!r}"
            raise APIError(400, message, param=name, code="unsupported_parameter")


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers  # sent with the error (e.g. Retry-After on a 429)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_failure(outputs: Iterable[RequestOutput]) -> APIError | None:
    """The error for outputs that finished with "error", or None. Where the engine said why, the
    request can never run here (it needs more of the KV pool than can ever be free): a 400 naming
    the numbers, not to be retried. Otherwise the engine failed while running it: a 500."""
    failed = [o for o in outputs if any(c.finish_reason == "error" for c in o.outputs)]
    if not failed:
        return None
    reasons = [o.error for o in failed if o.error]
    if reasons:
        return APIError(400, reasons[0], code="kv_capacity_exceeded")
    return APIError(500, "the engine failed while running this request", code="engine_error")


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Common(BaseModel):
    """Fields both endpoints share (OpenAI names, plus vLLM-style extensions)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str]: checked by hand for a clearer message
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    # extensions
    cache_salt: str | None = None
    application: str | None = None
    module_recompute: str | None = None  # Prompt Cache recovery: "none", "link:K", "blend:R"
    ignore_eos: bool = False
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # structured outputs (openai/structured.py): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields (removed in vLLM 0.12, still sent by many clients)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: xgrammar is the backend
    # vLLM's extensions, honoured (``prepare.py``): the chosen tokens, the text, the prompt's length
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = None  # each prompt token's logprob, rank and top-k (vLLM's shape)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    priority: int = 0  # under --scheduling-policy priority, a smaller value is served first
    request_id: str | None = None  # vLLM's: the answer's id is cmpl- / chatcmpl- and this (``answer_id``)
    use_beam_search: bool = False  # vLLM's: the n best outputs by beam search (``beam_answers.py``)
    length_penalty: float | None = None  # beam search's score: cum logprob / length ** length_penalty
    thinking_token_budget: int | None = None  # vLLM's: thinking ends after this many tokens (needs a parser)


class CompletionRequest(_Common):
    prompt: Any = Field(default=None)  # str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS (where it adds one) in front of a text prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a participant's name, given to the template
    reasoning_content: str | None = None  # an earlier turn's reasoning (vLLM's), given to the template
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (openai/tools.py)
    tool_call_id: str | None = None  # a tool message: which call it answers

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """A content part that is not text (an image, audio) is refused by its type, not as "not a
        string": the model takes text alone."""
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                shown = f"of type {kind!r}" if kind is not None else "without a type"
                raise ValueError(f"a content part {shown} is not supported: this model takes text parts only")
        return data

    @field_validator("tool_calls")
    @classmethod
    def _calls_shaped(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """An earlier call is rendered into the prompt: its function must be an object with a name."""
        for call in calls or ():
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError("each tool call needs a 'function' object with a string 'name'")
            if not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise ValueError("a tool call's function.arguments must be a JSON string")
        return calls

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(default=None)  # type: ignore[assignment]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open: the model goes on with it
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (enable_thinking)
    documents: list[dict[str, Any]] | None = None  # for templates that render retrieved documents
    chat_template: str | None = None  # refused unless the server trusts requests' templates
    echo: bool = False  # vLLM's: the last message, where it is the assistant's, leads the answer
    reasoning_effort: str | None = None  # given to the template (a template without it ignores it)
    best_of: int | None = None  # refused above n: chats sample n
    # vLLM's: false encodes the rendered chat as it is; true (and unset) puts the tokenizer's BOS
    # in front where the template wrote none (never a second)
    add_special_tokens: bool | None = None


class SchemaRequest(BaseModel):
    """``POST /v1/schemas``: a Prompt Cache schema (PML) to register."""

    model_config = ConfigDict(extra="ignore", strict=True)
    schema_: str = Field(alias="schema")  # ``schema`` would shadow BaseModel.schema
    encode: bool = True  # encode its modules now (else at first use)
    pin: bool = False  # keep its modules on the GPU for good
    replace: bool = False  # replace a schema of the same name (else 409)
    module_recompute: str | None = None  # the schema's accuracy recovery ("none", "link:K", "blend:R")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _loc(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'content', 'list[TextPart]', 0, 'text')`` -> ``messages[0].content[0].text``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() in _TYPE_TAGS or "[" in part or part[:1].isupper():
            continue  # a union member's tag, not a field
        else:
            out += ("." if out else "") + part
    return out


def parse_request(cls: type[BaseModel], data: Any, required: str) -> Any:
    """Validate a decoded JSON body; raises APIError(400) naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if data.get(required) is None:
        raise APIError(
            400, f"'{required}' is a required field", param=required, code="missing_required_field"
        )
    try:
        return cls.model_validate(_without_nulls(data), strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = _loc(tuple(err["loc"])) or None
        if err["type"] == "missing":
            message = f"'{field}' is a required field"
            raise APIError(400, message, param=field, code="missing_required_field") from None
        got = err.get("input")
        shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
        message = f"invalid value for '{field}': {err['msg']} (got {shown[:100]})"
        raise APIError(400, message, param=field, code="invalid_type") from None


def _without_nulls(data: dict[str, Any]) -> dict[str, Any]:
    """The body with its null fields left out: OpenAI's spec marks most fields nullable, and clients
    send unset ones as null (``"n": null``, ``"stream": null``), which then take their defaults."""
    out = {k: v for k, v in data.items() if v is not None}
    options = out.get("stream_options")
    if isinstance(options, dict):
        out["stream_options"] = {k: v for k, v in options.items() if v is not None}
    return out


def normalize_prompts(prompt: Any, field: str = "prompt") -> list[str | list[int]]:
    """The ``prompt`` field (or another ``field``, as /v1/embeddings' ``input``) as a list of prompts,
    each a string or a list of token ids."""
    message = f"'{field}' must be a string, a list of strings, a list of token ids, or a list of such lists"
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
        for p in prompts:
            if not (isinstance(p, str) or (isinstance(p, list) and all(_is_token(t) for t in p))):
                raise APIError(400, message, param=field, code="invalid_type")
    else:
        raise APIError(400, message if prompt != [] else f"'{field}' is empty", param=field)
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param=field)
    for p in prompts:
        if not p:
            raise APIError(400, "the prompt is empty", param=field)
    return prompts


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces: it goes into ids and logs


def answer_id(kind: str, given: str | None) -> str:
    """An answer's id: ``kind``-``given`` where the client named its request (vLLM's ``request_id``
    field, or the ``X-Request-Id`` header), else ``kind``-<random hex>."""
    if given is None:
        return f"{kind}-{uuid.uuid4().hex}"
    if not REQUEST_ID.fullmatch(given):
        message = "request_id must be 1-256 printable ASCII characters without spaces"
        raise APIError(400, message, param="request_id", code="invalid_value")
    return f"{kind}-{given}"


_TAGGED_ID = re.compile(r"(?:resp_|batch_|msgbatch_|file-)([A-Za-z0-9-]+)_[0-9a-f]{32}")


def object_id(prefix: str, tag: str | None = None, sep: str = "_") -> str:
    """An id of a kept object (response, file, batch): ``<prefix><sep><hex>``, or with the keeping
    store's ``tag`` (behind the Ray ingress, its replica's name) ``<prefix><sep><tag>_<hex>``, so that
    the ingress sends a later request naming it to that replica (``id_tag``)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}" if tag is None else f"{prefix}{sep}{tag}_{uuid.uuid4().hex}"


def id_tag(named: str) -> str | None:
    """The store tag in a response's, file's or batch's id (``object_id``), or None."""
    m = _TAGGED_ID.fullmatch(named)
    return m.group(1) if m else None


def page(
    items: list[dict[str, Any]], after: str | None, limit: int, what: str = "listed object"
) -> dict[str, Any]:
    """OpenAI's cursor page: the ``limit`` items after the one whose id is ``after`` (400 naming
    ``what`` where none has that id)."""
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(400, f"no {what} with id {after!r}", param="after")
        items = items[at + 1 :]
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


def normalize_stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise APIError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")


def find_lone_surrogate(value: Any) -> bool:
    """JSON may escape lone UTF-16 surrogates (``"\\ud800"``); they are not text a tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(find_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(find_lone_surrogate(v) for v in value.values())
    return False


def param_of(message: str, prompt_field: str) -> tuple[str | None, str]:
    """Which request field a ValueError from SamplingParams or Engine.add_request is about."""
    fields = (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "logprobs",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "best_of",
        "prompt_logprobs",
        "application",
        "cache_salt",
        "module_recompute",
        "allowed_token_ids",
        "truncate_prompt_tokens",
        "bad_words",
        "priority",
        "thinking_token_budget",
        "length_penalty",
    )
    head = message.split(" ", 1)[0].split("=", 1)[0]
    if head.startswith("structured_outputs"):
        return head.rstrip(":"), "invalid_value"
    if head in fields:
        return head, "invalid_value"
    if "stop" in message:
        return "stop", "invalid_value"
    if "context length" in message and "max_tokens" not in message:
        return prompt_field, "context_length_exceeded"
    if "max_tokens" in message:
        return "max_tokens", "invalid_value"
    if "prompt" in message:
        return prompt_field, "invalid_value"
    if "application" in message:
        return "application", "invalid_value"
    return None, "invalid_value"
