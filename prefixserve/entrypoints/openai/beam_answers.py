"""Completions and chats with vLLM's ``use_beam_search``: the search's steps as engine requests.

The search is ``sampling/beam_search.py``'s; here each step's beams are queued as the server queues
any request (``answering.submit``: overload gate, priority, cache salt, application) and collected,
and the best beams become one final output per prompt, answered by the same formatting as sampled
ones (``n`` is the beam width). A stream sends the whole answer when the search ends, as vLLM's does.
Fields that change how tokens are sampled have no meaning for the search and are refused by name.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.input_processor import check_context
from prefixserve.entrypoints.openai.answering import collect, stream_events, submit
from prefixserve.entrypoints.openai.overload_http import sse_response
from prefixserve.entrypoints.openai.requests import ServerState, request_tenant
from prefixserve.outputs import RequestOutput
from prefixserve.protocols.errors import APIError, param_of
from prefixserve.protocols.openai.prepare import Prepared, prompt_ids, response_body, stream_state, truncated
from prefixserve.sampling.beam_search import (
    MAX_BEAM_WIDTH,
    BeamSearch,
    BeamSearchParams,
    as_completion,
    top_candidates,
    with_text,
)

_WHAT = "does not apply to beam search (use_beam_search), which ranks outputs by their logprobs"


def _structured_field(prep: Prepared) -> str:
    req = prep.req
    for name in ("response_format", "structured_outputs"):
        if getattr(req, name, None) is not None:
            return name
    return (
        "tool_choice"
        if prep.chat and getattr(req, "tool_choice", None) not in (None, "auto", "none")
        else "guided_json"
    )


def beam_search_params(prep: Prepared) -> BeamSearchParams:
    """The request's search, or a 400 naming the first field the search cannot honour."""
    req, p = prep.req, prep.params
    refused = (
        ("temperature", req.temperature not in (None, 0)),
        ("top_p", p.top_p < 1.0),
        ("top_k", p.top_k > 0),
        ("min_p", p.min_p > 0.0),
        ("presence_penalty", p.presence_penalty != 0.0),
        ("frequency_penalty", p.frequency_penalty != 0.0),
        ("repetition_penalty", p.repetition_penalty != 1.0),
        ("logit_bias", bool(p.logit_bias)),
        ("allowed_token_ids", p.allowed_token_ids is not None),
        ("bad_words", bool(p.bad_words)),
        ("min_tokens", p.min_tokens > 0),
        ("stop", bool(p.stop)),
        ("best_of", p.best_of not in (None, p.n)),
        ("thinking_token_budget", p.thinking_token_budget is not None),
        (_structured_field(prep), p.structured_outputs is not None),
    )
    for name, bad in refused:
        if bad:
            raise APIError(400, f"{name} {_WHAT}", param=name, code="invalid_value")
    if prep.no_completion:
        raise APIError(400, "max_tokens must be at least 1 with beam search", param="max_tokens")
    if p.n > MAX_BEAM_WIDTH:
        message = f"n is the beam width with use_beam_search and must be at most {MAX_BEAM_WIDTH}, got {p.n}"
        raise APIError(400, message, param="n", code="invalid_value")
    penalty = getattr(req, "length_penalty", None)
    try:
        return BeamSearchParams(
            beam_width=p.n,
            max_tokens=p.max_tokens,
            ignore_eos=p.ignore_eos,
            length_penalty=1.0 if penalty is None else penalty,
            include_stop_str_in_output=p.include_stop_str_in_output,
            stop_token_ids=list(p.stop_token_ids),
            skip_special_tokens=p.skip_special_tokens,
            logprobs=p.logprobs,
        )
    except ValueError as exc:
        param, code = param_of(str(exc), prep.prompt_field)
        raise APIError(400, str(exc), param=param, code=code) from None


