"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, as vLLM serves them.

The bodies and their checks are ``protocols/vllm/tokenizer.py``'s. Encoding runs in a worker thread
(the tokenizer releases the GIL), never on the engine thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_json
from prefixserve.protocols.openai.prepare import check_model
from prefixserve.protocols.openai.request_models import parse_request
from prefixserve.protocols.vllm.tokenizer import (
    DetokenizeRequest,
    TokenizeRequest,
    check_detokenize,
    tokenize_ids,
    tokenizer_info,
    tokenizer_of,
)


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        authorize(state, request)
        body = await read_json(state, request)
        required = "messages" if isinstance(body, dict) and body.get("messages") is not None else "prompt"
        req: TokenizeRequest = parse_request(TokenizeRequest, body, required)
        check_model(state, req.model)  # as the generation routes: a 404 for another model
        ids = await asyncio.to_thread(tokenize_ids, state, req, body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        out["token_strs"] = tokenizer_of(state).convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        authorize(state, request)
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await read_json(state, request), "tokens")
        check_model(state, req.model)
        check_detokenize(state, req)
        return JSONResponse({"prompt": await asyncio.to_thread(tokenizer_of(state).decode, req.tokens)})

    @app.get("/tokenizer_info")
    async def info(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse(tokenizer_info(state, state.max_model_len))


__all__ = ["add_tokenizer_routes"]
