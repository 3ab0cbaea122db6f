"""OpenAI's completion and chat request models, and the checks every body takes before them.

Requests are validated in strict mode so that a wrong type (``"temperature": "hot"``, ``"n": "3"``) is a
400 naming the field, as OpenAI does, instead of being coerced. Unknown fields are ignored (clients send
``user``, ``metadata`` and friends). Refusals are ``errors.APIError``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefixserve.protocols.errors import APIError

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
    prompt_cache_key: str | None = None  # OpenAI's: requests sharing it go to one replica (--replicas)
    repetition_penalty: float | None = None  # vLLM's extension
    # extensions
    cache_salt: str | None = None
    cache_salt_scope: str | None = None  # "prompt" | "after-system"; None: the server's --cache-salt-scope
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