def _prompt_ids(
    state: ServerState, prep: Prepared, max_tokens: int | None
) -> tuple[list[list[int]], list[int], list[str | None]]:
    """Each prompt's ids as the server would queue them (``truncate_prompt_tokens`` applied), the
    most tokens its outputs may have (a 400 where the context, after the application's pinned
    prompt, cannot hold the prompt and ``max_tokens``), and its text where it was kept whole (what
    echo answers: else the kept ids' text)."""
    ids, rooms, texts = [], [], []
    for prompt in prep.prompts:
        tokens = prompt_ids(state, prep, prompt)
        if tokens is None:
            raise APIError(
                400,
                "beam search takes plain prompts, not Prompt Cache (PML) prompts",
                param=prep.prompt_field,
            )
        kept = truncated(prep, tokens, state.max_model_len)
        texts.append(prompt if isinstance(prompt, str) and len(kept) == len(tokens) else None)
        tokens = kept
        used = len(state.engine_ids(tokens, prep.application))
        try:
            check_context(used, max_tokens, state.max_model_len)
        except ValueError as exc:
            param, code = param_of(str(exc), prep.prompt_field)
            raise APIError(400, str(exc), param=param, code=code) from None
        ids.append(tokens)
        rooms.append(max_tokens or state.max_model_len - used)
    return ids, rooms, texts


async def _search(
    state: ServerState,
    request: Request,
    prep: Prepared,
    params: BeamSearchParams,
    deadline: float | None,
    started: float,
) -> list[RequestOutput] | None:
    """Run the search; one final output per prompt (its best beams), or None if the client left."""
    prompts, rooms, texts = await asyncio.to_thread(_prompt_ids, state, prep, params.max_tokens)
    search = BeamSearch(prompts, params, state.eos_ids, rooms)
    step = params.step_params()
    firsts: list[RequestOutput] = []  # each prompt's first step: its prompt's counts and logprobs
    while not search.done:
        pending = search.pending()
        first = not firsts
        if not first and await request.is_disconnected():  # a step takes less than collect's poll
            return None
        # the prompt's own logprobs (echo, prompt_logprobs) come with the first step
        step_params = replace(step, prompt_logprobs=prep.params.prompt_logprobs) if first else step
        beams = replace(prep, prompts=[tokens for _, tokens in pending], params=step_params)
        sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
        ids = await submit(
            state, beams, sink, deadline if first else None, started if first else None, progress=False,
            tenant=request_tenant(request, prep.req),
        )  # fmt: skip
        finals = await collect(state, request.is_disconnected, ids, sink)
        if finals is None:
            return None
        if first:
            firsts = finals
        search.advance([top_candidates(out) for out in finals])
    outputs = []
    for i, best in enumerate(search.results()):
        with_text(best, state.tokenizer, params)
        completions = [as_completion(beam, rank, params.logprobs) for rank, beam in enumerate(best)]
        head = firsts[i]
        outputs.append(
            RequestOutput(
                f"{prep.rid}-{i}",
                texts[i],
                head.stored_prompt_token_ids,
                completions,
                True,
                num_cached_tokens=head.num_cached_tokens,
                prompt_token_logprobs=head.prompt_token_logprobs,
                prompt_top_logprobs=head.prompt_top_logprobs,
                prompt_logprob_ranks=head.prompt_logprob_ranks,
            )
        )
    return outputs


async def answer_beams(
    state: ServerState, request: Request, prep: Prepared, deadline: float | None, started: float
) -> Response:
    """Answer a completion or chat with ``use_beam_search``: its ``n`` best beams as its choices."""
    params = beam_search_params(prep)
    finals = await _search(state, request, prep, params, deadline, started)
    if finals is None:
        return Response(status_code=499)
    if not prep.req.stream:
        return JSONResponse(response_body(state, prep, finals))
    ids = [out.request_id for out in finals]
    events = stream_events(
        state, ids, asyncio.Queue(), stream_state(state, prep), first=dict(zip(ids, finals, strict=True))
    )
    return sse_response(events, [], state.stall_watch)
