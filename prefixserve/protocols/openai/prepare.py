"""One OpenAI completion or chat body -> engine prompts and sampling parameters, and back to a body.

The server's routes and the offline batch runner both go through here, so a batch row's response
body is exactly what the server would answer for the same body. No web framework: each check raises
``APIError`` with the status and a message that names the problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from prefixserve.engine.prompt_tokens import behind_pinned, encode_prompt, keep_last
from prefixserve.engine.system_prompts import opens_own_system, opens_with_pinned, render_system_prompt
from prefixserve.outputs import RequestOutput
from prefixserve.pooling_params import PoolingParams
from prefixserve.promptcache.chat import chat_prompt as chat_as_pml
from prefixserve.promptcache.pml import PMLError, is_pml_prompt
from prefixserve.protocols.errors import APIError, as_sent, param_of
from prefixserve.protocols.ids import answer_id
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.reasoning import ReasoningSplit, Thinking, reasoning_kind, with_reasoning
from prefixserve.protocols.openai.request_models import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    check_not_done,
    normalize_prompts,
    normalize_stop,
    parse_request,
)
from prefixserve.protocols.openai.salt_scope import salt_scope, system_text
from prefixserve.protocols.openai.structured import structured_outputs
from prefixserve.protocols.openai.text_tokens import TextTokens
from prefixserve.protocols.openai.token_names import TokenNames
from prefixserve.protocols.openai.tool_stream import ToolStreamState
from prefixserve.protocols.openai.tools import (
    Tools,
    conversation,
    read_tools,
    template_knows_tools,
    template_kwargs,
    tool_message,
)
from prefixserve.sampling.params import MAX_LOGPROBS, SamplingParams
from prefixserve.sampling.structured_outputs import StructuredOutputs

# ``apply_chat_template``'s own arguments: a request sets them through its fields (or not at all), never
# through ``chat_template_kwargs``, whose keys the template reads as its variables (``enable_thinking``)
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


@dataclass(kw_only=True)
class OpenAIContext:
    """What turning a body into engine work needs: the model's name, tokenizer and applications."""

    model: str
    tokenizer: Any
    system_prompts: dict[str, str]
    aliases: tuple[str, ...] = ()  # other names requests may give the model (--served-model-name)
    reasoning_parser: str | None = None  # chats' <think> answered apart (reasoning.py)
    trust_request_chat_template: bool = False  # a chat's own chat_template renders it (vLLM's flag)
    cache_salt_scope: str = "prompt"  # what a cache_salt covers where a request names no scope
    hidden_size: int | None = None  # the model's final hidden states: an embedding's dimensions
    # SamplingParams fields a request that leaves them unset takes (the model's generation config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    _pinned: dict[str, list[int]] = field(default_factory=dict)  # application -> its pinned prompt's ids
    token_names: TokenNames = field(init=False)  # a token's text (logprobs' ``token``) and its bytes

    def __post_init__(self) -> None:
        self.token_names = TokenNames(self.tokenizer)

    def engine_ids(self, ids: list[int], application: str | None) -> list[int]:
        """A prompt's ids as the engine's intake makes them: the application's pinned prompt first."""
        if application is None or application not in self.system_prompts:
            return ids
        head = self._pinned.get(application)
        if head is None:
            text = self.system_prompts[application]
            head = self._pinned[application] = render_system_prompt(self.tokenizer, text)
        return behind_pinned(head, ids, self.tokenizer)


@dataclass(slots=True)
class Prepared:
    """A checked request: what to queue (one engine request per prompt) and how to answer."""

    chat: bool
    rid: str  # the response's id (cmpl-... / chatcmpl-...)
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[str | list[int]]
    params: SamplingParams
    want_logprobs: bool
    echo: bool = False  # completions: the prompt's text (and its logprobs) lead each choice
    no_completion: bool = False  # echo with max_tokens 0: the one token generated is not answered
    tools: Tools | None = None  # chat with tools: the output may be tool calls (openai/tools.py)
    # a chat's echo (vLLM's): the last message's text, where it is the assistant's, leads the answer
    echo_content: str = ""
    # the pinned system prompt the prompts go behind: the request's ``application``, or for a chat
    # None where the conversation brought its own system message (the pinned one leads no chat twice)
    application: str | None = None
    thinking: Thinking | None = None  # a chat whose reasoning is answered apart (reasoning.py)
    pooling: PoolingParams | None = None  # /v1/embeddings: each prompt's embedding, no completion
    input_field: str | None = None  # the body's field holding the prompts, where not prompt / messages
    # a salted request's public part (``public_tokens``): under the "after-system" scope, a chat's
    # leading system messages rendered alone (the application's pinned prompt is public too)
    salt_scope: str = "prompt"
    public_text: str | None = None
    # Anthropic's cache breakpoints: each one's prefix as rendered, its seconds, and whether it marks
    # its prefix public (``pin_counts``, ``public_tokens``)
    pin_texts: list[tuple[str, float, bool]] = field(default_factory=list)

    @property
    def prompt_field(self) -> str:
        return self.input_field or ("messages" if self.chat else "prompt")


