"""Offline batch jobs (BatchLLM): plan the whole input, run it group by group, answer as rows finish.

``submit_grouped`` queues every request of a batch at once, unscheduled, plans prefix-sharing groups
over their final token ids (``scheduler.offline``) and hands the groups to the scheduler in run
order. ``run_rows`` does that for OpenAI Batch rows and yields each row's output line as soon as all
of its engine requests are done; ``run_batch_file`` adds the file, resume and a progress bar.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixserve.engine.prompt_tokens import encode_prompt
from prefixserve.entrypoints.batch_file import (
    EMBEDDINGS_URL,
    MESSAGES_URL,
    RERANK_URL,
    RESPONSES_URL,
    SCORE_URL,
    BadRow,
    BatchRow,
    ResultWriter,
    error_row,
    finished_keys,
    read_batch,
    result_row,
    row_key,
)
from prefixserve.entrypoints.generation_config import sampling_defaults
from prefixserve.outputs import RequestOutput
from prefixserve.pooling_params import PoolingParams
from prefixserve.protocols.anthropic.prepare import MessageCall, error_body, prepare_message
from prefixserve.protocols.errors import APIError, engine_failure, param_of
from prefixserve.protocols.openai.prepare import (
    OpenAIContext,
    Prepared,
    prepare,
    prompt_ids,
    response_body,
    truncated,
)
from prefixserve.protocols.openai.salt_scope import public_tokens
from prefixserve.protocols.pooling.embeddings import EmbeddingCall, prepare_embedding
from prefixserve.protocols.pooling.scoring import ScoreCall, prepare_rerank, prepare_score
from prefixserve.protocols.responses.prepare import ResponseCall, prepare_response
from prefixserve.protocols.responses.request import renamed
from prefixserve.sampling.params import SamplingParams
from prefixserve.scheduler.batch_queue import DEFAULT_DECODE, queue_groups
from prefixserve.scheduler.offline import BatchPlan, plan_batch, shard_groups


@dataclass(slots=True)
class RequestSpec:
    """One engine request of a batch, before it is queued."""

    request_id: str
    prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: list[int] | None = None
    cache_salt: str | None = None
    application: str | None = None
    module_recompute: str | None = None  # Prompt Cache recovery, as the request's body sets it
    priority: int = 0  # the engine's priority policy's (refused under fcfs, as the server does)
    pooling: PoolingParams | None = None  # an embedding row's (``params`` are then the engine's)
    public_tokens: int = 0  # with a salt: the prompt's public tokens under its scope (docs/guides/tenants.md)
    tenant: str | None = None  # the row's user: its share under the fair policy


def submit_grouped(
    engine: Any, specs: Sequence[RequestSpec], grouping: str = "first_level"
) -> tuple[list[ValueError | None], BatchPlan]:
    """Queue ``specs`` as prefix-sharing groups; per spec, the ValueError that refused it (or None)."""
    errors: list[ValueError | None] = []
    queued = []
    for spec in specs:
        try:
            req = engine.add_request(
                spec.request_id,
                spec.prompt,
                spec.params if spec.pooling is None else None,
                prompt_token_ids=spec.prompt_token_ids,
                cache_salt=spec.cache_salt,
                application=spec.application,
                module_recompute=spec.module_recompute,
                priority=spec.priority,
                queue=False,
                pooling=spec.pooling,
                public_tokens=spec.public_tokens,
                tenant=spec.tenant,
            )
        except ValueError as exc:
            errors.append(exc)
            continue
        errors.append(None)
        queued.append(req)
    return errors, queue_groups(engine, queued, grouping)


class BatchProgress:
    """A progress bar: rows done, generated tokens/s, and the prompt-token saving so far (Eq. 1)."""

    def __init__(self, total: int, enabled: bool, initial: int = 0) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="row", disable=not enabled, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.generated = self.prompt_tokens = self.cached_tokens = 0

    def request_done(self, out: RequestOutput) -> None:
        self.generated += sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens += out.num_prompt_tokens
        self.cached_tokens += out.num_cached_tokens

    @property
    def saving(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def rows_done(self, count: int = 1) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tok_s = f"{self.generated / elapsed:.0f}"
        self.bar.set_postfix(tok_s=tok_s, saving=f"{self.saving:.1%}", refresh=False)
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()


@dataclass(slots=True)
class _RowState:
    row: BatchRow
    prep: Prepared
    ids: list[str]
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    call: Call | None = None  # a row of another API than completions and chats


Call = ResponseCall | MessageCall | EmbeddingCall | ScoreCall  # another API's answer to a row's work


def prepare_row(ctx: OpenAIContext, row: BatchRow) -> tuple[Prepared, Call | None]:
    """A row's body checked as the server checks its route's (APIError where it would refuse it);
    a row of another API than completions and chats also gives the answer it gets in that API."""
    for name in ("stream", "background", "use_beam_search"):  # rows are run as sampled ones
        if row.body.get(name):
            raise APIError(400, f"{name} is not supported in a batch", param=name)
    call: Call
    if row.url == RESPONSES_URL:
        call = prepare_response(ctx, row.body, None)  # a batch stores nothing: no previous_response_id
    elif row.url == MESSAGES_URL:
        call = prepare_message(ctx, row.body)
    elif row.url == EMBEDDINGS_URL:
        call = prepare_embedding(ctx, row.body)
    elif row.url in (SCORE_URL, RERANK_URL):
        call = (prepare_score if row.url == SCORE_URL else prepare_rerank)(ctx, row.body)
    else:
        return prepare(ctx, row.url, row.body), None
    return call.prep, call


def row_error(row: BatchRow, exc: APIError) -> dict[str, Any]:
    """A refused row's output line: the error body its route answers, in its API's shape."""
    if row.url == RESPONSES_URL:
        body = renamed(exc).body()
    elif row.url == MESSAGES_URL:
        body = error_body(exc.status, f"{exc.param}: {exc.message}" if exc.param else exc.message)
    else:
        body = exc.body()
    return result_row(row.custom_id, exc.status, body)


def row_answer(
    ctx: OpenAIContext, row: BatchRow, prep: Prepared, call: Call | None, finals: list[RequestOutput]
) -> dict[str, Any]:
    """A row's output line from its engine requests' final outputs, as its route would answer."""
    error = engine_failure(finals)
    if error is not None:
        return row_error(row, error)
    try:
        body = response_body(ctx, prep, finals) if call is None else call.body(finals)
    except APIError as exc:  # an answer its route would refuse (an embedding that never came)
        return row_error(row, exc)
    return result_row(row.custom_id, 200, body)


def _prepare_rows(
    ctx: OpenAIContext, rows: Sequence[BatchRow]
) -> tuple[list[_RowState], list[dict[str, Any]]]:
    """Check each row's body as the server would; bodies it would refuse become 4xx rows now."""
    states, answered = [], []
    for row in rows:
        try:
            prep, call = prepare_row(ctx, row)
        except APIError as exc:
            answered.append(row_error(row, exc))
            continue
        ids = [f"batch-{row.line}-{i}" for i in range(len(prep.prompts))]
        states.append(_RowState(row, prep, ids, call=call))
    return states, answered


