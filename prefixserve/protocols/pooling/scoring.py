"""vLLM's scoring APIs over the embeddings: ``POST /score`` (and ``/v1/score``) and ``POST /rerank``
(and ``/v1/rerank``, ``/v2/rerank``: Jina's and Cohere's shape), routed in
``entrypoints/openai/embedding_routes.py``.

A pair's score is the cosine similarity of its two texts' embeddings (the dot product of the
normalized vectors; last-token pooling unless ``pooling`` says "mean"): what vLLM answers for an
embedding model, a bi-encoder, not a cross-encoder's judgement of the pair read together. Each
distinct text is embedded once, as one engine request through the same path as /v1/embeddings
(checks, overload, prefix sharing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from prefixserve.outputs import RequestOutput
from prefixserve.pooling_params import score_pairs
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.ids import answer_id
from prefixserve.protocols.openai.prepare import OpenAIContext, Prepared
from prefixserve.protocols.openai.request_models import MAX_PROMPTS, parse_request
from prefixserve.protocols.pooling.embeddings import pooled_vectors, prepare_embedding

SCORE_ROUTES = ("/score", "/v1/score")
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")


class _Scoring(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    pooling: Literal["last", "mean"] = "last"
    priority: int = 0
    request_id: str | None = None


class ScoreRequest(_Scoring):
    """vLLM's /score body: ``text_1`` against ``text_2``, one to many or pair by pair."""

    text_1: Any = None  # str | list[str]
    text_2: Any = None


class RerankRequest(_Scoring):
    """Jina's and Cohere's /rerank body: the ``documents`` ranked against the ``query``."""

    query: Any = None  # str
    documents: Any = None  # list[str | {"text": str}]
    top_n: int | None = None
    return_documents: bool = True


def _texts(value: Any, field: str) -> list[str]:
    """A field that takes one text or a non-empty list of them, as a list."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) and t for t in items):
        raise APIError(400, f"'{field}' must be a non-empty text or a non-empty list of them", param=field)
    return items


@dataclass(slots=True)
class ScoreCall:
    """Checked scoring: the distinct texts to embed (``prep``), the pairs to score (indices into
    them), and how to answer (a score list, or a ranking when ``rerank`` is given)."""

    ctx: OpenAIContext
    prep: Prepared
    pairs: list[tuple[int, int]]
    rerank: RerankRequest | None = None
    documents: list[str] | None = None

    def body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        unit = np.asarray(pooled_vectors(finals), dtype=np.float64)  # normalized: a dot is the cosine
        scores = [float(unit[a] @ unit[b]) for a, b in self.pairs]
        tokens = sum(out.num_prompt_tokens for out in finals)
        if self.rerank is None:
            return {
                "id": self.prep.rid,
                "object": "list",
                "created": int(time.time()),
                "model": self.ctx.model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: self.rerank.top_n or len(scores)]
        results = []
        for i in ranked:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if self.rerank.return_documents and self.documents is not None:
                result["document"] = {"text": self.documents[i]}
            results.append(result)
        return {
            "id": self.prep.rid,
            "model": self.ctx.model,
            "usage": {"total_tokens": tokens},
            "results": results,
        }


def _call(
    ctx: OpenAIContext, req: _Scoring, texts: list[str], pairs: list[tuple[int, int]], field: str
) -> ScoreCall:
    """The embeddings of ``texts`` (each distinct one once), checked as /v1/embeddings checks them."""
    distinct = list(dict.fromkeys(texts))
    at = {t: i for i, t in enumerate(distinct)}
    body = {
        "model": req.model,
        "input": distinct,
        "pooling": req.pooling,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "priority": req.priority,
        "request_id": req.request_id,
    }
    try:
        prep = prepare_embedding(ctx, {k: v for k, v in body.items() if v is not None}).prep
    except APIError as exc:
        if exc.param == "input":
            exc.param = field
        raise
    prep.input_field = field  # a prompt the engine refuses is named by the scoring request's field
    prep.rid = answer_id("rerank" if isinstance(req, RerankRequest) else "score", req.request_id)
    return ScoreCall(ctx, prep, [(at[texts[a]], at[texts[b]]) for a, b in pairs])


def prepare_score(ctx: OpenAIContext, data: Any) -> ScoreCall:
    """Check a /score body: ``text_1`` (one text, or as many as ``text_2``) against ``text_2``."""
    req: ScoreRequest = parse_request(ScoreRequest, data, "text_1")
    first, second = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
    try:
        pairs = score_pairs(len(first), len(second))
    except ValueError as exc:
        raise APIError(400, str(exc), param="text_2") from None
    if len(pairs) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} pairs per request, got {len(pairs)}", param="text_2")
    texts = first + second
    return _call(ctx, req, texts, [(a, len(first) + b) for a, b in pairs], "text_2")


def prepare_rerank(ctx: OpenAIContext, data: Any) -> ScoreCall:
    """Check a /rerank body: each of ``documents`` scored against ``query``, best first."""
    req: RerankRequest = parse_request(RerankRequest, data, "query")
    if not isinstance(req.query, str) or not req.query:
        raise APIError(400, "'query' must be a non-empty text", param="query")
    raw = req.documents if isinstance(req.documents, list) else None
    docs = [d.get("text") if isinstance(d, dict) else d for d in raw or ()]
    docs = _texts(docs if raw else None, "documents")
    if len(docs) > MAX_PROMPTS - 1:
        raise APIError(
            400, f"at most {MAX_PROMPTS - 1} documents per request, got {len(docs)}", param="documents"
        )
    if req.top_n is not None and req.top_n < 1:
        raise APIError(400, f"top_n must be at least 1, got {req.top_n}", param="top_n")
    call = _call(ctx, req, [req.query, *docs], [(0, 1 + i) for i in range(len(docs))], "documents")
    call.rerank, call.documents = req, docs
    return call


__all__ = ["RERANK_ROUTES", "SCORE_ROUTES", "ScoreCall", "prepare_rerank", "prepare_score"]
