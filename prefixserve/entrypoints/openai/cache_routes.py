"""``POST /reset_prefix_cache``: forget the automatic prefix cache on a running server (vLLM's route;
its path and answer: ``protocols/vllm/cache_reset.py``).

For benchmarks that must start cold, and for operators who want cached prompts gone. It runs on the
engine between two steps (``Engine.reset_prefix_cache``); pinned system prompts and Prompt Cache
modules stay, and so do the blocks of requests still running, which the answer's ``reset: false``
says (call it again once they have finished).
"""

from __future__ import annotations

import operator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.openai.requests import ServerState, authorize
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.vllm.cache_reset import RESET_ROUTE, reset_body
from prefixserve.serving.engine_thread import EngineStopped


def add_cache_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(RESET_ROUTE)
    async def reset_prefix_cache(request: Request) -> Response:
        authorize(state, request)
        try:
            reset = await state.loop.run(operator.methodcaller("reset_prefix_cache"))
        except EngineStopped as exc:
            raise APIError(503, str(exc)) from None
        return JSONResponse(reset_body(bool(reset)))


__all__ = ["add_cache_routes"]
