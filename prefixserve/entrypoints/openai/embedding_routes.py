"""``POST /v1/embeddings`` (``protocols/pooling/embeddings.py`` checks the body and shapes the answer)
and the scoring routes over it, ``/score`` and ``/rerank`` (``protocols/pooling/scoring.py``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from prefixserve.entrypoints.openai.answering import answer, route_start
from prefixserve.entrypoints.openai.overload_http import queue_deadline
from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_named_json
from prefixserve.protocols.pooling.embeddings import EMBEDDINGS_ROUTE, prepare_embedding
from prefixserve.protocols.pooling.scoring import RERANK_ROUTES, SCORE_ROUTES, prepare_rerank, prepare_score


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(EMBEDDINGS_ROUTE)
    async def embeddings(request: Request) -> Response:
        started = route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        call = prepare_embedding(state, await read_named_json(state, request))
        return await answer(state, request, call.prep, deadline, started, body=call.body)

    async def scored(request: Request) -> Response:
        started = route_start(request)
        authorize(state, request)
        deadline = queue_deadline(request, state.max_queue_delay, started)
        prepare = prepare_score if request.url.path in SCORE_ROUTES else prepare_rerank
        call = prepare(state, await read_named_json(state, request))
        return await answer(state, request, call.prep, deadline, started, body=call.body)

    for path in (*SCORE_ROUTES, *RERANK_ROUTES):
        app.add_api_route(path, scored, methods=["POST"])


__all__ = ["add_embedding_routes"]
