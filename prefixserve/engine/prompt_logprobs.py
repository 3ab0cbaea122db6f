"""Prompt logprobs (``SamplingParams.prompt_logprobs``, what ``echo`` with ``logprobs`` answers): each
prompt token's logprob under the model given the tokens before it, and the top-k there.

Prefills usually score only their last row. For a request that asks, every prompt row of each chunk
is scored too, through the runner's ``logits`` in fp32: the same values generation samples from, so a
greedy check (is the token the top-1?) is exact. Rows are scored in the step that computes them
(chunked prefill gives them chunk by chunk), before the sampling takes the hidden states.

**Shared prefixes.** A prefix-cache hit skips rows, and a skipped row has no hidden state to score.
So the results of every full prompt block are kept by the block's digest (``store``: the digest
covers the tokens, positions and cache salt of the whole prefix up to the block's end, so equal
digests mean equal logprobs). A request asking for prompt logprobs takes cached KV only for the
leading blocks whose results are kept (``known_blocks``), copies those results (``seed``), and
recomputes one row, the last cached one, whose logits score the first token after the hit. So
requests sharing a prefix (lm-eval's few-shot contexts and a question's choices) compute it once
and count it in ``cached_tokens``; requests arriving together wait for the first one's blocks, as
all requests do (``Scheduler._prefix_in_flight``).

An output rule (``output_rules.py``): a request's ``PromptLogprobState`` is ``Request.rules[NAME]``,
its lists fill the output's ``prompt_token_logprobs``, ``prompt_top_logprobs``, ``prompt_logprob_ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from prefixserve.engine.block_store import BlockStore
from prefixserve.engine.output_rules import OutputRule
from prefixserve.pooling_params import PoolingParams
from prefixserve.sampling.params import MAX_LOGPROBS
from prefixserve.sequence import Request, Sequence

if TYPE_CHECKING:
    from prefixserve.scheduler.block_tables import BlockManager
    from prefixserve.scheduler.scheduler import ScheduledSeq
    from prefixserve.worker.model_runner import Launch, ModelRunner

# each prompt token's logprob (the first: None), top-k (token id, logprob) pairs (the first: []), rank
PromptLists = tuple[list[float | None], list[list[tuple[int, float]]], list[int | None]]

TOP = MAX_LOGPROBS  # every scored row keeps its top 20, so any request's k is a slice of a kept block
STORE_BLOCKS = 8192  # kept blocks' results (LRU): 16 tokens x 20 x 12 bytes a block, ~30 MB
NAME = "prompt_logprobs"  # the output rule's name: a request's state is ``Request.rules[NAME]``


@dataclass(slots=True)
class PromptLogprobState:
    """One request's prompt logprobs on the device, one row per prompt token (token 0: none)."""

    lp: torch.Tensor  # [P] fp32, NaN where not known
    top_vals: torch.Tensor  # [P, TOP] fp32
    top_ids: torch.Tensor  # [P, TOP] int64
    rank: torch.Tensor  # [P] int64: 1 + how many tokens the model put above the prompt's own (vLLM's rank)
    known: int = 1  # leading tokens whose results are in place (token 0 has none)
    stored: int = 0  # leading blocks put into the store
    lists: PromptLists | None = field(default=None)


