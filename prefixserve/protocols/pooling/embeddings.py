"""OpenAI's Embeddings API (``POST /v1/embeddings``, routed in ``entrypoints/openai/embedding_routes.py``;
batch files' ``/v1/embeddings`` rows) over the engine's pooling (``engine/pooling.py``).

Each input is one engine request that computes its prompt and no completion; its answer is the
pooled final hidden states ("last" token by default, as vLLM pools decoder models; ``pooling``:
"mean"), L2-normalized unless ``normalize`` is false. Inputs sharing a prefix (an instruction in
front of every passage) compute it once, through the prefix cache, as completions do. The body takes
OpenAI's fields (``input``: a string, strings, token ids or lists of them; ``encoding_format``
"float" or "base64"; ``dimensions``) and vLLM's extensions (``truncate_prompt_tokens``,
``normalize``, ``add_special_tokens``, ``priority``, ``request_id``, ``cache_salt``) plus the
server's ``application`` (a pinned system prompt in front of every input).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from prefixserve.engine.pooling import embedding_request
from prefixserve.outputs import RequestOutput
from prefixserve.pooling_params import PoolingParams
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.ids import answer_id
from prefixserve.protocols.openai.prepare import (
    OpenAIContext,
    Prepared,
    application_prompt,
    chat_prompt,
    check_model,
)
from prefixserve.protocols.openai.request_models import (
    ChatCompletionRequest,
    normalize_prompts,
    parse_request,
)

EMBEDDINGS_ROUTE = "/v1/embeddings"


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body, with vLLM's extensions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: Any = None  # str | list[str] | list[int] | list[list[int]] (``normalize_prompts``)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # extensions
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    application: str | None = None

    @property
    def stream(self) -> bool:  # what answering reads of a generating request: embeddings never stream
        return False

    @property
    def module_recompute(self) -> None:
        return None


@dataclass(slots=True)
class EmbeddingCall:
    """A checked /v1/embeddings request: the engine requests to queue (``prep``), and its answer."""

    ctx: OpenAIContext
    prep: Prepared

    def body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return embedding_body(self.ctx, self.prep, finals)


# vLLM's chat embeddings: ``messages`` in place of ``input``, rendered as a chat is (no generation
# prompt unless asked), embedded as one prompt
CHAT_FIELDS = (
    "messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "application",
)  # fmt: skip


def _chat_input(ctx: OpenAIContext, data: dict[str, Any]) -> tuple[str, str | None]:
    """A chat body's one prompt and the application its text opens with (``chat_prompt``)."""
    body = {"add_generation_prompt": False, **{k: data[k] for k in CHAT_FIELDS if k in data}}
    text, application = chat_prompt(ctx, parse_request(ChatCompletionRequest, body, "messages"))
    if is_pml_prompt(text):
        raise APIError(400, "embeddings are not available for PML (Prompt Cache) prompts", param="messages")
    return text, application


def prepare_embedding(ctx: OpenAIContext, data: Any) -> EmbeddingCall:
    """Check a /v1/embeddings body; one engine request per input (a chat's ``messages``: one)."""
    chat = isinstance(data, dict) and data.get("input") is None and data.get("messages") is not None
    field = "messages" if chat else "input"
    req: EmbeddingRequest = parse_request(EmbeddingRequest, data, field)
    check_model(ctx, req.model)
    application = req.application
    if chat:
        text, application = _chat_input(ctx, data)
        prompts: list[str | list[int]] = [text]
    else:
        prompts = normalize_prompts(req.input, "input")
    size = ctx.hidden_size
    if req.dimensions is not None and size is not None and req.dimensions != size:  # None: a router
        message = (
            f"this model's embeddings have {size} dimensions and it is not trained for shortened "
            f"ones (Matryoshka): dimensions must be {size} or left out, got {req.dimensions}"
        )
        raise APIError(400, message, param="dimensions", code="invalid_value")
    try:
        pooling = PoolingParams(req.pooling, req.normalize, req.truncate_prompt_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), param="truncate_prompt_tokens", code="invalid_value") from None
    if req.application is not None and not chat:
        application_prompt(ctx, req.application)  # a 400 naming an unknown application
    params = embedding_request(pooling, None, None)  # what the fit and truncation checks read
    rid = answer_id("embd", req.request_id)
    prep = Prepared(
        False, rid, req, prompts, params, False,  # type: ignore[arg-type]
        application=application, pooling=pooling, input_field=field,
    )  # fmt: skip
    return EmbeddingCall(ctx, prep)


def pooled_vectors(finals: list[RequestOutput]) -> list[list[float]]:
    """Each final output's embedding; a 500 where one ended without it (aborted by a failed step)."""
    if any(out.embedding is None for out in finals):
        raise APIError(500, "the engine failed while computing an embedding", code="engine_error")
    return [out.embedding for out in finals]  # type: ignore[misc]


def embedding_body(ctx: OpenAIContext, prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's answer: one ``embedding`` object per input, in input order, and the prompt tokens."""
    req: EmbeddingRequest = prep.req  # type: ignore[assignment]
    data = []
    for index, vector in enumerate(pooled_vectors(finals)):
        if req.encoding_format == "base64":  # little-endian fp32, as OpenAI's clients decode it
            encoded = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        else:
            data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(out.num_prompt_tokens for out in finals)
    cached = sum(out.num_cached_tokens for out in finals)  # what the prefix cache saved (vLLM's field)
    return {
        "id": prep.rid,
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model,
        "data": data,
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


__all__ = [
    "EMBEDDINGS_ROUTE",
    "EmbeddingCall",
    "EmbeddingRequest",
    "embedding_body",
    "pooled_vectors",
    "prepare_embedding",
]