MAX_CHOICES = MAX_PROMPTS  # choices (n x prompts) in one completions answer


def truncated(prep: Prepared, ids: list[int], max_model_len: int | None) -> list[int]:
    """The ids the engine keeps of a prompt under ``truncate_prompt_tokens`` (``keep_last``). -1 needs
    the context length: without it (a router, a plan made before the model loads) the ids stay whole."""
    keep = prep.params.truncate_prompt_tokens
    if keep is None or (keep == -1 and max_model_len is None):
        return ids
    return keep_last(ids, keep, prep.params.max_tokens, max_model_len or 0)


def prompt_ids(ctx: OpenAIContext, prep: Prepared, prompt: str | list[int]) -> list[int] | None:
    """A prompt's ids as the request has it encoded (``add_special_tokens``: the tokenizer's BOS in
    front, once, or the text alone), or None for a text the engine reads itself: a Prompt Cache
    document, or a model without a tokenizer."""
    if not isinstance(prompt, str):
        return list(prompt)
    if ctx.tokenizer is None or is_pml_prompt(prompt):
        return None
    if getattr(prep.req, "add_special_tokens", None) is not False:
        return encode_prompt(ctx.tokenizer, prompt)
    return list(ctx.tokenizer.encode(prompt, add_special_tokens=False))


def check_model(ctx: OpenAIContext, name: str | None) -> None:
    if name is None or name in (ctx.model, "default", *ctx.aliases):
        return
    served = ", ".join(repr(n) for n in (ctx.model, *ctx.aliases))
    message = f"the model '{name}' does not exist; this server serves {served} (or use 'default')"
    raise APIError(404, message, param="model", code="model_not_found")


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming each field that is set to something this server does not do: a client that asks
    for beam search must not get an answer made without it."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs cannot be streamed", param="prompt_logprobs")
    if req.return_token_ids and req.stream:
        raise APIError(400, "return_token_ids cannot be streamed", param="return_token_ids")
    if req.length_penalty is not None and not req.use_beam_search:
        raise APIError(
            400, "length_penalty applies only to beam search (use_beam_search)", param="length_penalty"
        )
    if isinstance(req, ChatCompletionRequest) and req.echo and req.tools:
        raise APIError(400, "echo cannot be combined with tools on chat completions", param="echo")
    if isinstance(req, ChatCompletionRequest) and req.best_of not in (None, req.n):
        raise APIError(400, "best_of is not supported on chat completions: it must equal n", param="best_of")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of > req.n and req.stream:
            raise APIError(400, "best_of > n cannot be streamed", param="best_of")


def _or_default(value: Any, defaults: dict[str, Any], name: str, openai: Any) -> Any:
    """A request's value; where it sets none, the model's default (``sampling_defaults``), else OpenAI's."""
    return value if value is not None else defaults.get(name, openai)