class PromptLogprobs(OutputRule):
    """The engine's prompt-logprob work: the requests still scoring, and the kept blocks' results."""

    name = NAME

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device, self.block_size = device, block_size
        self.active: set[Request] = set()
        self.store: BlockStore[tuple[torch.Tensor, ...]] = BlockStore(STORE_BLOCKS)  # (lp, vals, ids, rank)

    def admit(self, req: Request, pooling: PoolingParams | None = None) -> None:
        """A request asking for prompt logprobs: its rows' results on the device, filled as they come."""
        if req.params.prompt_logprobs is None:
            return
        p = req.num_prompt_tokens
        req.rules[NAME] = PromptLogprobState(
            torch.full((p,), float("nan"), device=self.device),
            torch.zeros(p, TOP, device=self.device),
            torch.zeros(p, TOP, dtype=torch.long, device=self.device),
            torch.zeros(p, dtype=torch.long, device=self.device),
        )
        self.active.add(req)

    def discard(self, req: Request) -> None:
        self.active.discard(req)

    # ---- the block manager's hooks (a hit's rows come from the store: ``row_keepers``) ----------
    def wants(self, req: Request) -> bool:
        return req.params.prompt_logprobs is not None

    def known_blocks(self, seq: Sequence, digests: list[bytes]) -> int:
        """How many of these leading blocks a hit may cover: those whose results are kept."""
        return self.store.known_blocks(digests)

    def seed(self, seq: Sequence, num_blocks: int) -> int:
        """A hit of ``num_blocks`` leading blocks: their kept results become the request's. Returns
        the hit rows to compute again: the last one, whose logits score the first token after it."""
        state = seq.request.rules[NAME]
        if seq.request not in self.active or seq.index != 0:
            return 1  # done scoring (a preempted request computes its prompt again, scoring nothing)
        bs = self.block_size
        for j, digest in enumerate(seq.block_digests[:num_blocks]):
            lp, vals, ids, rank = self.store.take(digest)
            state.lp[j * bs : (j + 1) * bs] = lp
            state.top_vals[j * bs : (j + 1) * bs] = vals
            state.top_ids[j * bs : (j + 1) * bs] = ids
            state.rank[j * bs : (j + 1) * bs] = rank
        state.known = max(1, num_blocks * bs)
        state.stored = num_blocks
        return 1

    # ---- a step -------------------------------------------------------------------------------
    def collect(
        self,
        scheduled: list[ScheduledSeq],
        first_row: int,
        launch: Launch,
        runner: ModelRunner,
        blocks: BlockManager,
    ) -> None:
        """Score the prompt rows this launch computes for the requests that ask (before its sampling
        takes the hidden states); call before the sequences' computed counts advance."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[Sequence, int, int]] = []  # (seq, first target token, end)
        row = first_row
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            req = seq.request
            start, row = row, row + n
            if req not in self.active or seq.index != 0:
                continue
            p0, end = seq.num_computed_tokens, min(seq.num_computed_tokens + n, req.num_prompt_tokens - 1)
            if p0 >= end:
                continue
            rows += range(start, start + end - p0)
            targets += seq.token_ids[p0 + 1 : end + 1]
            spans.append((seq, p0 + 1, end + 1))
        if not rows:
            return
        logp = runner.logits(launch, rows, fp32=True).log_softmax(-1)
        dev = logp.device
        chosen = logp.gather(1, torch.tensor(targets, device=dev)[:, None])[:, 0]
        rank = (logp > chosen[:, None]).sum(-1) + 1
        vals, ids = logp.topk(min(TOP, logp.shape[-1]), dim=-1)
        at = 0
        for seq, lo, hi in spans:
            state: PromptLogprobState = seq.request.rules[NAME]
            k = hi - lo
            state.lp[lo:hi] = chosen[at : at + k]
            state.top_vals[lo:hi, : vals.shape[1]] = vals[at : at + k]
            state.top_ids[lo:hi, : ids.shape[1]] = ids[at : at + k]
            state.rank[lo:hi] = rank[at : at + k]
            at += k
            state.known = max(state.known, hi)
            self._keep(seq, state, blocks)
            if state.known >= seq.request.num_prompt_tokens:
                self.active.discard(seq.request)

    def _keep(self, seq: Sequence, state: PromptLogprobState, blocks: BlockManager) -> None:
        """Put the request's newly complete full blocks into the store, by digest."""
        bs = self.block_size
        full = state.known // bs
        if full <= state.stored:
            return
        digests = blocks.digests(seq, full)
        for j in range(state.stored, full):
            sl = slice(j * bs, (j + 1) * bs)
            kept = (state.lp[sl], state.top_vals[sl], state.top_ids[sl], state.rank[sl])
            self.store.put(digests[j], tuple(t.clone() for t in kept))
        state.stored = full

    def report(self, req: Request, finished: bool) -> dict[str, Any] | None:
        lists = prompt_logprob_lists(req)
        if lists is None:
            return None
        values, tops, ranks = lists
        return {"prompt_token_logprobs": values, "prompt_top_logprobs": tops, "prompt_logprob_ranks": ranks}


def prompt_logprob_lists(req: Request) -> PromptLists | None:
    """The request's prompt logprobs as host lists (first token: None, no top, no rank), or None when
    not asked for; made once, when the prompt is done."""
    state: PromptLogprobState | None = req.rules.get(NAME)
    k = req.params.prompt_logprobs
    if state is None or k is None or state.known < req.num_prompt_tokens:
        return None
    if state.lists is None:
        lp = state.lp.tolist()
        vals, ids = state.top_vals[:, :k].tolist(), state.top_ids[:, :k].tolist()
        values: list[Any] = [None, *lp[1:]]
        tops = [[], *(list(zip(i, v, strict=True)) for i, v in zip(ids[1:], vals[1:], strict=True))]
        ranks: list[Any] = [None, *state.rank[1:].tolist()]
        state.lists = (values, tops, ranks)
    return state.lists


__all__ = ["NAME", "PromptLists", "PromptLogprobState", "PromptLogprobs", "prompt_logprob_lists"]
