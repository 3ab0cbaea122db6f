"""vLLM's tokenizer routes' bodies: ``/tokenize`` (a text prompt, or chat messages through the chat
template), ``/detokenize`` and ``/tokenizer_info``.

Clients that count or build token ids themselves (lm-evaluation-harness's remote tokenizer backend
among them) ask the server for its tokenizer instead of downloading it. Each check raises
``APIError``; the server's routes (``entrypoints/openai/tokenizer_routes.py``) run the encoding in a
worker thread.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefixserve.engine.prompt_tokens import encode_prompt
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.prepare import OpenAIContext, chat_prompt
from prefixserve.protocols.openai.request_models import ChatCompletionRequest, ChatMessage, parse_request
from prefixserve.protocols.openai.tools import read_tools

TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")
# what /tokenizer_info reports of the tokenizer (vLLM's fields; lm-eval reads eos_token, chat_template)
INFO_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length", "padding_side")


class TokenizeRequest(BaseModel):
    """A text prompt, or chat messages through the chat template (vLLM's two forms; messages are read
    again as a chat request, with its ``tools`` and ``application``)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int] = Field(default=None)  # type: ignore[assignment]


def tokenizer_of(ctx: OpenAIContext) -> Any:
    """The model's tokenizer; a 400 where it has none."""
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return ctx.tokenizer


def tokenize_ids(ctx: OpenAIContext, req: TokenizeRequest, body: dict[str, Any]) -> list[int]:
    """A ``/tokenize`` request's token ids: its prompt encoded, or its messages rendered as
    ``/v1/chat/completions`` renders them (roles, tool turns, tools, application) and encoded."""
    tok = tokenizer_of(ctx)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either 'prompt' or 'messages'", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        return list(tok.encode(req.prompt, add_special_tokens=special))
    chat: ChatCompletionRequest = parse_request(ChatCompletionRequest, body, "messages")
    if not chat.messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    text, _ = chat_prompt(ctx, chat, read_tools(chat))
    if is_pml_prompt(text):
        raise APIError(400, "a Prompt Cache conversation is laid out by the engine: not tokenized here")
    if req.add_special_tokens is not False:  # as the chat's prompt is encoded: one BOS at most
        return encode_prompt(tok, text)
    return list(tok.encode(text, add_special_tokens=False))


def check_detokenize(ctx: OpenAIContext, req: DetokenizeRequest) -> None:
    """A 400 for a token id outside the vocabulary."""
    vocab = len(tokenizer_of(ctx))
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")


def tokenizer_info(ctx: OpenAIContext, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's special tokens, class, length limit and chat template."""
    tok = tokenizer_of(ctx)
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for name in INFO_FIELDS:
        value = getattr(tok, name, None)
        if isinstance(value, (str, int, float, bool)) or value is None:
            info[name] = value
    if isinstance(info.get("model_max_length"), (int, float)) and info["model_max_length"] > 1e12:
        info["model_max_length"] = max_model_len  # HF's "no limit" sentinel
    template = getattr(tok, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    return info


__all__ = [
    "INFO_FIELDS",
    "TOKENIZER_ROUTES",
    "DetokenizeRequest",
    "TokenizeRequest",
    "check_detokenize",
    "tokenize_ids",
    "tokenizer_info",
    "tokenizer_of",
]