def run_rows(
    engine: Any,
    rows: Sequence[BatchRow],
    grouping: str = "first_level",
    on_request: Callable[[RequestOutput], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Run OpenAI Batch rows on ``engine`` grouped by shared prefix; yield each output line when ready."""
    ctx = OpenAIContext(
        model=engine.model_name,
        tokenizer=engine.tokenizer,
        system_prompts=dict(engine.config.system_prompts),
        aliases=engine.config.served_model_name[1:],
        reasoning_parser=engine.config.reasoning_parser,
        trust_request_chat_template=engine.config.trust_request_chat_template,
        cache_salt_scope=engine.config.cache_salt_scope,
        hidden_size=engine.model_config.hidden_size,
        sampling_defaults=sampling_defaults(engine.config),
    )
    states, answered = _prepare_rows(ctx, rows)
    yield from answered
    specs = []
    for st in states:
        req = st.prep.req
        for rid, prompt in zip(st.ids, st.prep.prompts, strict=True):
            text = prompt if isinstance(prompt, str) else None
            tokens = prompt_ids(ctx, st.prep, prompt)  # as the server encodes it (add_special_tokens)
            ids = None if tokens is None else ctx.engine_ids(tokens, st.prep.application)
            public = 0 if ids is None else public_tokens(ctx, st.prep, ids)
            specs.append(
                RequestSpec(
                    rid,
                    text,
                    st.prep.params,
                    tokens,
                    req.cache_salt,
                    st.prep.application,
                    req.module_recompute,
                    req.priority,
                    st.prep.pooling,
                    public,
                    getattr(req, "user", None),
                )
            )
    errors, _ = submit_grouped(engine, specs, grouping)
    refused = {spec.request_id: err for spec, err in zip(specs, errors, strict=True) if err is not None}
    owner: dict[str, _RowState] = {}
    for st in states:
        failed = next((refused[i] for i in st.ids if i in refused), None)
        if failed is None:
            owner.update((i, st) for i in st.ids)
            continue
        for i in st.ids:  # the server refuses the whole request: so does the batch
            if i not in refused:
                engine.abort(i, report=False)
        param, code = param_of(str(failed), st.prep.prompt_field)
        error = APIError(400, str(failed), param=param, code=code)
        yield row_error(st.row, error)
    while owner:
        for out in engine.step():
            st = owner.get(out.request_id)
            if st is None or not out.finished:
                continue
            del owner[out.request_id]
            if on_request is not None:
                on_request(out)
            st.finals[out.request_id] = out
            if len(st.finals) == len(st.ids):
                yield row_answer(ctx, st.row, st.prep, st.call, [st.finals[i] for i in st.ids])


def pending_rows(path_in: str | Path, path_out: str | Path) -> tuple[list[BatchRow | BadRow], int]:
    """Input rows not yet answered in ``path_out`` (its torn tail cut off), and how many are."""
    rows = read_batch(path_in)
    done = finished_keys(path_out)
    todo = [r for r in rows if row_key(r) not in done]
    return todo, len(rows) - len(todo)


def run_batch_file(
    engine: Any,
    path_in: str | Path,
    path_out: str | Path,
    grouping: str = "first_level",
    progress: bool = True,
) -> dict[str, Any]:
    """Answer every row of an OpenAI Batch input file into ``path_out``; resumes where it stopped."""
    todo, skipped = pending_rows(path_in, path_out)
    bar = BatchProgress(len(todo) + skipped, progress, initial=skipped)
    written = errors = 0
    with ResultWriter(path_out) as writer:
        for bad in (r for r in todo if isinstance(r, BadRow)):
            writer.write(error_row(bad))
            written += 1
            errors += 1
            bar.rows_done()
        good = [r for r in todo if isinstance(r, BatchRow)]
        for row in run_rows(engine, good, grouping, on_request=bar.request_done):
            writer.write(row)
            written += 1
            errors += row["response"] is None or row["response"]["status_code"] != 200
            bar.rows_done()
    bar.close()
    return {
        "rows_written": written,
        "rows_skipped": skipped,
        "error_rows": errors,
        "prompt_saving": round(bar.saving, 4),
    }


# ---- planning without the model: --analyze and sharding over replicas ------------------------------
@dataclass(slots=True)
class RowPlan:
    """Rows checked and tokenized as the engine would see them, and the batch's group plan over them."""

    states: list[_RowState]  # rows that will run, in input order
    answered: list[dict[str, Any]]  # rows whose bodies the server would refuse (4xx lines)
    plan: BatchPlan  # over every prompt of every running row
    row_of_request: list[int]  # plan member index -> index into ``states``


def plan_rows(
    tokenizer: Any,
    model_name: str,
    system_prompts: dict[str, str],
    rows: Sequence[BatchRow],
    grouping: str = "first_level",
) -> RowPlan:
    """Check and tokenize every row (an application's pinned prompt put first, as the engine does)
    and plan prefix-sharing groups over all their prompts, without loading the model."""
    ctx = OpenAIContext(model=model_name, tokenizer=tokenizer, system_prompts=dict(system_prompts))
    return _plan(ctx, rows, grouping)


def run_order(ctx: OpenAIContext, rows: Sequence[BatchRow], grouping: str = "first_level") -> list[BatchRow]:
    """``rows`` in the order a plan runs them: those whose prompts share a prefix next to each other,
    groups in the plan's order; rows the server would refuse first (they are answered at once)."""
    planned = _plan(ctx, rows, grouping)
    order: dict[int, BatchRow] = {}  # by id(): a dict keeps first-seen order
    running = {id(st.row) for st in planned.states}
    for row in rows:
        if id(row) not in running:
            order[id(row)] = row
    for group in planned.plan.groups:
        for member in group.members:
            row = planned.states[planned.row_of_request[member]].row
            order.setdefault(id(row), row)
    return list(order.values())


def _plan(ctx: OpenAIContext, rows: Sequence[BatchRow], grouping: str) -> RowPlan:
    tokenizer = ctx.tokenizer
    states, answered = _prepare_rows(ctx, rows)
    prompts, salts, decode, row_of = [], [], [], []
    for k, st in enumerate(states):
        for p in st.prep.prompts:
            ids = prompt_ids(ctx, st.prep, p)
            if ids is None:  # a Prompt Cache document: planned on its text's tokens
                ids = encode_prompt(tokenizer, p) if tokenizer is not None else []
            prompts.append(ctx.engine_ids(truncated(st.prep, ids, None), st.prep.application))
            salts.append(st.prep.req.cache_salt)
            decode.append(st.prep.params.max_tokens or DEFAULT_DECODE)
            row_of.append(k)
    return RowPlan(states, answered, plan_batch(prompts, salts, decode, grouping), row_of)


def analyze_batch_file(
    tokenizer: Any,
    model_name: str,
    system_prompts: dict[str, str],
    path_in: str | Path,
    grouping: str = "first_level",
    block_size: int = 16,
) -> dict[str, Any]:
    """What ``prefixserve batch --analyze`` prints: the token saving (Eq. 1) of the full prefix tree,
    of the best one-level grouping and of the plan, the groups' sizes, and the KV the plan holds."""
    rows = read_batch(path_in)
    good = [r for r in rows if isinstance(r, BatchRow)]
    planned = plan_rows(tokenizer, model_name, system_prompts, good, grouping)
    report = planned.plan.analysis.to_dict(block_size)
    report.update(
        grouping=grouping,
        rows=len(rows),
        unreadable_rows=len(rows) - len(good),
        refused_rows=len(planned.answered),
    )
    return report


def shard_rows(planned: RowPlan, num_shards: int) -> list[list[BatchRow]]:
    """Rows split over replicas by prefix-sharing group, balanced by prefill tokens; a group never
    spans two replicas, and a row goes with the group of its first prompt."""
    first_group: dict[int, int] = {}
    for g, group in enumerate(planned.plan.groups):
        for member in group.members:
            first_group.setdefault(planned.row_of_request[member], g)
    shards = shard_groups(planned.plan.groups, num_shards)
    shard_of_group = {id(group): s for s, shard in enumerate(shards) for group in shard}
    out: list[list[BatchRow]] = [[] for _ in range(num_shards)]
    for k, st in enumerate(planned.states):
        out[shard_of_group[id(planned.plan.groups[first_group[k]])]].append(st.row)
    return out