def sampling(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutputs | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """``max_tokens``: already defaulted by the caller (``default_max_tokens``)."""
    defaults = defaults or {}
    try:
        return SamplingParams(
            n=req.n,
            temperature=_or_default(req.temperature, defaults, "temperature", 1.0),
            top_p=_or_default(req.top_p, defaults, "top_p", 1.0),
            top_k=_or_default(req.top_k, defaults, "top_k", 0),
            min_p=_or_default(req.min_p, defaults, "min_p", 0.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=normalize_stop(req.stop),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_or_default(req.repetition_penalty, defaults, "repetition_penalty", 1.0),
            logit_bias=req.logit_bias or None,
            best_of=req.best_of if isinstance(req, CompletionRequest) else None,
            structured_outputs=structured,
            allowed_token_ids=req.allowed_token_ids,
            skip_special_tokens=req.skip_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            bad_words=req.bad_words or None,
            prompt_logprobs=req.prompt_logprobs,
            thinking_token_budget=req.thinking_token_budget,
        )
    except ValueError as exc:
        param, code = param_of(str(exc), "prompt")
        raise APIError(400, str(exc), param=param, code=code) from None


def application_prompt(ctx: OpenAIContext, application: str) -> str:
    system = ctx.system_prompts.get(application)
    if system is None:
        known = ", ".join(sorted(ctx.system_prompts)) or "none are configured"
        raise APIError(400, f"unknown application {application!r} (known: {known})", param="application")
    return system


def prepare_completion(ctx: OpenAIContext, data: Any) -> Prepared:
    """Check a /v1/completions body; one engine prompt per prompt in it."""
    check_not_done(data)
    req: CompletionRequest = parse_request(CompletionRequest, data, "prompt")
    check_model(ctx, req.model)
    check_unsupported(req)
    prompts = normalize_prompts(req.prompt)
    structured = structured_outputs(req)
    max_tokens = _or_default(req.max_tokens, ctx.sampling_defaults, "max_tokens", 16)
    no_completion = req.echo and max_tokens == 0  # the prompt's logprobs alone (lm-eval's scoring)
    if no_completion and req.stream:
        raise APIError(400, "echo with max_tokens 0 (the prompt alone) is not streamed", param="stream")
    if no_completion and req.min_tokens:
        message = f"min_tokens must be <= max_tokens (0: the prompt alone), got {req.min_tokens}"
        raise APIError(400, message, param="min_tokens", code="invalid_value")
    defaults = ctx.sampling_defaults
    params = sampling(req, 1 if no_completion else max_tokens, req.logprobs, structured, defaults)
    if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs: as many top ones as asked
        params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
    if len(prompts) * params.num_samples > MAX_CHOICES:
        total = len(prompts) * params.num_samples
        raise APIError(400, f"n (or best_of) x prompts must be at most {MAX_CHOICES}, got {total}", "n")
    if req.application is not None:
        application_prompt(ctx, req.application)  # a 400 naming an unknown application
    want = req.logprobs is not None
    rid = answer_id("cmpl", req.request_id)
    return Prepared(
        False, rid, req, prompts, params, want, req.echo, no_completion, application=req.application,
        salt_scope=salt_scope(ctx, req),
    )  # fmt: skip


def check_template_fields(ctx: OpenAIContext, req: ChatCompletionRequest) -> None:
    """A 400 for the template fields a chat may not set so (every route that renders one asks)."""
    if req.chat_template is not None and not ctx.trust_request_chat_template:
        message = (
            "chat_template is not taken from requests unless the server runs with "
            "--trust-request-chat-template: the server's template applies"
        )
        raise APIError(400, message, param="chat_template")
    if req.continue_final_message and req.add_generation_prompt:
        message = "continue_final_message needs add_generation_prompt=false (the last message goes on)"
        raise APIError(400, message, param="continue_final_message")
    reserved = set(req.chat_template_kwargs or ()) & TEMPLATE_ARGUMENTS
    if reserved:
        message = f"chat_template_kwargs may not set {sorted(reserved)}: they are request fields"
        raise APIError(400, message, param="chat_template_kwargs")


def chat_prompt(
    ctx: OpenAIContext, req: ChatCompletionRequest, tools: Tools | None = None
) -> tuple[str, str | None]:
    """The request's messages through the chat template, with the tools (``openai/tools.py``), and
    the application whose pinned prompt it starts with. A conversation without a system message gets
    the application's; one with its own keeps it, alone (no application); where the tools are written
    into the pinned message, the chat no longer opens with the pinned prompt (no application). A
    conversation whose first message is a ``<prompt>`` document becomes one PML prompt instead."""
    check_template_fields(ctx, req)
    native = tools is not None and template_knows_tools(ctx.tokenizer, req.chat_template)
    given = list(req.messages)
    system = None if req.application is None else application_prompt(ctx, req.application)
    if system is not None and not opens_own_system(given[0].role, given[0].text()):
        given.insert(0, ChatMessage(role="system", content=system))
    else:
        system = None
    messages = conversation(given, tools, native)
    try:
        pml = chat_as_pml(messages)
    except PMLError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_pml") from None
    if pml is not None:  # a Prompt Cache conversation: the engine lays it out over the schema's modules
        templated = [
            f
            for f in (
                "continue_final_message",
                "chat_template_kwargs",
                "documents",
                "reasoning_effort",
                "chat_template",
            )
            if getattr(req, f)
        ]
        if templated:
            message = f"a conversation opening with a <prompt> document is not templated: drop {templated[0]}"
            raise APIError(400, message, param=templated[0])
        if req.application is not None:
            raise APIError(
                400,
                "a conversation opening with a <prompt> document takes no application",
                param="application",
            )
        return pml, None
    extra = template_kwargs(req, tools, native)
    if req.continue_final_message:
        extra["continue_final_message"] = True
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt, **extra
        )
    except Exception as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    text = str(text)
    return text, req.application if opens_with_pinned(ctx.tokenizer, text, system) else None


def prepare_chat(ctx: OpenAIContext, data: Any) -> Prepared:
    """Check a /v1/chat/completions body; its messages become one prompt through the chat template."""
    check_not_done(data)
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, data, "messages")
    check_model(ctx, req.model)
    check_unsupported(req)
    if not req.messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _or_default(max_tokens, ctx.sampling_defaults, "max_tokens", None)
    tools = read_tools(req)
    structured = structured_outputs(req)
    forced = tools.constraint() if tools is not None else None
    if forced is not None and structured is not None:
        message = "tool_choice 'required' or a named function takes no response_format or structured_outputs"
        raise APIError(400, message, param="tool_choice", code="invalid_value")
    try:
        params = sampling(
            req,
            max_tokens,
            (req.top_logprobs or 0) if req.logprobs else None,
            forced or structured,
            ctx.sampling_defaults,
        )
    except APIError as exc:  # the limit came as max_completion_tokens: the error names that field
        raise as_sent(exc, req) from None
    prompt, application = chat_prompt(ctx, req, tools)
    rid = answer_id("chatcmpl", req.request_id)
    last = req.messages[-1]
    echo = last.text() if req.echo and last.role == "assistant" else ""
    calls = tools if tools is not None and tools.choice != "none" else None  # what reads the output
    thinking = None
    if ctx.reasoning_parser is not None and not is_pml_prompt(prompt):
        last, continued = req.messages[-1].text(), req.continue_final_message
        thinking = Thinking.for_prompt(prompt, last, continued, ctx.reasoning_parser)
        if params.structured_outputs is not None:  # the constraint holds for the answer, after the thought
            how = "opened" if thinking.opened else "optional"
            params.structured_outputs = replace(params.structured_outputs, after_thinking=how)
    scope = salt_scope(ctx, req)
    salted = req.cache_salt is not None and scope == "after-system" and application is None
    public = system_text(ctx, req, tools) if salted else None
    return Prepared(
        True, rid, req, [prompt], params, bool(req.logprobs), tools=calls, application=application,
        echo_content=echo, thinking=thinking, salt_scope=scope, public_text=public,
    )  # fmt: skip


