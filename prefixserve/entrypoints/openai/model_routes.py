"""``GET /v1/models`` and ``/v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.openai.prepare import check_model
from prefixserve.entrypoints.openai.requests import ServerState, authorize


def add_model_routes(app: FastAPI, state: ServerState) -> None:
    def model_card() -> dict[str, Any]:
        return {
            "id": state.model,
            "object": "model",
            "created": 0,
            "owned_by": "prefixserve",
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        authorize(state, request)
        check_model(state, model_id)
        return JSONResponse(model_card())


__all__ = ["add_model_routes"]
