"""``GET /v1/models`` and ``/v1/models/{id}``: the one model this server serves, a card per name it is
served under (``--served-model-name``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.entrypoints.openai.requests import ServerState, authorize
from prefixserve.protocols.openai.prepare import check_model


def add_model_routes(app: FastAPI, state: ServerState) -> None:
    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "prefixserve",
            "root": state.model,
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(state, request)
        cards = [model_card(name) for name in (state.model, *state.aliases)]  # one per served name
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        authorize(state, request)
        check_model(state, model_id)
        return JSONResponse(model_card(state.model if model_id == "default" else model_id))


__all__ = ["add_model_routes"]