def prepare(ctx: OpenAIContext, url: str, data: Any) -> Prepared:
    """The body of a request to ``url`` (``/v1/completions`` or ``/v1/chat/completions``), checked."""
    return prepare_chat(ctx, data) if url.endswith("/chat/completions") else prepare_completion(ctx, data)


def token_text(ctx: OpenAIContext, prep: Prepared) -> fmt.TokenText:
    """How the request's logprobs name a token: its text, or with vLLM's ``return_tokens_as_token_ids``
    ``token_id:<id>`` (a token whose text is not valid UTF-8 on its own stays identifiable)."""
    return token_id_text if prep.req.return_tokens_as_token_ids else ctx.token_names


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def response_body(ctx: OpenAIContext, prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed answer, from every prompt's final output in order; with vLLM's
    ``return_token_ids`` the prompt's ids (as the engine ran it) and each choice's."""
    body = _answer_body(ctx, prep, finals)
    if prep.req.return_token_ids:
        for choice in body["choices"]:
            final = finals[0] if prep.chat else finals[choice["index"] // prep.params.n]
            ids = [] if prep.no_completion else final.outputs[choice["index"] % prep.params.n].token_ids
            choice["token_ids"] = list(ids)
            if not prep.chat:
                choice["prompt_token_ids"] = list(final.prompt_token_ids)
        if prep.chat:
            body["prompt_token_ids"] = list(finals[0].prompt_token_ids)
    return body


def _answer_body(ctx: OpenAIContext, prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    if prep.chat:
        body = fmt.chat_body(prep.rid, ctx.model, finals[0], token_text(ctx, prep), prep.want_logprobs)
        if prep.req.prompt_logprobs is not None:  # vLLM puts a chat's at the top
            body["prompt_logprobs"] = fmt.prompt_logprobs(
                finals[0], prep.req.prompt_logprobs, token_text(ctx, prep)
            )
        for choice in body["choices"]:
            reasoning = None
            if prep.thinking is not None:  # the model's answer apart from its reasoning, then read for calls
                reasoning, choice["message"]["content"] = prep.thinking.split(choice["message"]["content"])
            if prep.echo_content:  # what the client sent leads the model's answer
                choice["message"]["content"] = prep.echo_content + (choice["message"]["content"] or "")
            if prep.tools is not None:
                text = choice["message"]["content"]
                choice["message"], choice["finish_reason"] = tool_message(
                    text, choice["finish_reason"], prep.tools
                )
            if reasoning is not None:
                choice["message"] = with_reasoning(choice["message"], reasoning)
        return body
    if prep.no_completion:
        finals = [fmt.without_completion(f) for f in finals]
    k = prep.req.prompt_logprobs
    skips = [pinned_lead(ctx, prep, p) for p in prep.prompts] if prep.echo or k is not None else None
    echoed = (
        [_prompt_text(ctx, f, skip) for f, skip in zip(finals, skips or (), strict=True)]
        if prep.echo
        else None
    )
    echo_k = prep.req.logprobs if prep.echo else None
    body = fmt.completion_body(
        prep.rid,
        ctx.model,
        finals,
        prep.params.n,
        token_text(ctx, prep),
        prep.want_logprobs,
        echoed,
        echo_k,
        skips,
    )
    if k is not None and skips is not None:  # each choice its prompt's (vLLM's shape)
        for choice in body["choices"]:
            p = choice["index"] // prep.params.n
            choice["prompt_logprobs"] = fmt.prompt_logprobs(finals[p], k, token_text(ctx, prep), skips[p])
    return body


def pinned_lead(ctx: OpenAIContext, prep: Prepared, prompt: str | list[int]) -> int:
    """How many leading prompt ids of the engine's are the application's pinned prompt, put in front
    of a prompt that did not start with it: echo and prompt_logprobs answer for the client's prompt."""
    if prep.application is None:
        return 0
    head = ctx.engine_ids([], prep.application)
    sent = prompt_ids(ctx, prep, prompt) or []
    return 0 if sent[: len(head)] == head else len(head)


def _echo_lead(ctx: OpenAIContext, prep: Prepared) -> fmt.EchoLead:
    """What leads a streamed completion's choices with echo: as ``completion_body`` puts it."""
    skips = [pinned_lead(ctx, prep, p) for p in prep.prompts]

    def lead(p: int, out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        text = _prompt_text(ctx, out, skips[p])
        k = prep.req.logprobs
        lp = (
            fmt.prompt_completion_logprobs(out, token_text(ctx, prep), k, skips[p])
            if prep.want_logprobs
            else None
        )
        return text, lp

    return lead


def _prompt_text(ctx: OpenAIContext, final: RequestOutput, skip: int = 0) -> str:
    """What echo puts before a choice's text: the prompt as given, or its token ids from ``skip`` on
    (past a pinned prompt the client did not send) decoded."""
    if final.prompt is not None:
        return final.prompt
    return ctx.tokenizer.decode(final.prompt_token_ids[skip:]) if ctx.tokenizer is not None else ""


def stream_state(
    ctx: OpenAIContext,
    prep: Prepared,
    plain: type[fmt.StreamState] = fmt.StreamState,
    with_tools: type[ToolStreamState] = ToolStreamState,
) -> fmt.StreamState:
    """The request's stream state: ``with_tools`` where its output may be tool calls, else ``plain``
    (the Responses API passes its event-sending kinds of each)."""
    req = prep.req
    if prep.thinking is not None:  # the same kinds, with the reasoning apart
        plain, with_tools = reasoning_kind(plain), reasoning_kind(with_tools)
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(include_usage and options and options.continuous_usage_stats)
    state: fmt.StreamState
    if prep.tools is not None:
        state = with_tools(
            prep.rid, ctx.model, prep.chat, prep.params.n, token_text(ctx, prep),
            list(prep.params.stop or []), prep.want_logprobs, include_usage, continuous_usage=continuous,
            tools=prep.tools,
        )  # fmt: skip
    else:
        state = plain(
            prep.rid, ctx.model, prep.chat, prep.params.n, token_text(ctx, prep),
            list(prep.params.stop or []), prep.want_logprobs, include_usage, echo=prep.echo_content,
            continuous_usage=continuous, echo_lead=_echo_lead(ctx, prep) if prep.echo else None,
        )  # fmt: skip
    if prep.thinking is not None:  # the reasoning chunks carry their own tokens' logprobs
        skip = prep.params.skip_special_tokens
        counter = partial(TextTokens, ctx.tokenizer, skip) if prep.want_logprobs else None
        state.reasoning = ReasoningSplit(prep.thinking, counter)  # type: ignore[attr-defined]
    return state
