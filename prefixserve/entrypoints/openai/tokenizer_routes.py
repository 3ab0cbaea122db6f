"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, as vLLM serves them.

Clients that count or build token ids themselves (lm-evaluation-harness's remote tokenizer backend
among them) ask the server for its tokenizer instead of downloading it. Encoding runs in a worker
thread (the tokenizer releases the GIL), never on the engine thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from prefixserve.engine.prompt_tokens import encode_prompt
from prefixserve.entrypoints.openai.prepare import chat_prompt, check_model
from prefixserve.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    parse_request,
)
from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_json
from prefixserve.entrypoints.openai.tools import read_tools
from prefixserve.promptcache.pml import is_pml_prompt

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


def _tokenizer(state: ServerState) -> Any:
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return state.tokenizer


def _encode(state: ServerState, req: TokenizeRequest, body: dict[str, Any]) -> list[int]:
    tok = _tokenizer(state)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either 'prompt' or 'messages'", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        return list(tok.encode(req.prompt, add_special_tokens=special))
    # messages: rendered as /v1/chat/completions renders them (roles, tool turns, tools, application)
    chat: ChatCompletionRequest = parse_request(ChatCompletionRequest, body, "messages")
    if not chat.messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    text, _ = chat_prompt(state, chat, read_tools(chat))
    if is_pml_prompt(text):
        raise APIError(400, "a Prompt Cache conversation is laid out by the engine: not tokenized here")
    if req.add_special_tokens is not False:  # as the chat's prompt is encoded: one BOS at most
        return encode_prompt(tok, text)
    return list(tok.encode(text, add_special_tokens=False))


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    """The tokenizer's special tokens, class, length limit and chat template."""
    tok = _tokenizer(state)
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for name in INFO_FIELDS:
        value = getattr(tok, name, None)
        if isinstance(value, (str, int, float, bool)) or value is None:
            info[name] = value
    if isinstance(info.get("model_max_length"), (int, float)) and info["model_max_length"] > 1e12:
        info["model_max_length"] = state.max_model_len  # HF's "no limit" sentinel
    template = getattr(tok, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    return info


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        authorize(state, request)
        body = await read_json(state, request)
        required = "messages" if isinstance(body, dict) and body.get("messages") is not None else "prompt"
        req: TokenizeRequest = parse_request(TokenizeRequest, body, required)
        check_model(state, req.model)  # as the generation routes: a 404 for another model
        ids = await asyncio.to_thread(_encode, state, req, body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        out["token_strs"] = _tokenizer(state).convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        authorize(state, request)
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await read_json(state, request), "tokens")
        check_model(state, req.model)
        tok = _tokenizer(state)
        vocab = len(tok)
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": await asyncio.to_thread(tok.decode, req.tokens)})

    @app.get("/tokenizer_info")
    async def info(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse(tokenizer_info(state))


__all__ = ["TOKENIZER_ROUTES", "add_tokenizer_routes", "tokenizer_info"]

TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")
