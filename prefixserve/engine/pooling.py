"""Embedding requests (``PoolingParams``): one vector from the model's final hidden states over the
prompt, read from the step that computes them, before the sampling takes the hidden rows.

An embedding request computes its prompt and no completion: the engine samples one greedy token,
which no embedding answer shows (its output still carries it, and the finish reason; the generation
counters count it, as they count echo's scoring-only requests), so the request ends in the step that
computes its last prompt row.

**Shared prefixes.** "last" pools the last prompt row, which a prefix-cache hit never skips (one
token is always left to compute), so requests sharing a prefix compute it once, as generation does.
"mean" needs every prompt row; the fp32 sum of each full block's rows is kept by the block's digest
(``BlockStore``), so a hit takes the sums of its blocks from the store and a shared prefix is still
computed once. A hit on blocks whose sums are not kept is cut short there (``known_blocks``).

An output rule (``output_rules.py``): ``prepare`` gives an embedding request its sampling params, a
request's ``PoolState`` is ``Request.rules[NAME]``, its vector fills the final output's ``embedding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from prefixserve.engine.block_store import BlockStore
from prefixserve.engine.output_rules import OutputRule
from prefixserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from prefixserve.pooling_params import PoolingParams
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.sampling.params import SamplingParams
from prefixserve.sequence import Request, Sequence

if TYPE_CHECKING:
    from prefixserve.scheduler.block_tables import BlockManager
    from prefixserve.scheduler.scheduler import ScheduledSeq
    from prefixserve.worker.model_runner import Launch, ModelRunner

STORE_BLOCKS = 4096  # kept blocks' row sums (LRU): 4096 x hidden x 4 bytes, 64 MB at hidden 4096
NAME = "pooling"  # the output rule's name: an embedding request's ``PoolState`` is ``Request.rules[NAME]``


@dataclass(slots=True)
class PoolState:
    """One embedding request's pooling so far."""

    params: PoolingParams
    total: torch.Tensor | None = None  # [hidden] fp32: sum of the prompt rows pooled so far (mean)
    partial: torch.Tensor | None = None  # [hidden] fp32: sum of the rows of the block being filled
    known: int = 0  # leading prompt rows summed (mean)
    stored: int = 0  # leading blocks whose sums are in the store
    vector: torch.Tensor | None = None  # [hidden] fp32, the embedding, once the last row is computed


class Pooler(OutputRule):
    """The engine's embedding work: the requests still pooling, and the kept blocks' row sums."""

    name = NAME

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.active: set[Request] = set()
        self.store: BlockStore[torch.Tensor] = BlockStore(STORE_BLOCKS)

    def prepare(
        self, params: SamplingParams | None, pooling: PoolingParams | None, prompt: str | None
    ) -> SamplingParams | None:
        """An embedding request's sampling (``embedding_request``); other requests' params as given."""
        return params if pooling is None else embedding_request(pooling, params, prompt)

    def admit(self, req: Request, pooling: PoolingParams | None) -> None:
        if pooling is not None:
            req.rules[NAME] = PoolState(pooling)
            self.active.add(req)

    def report(self, req: Request, finished: bool) -> dict[str, Any] | None:
        return {"embedding": pooled_embedding(req)} if finished and NAME in req.rules else None

    def discard(self, req: Request) -> None:
        self.active.discard(req)

    # ---- the block manager's hooks (mean pooling: a hit's rows come from the store) ---------------
    def wants(self, req: Request) -> bool:
        state: PoolState | None = req.rules.get(NAME)
        return state is not None and state.params.pooling == "mean" and req in self.active

    def known_blocks(self, seq: Sequence, digests: list[bytes]) -> int:
        """A fresh request may hit the blocks whose sums are kept; one computed before (preempted) may
        hit only rows it has summed, which it takes from nothing (``collect`` skips them)."""
        state: PoolState = seq.request.rules[NAME]
        n = self.store.known_blocks(digests)
        return n if state.known == 0 else min(n, state.known // self.block_size)

    def seed(self, seq: Sequence, num_blocks: int) -> int:
        """A fresh request's hit: its blocks' kept sums start the request's sum. No row is computed
        again."""
        state: PoolState = seq.request.rules[NAME]
        if state.known > 0:
            return 0
        sums = [self.store.take(d) for d in seq.block_digests[:num_blocks]]
        state.total = torch.stack(sums).sum(0)
        state.known, state.stored = num_blocks * self.block_size, num_blocks
        return 0

    # ---- a step -------------------------------------------------------------------------------
    def collect(
        self,
        scheduled: list[ScheduledSeq],
        first_row: int,
        launch: Launch,
        runner: ModelRunner,
        blocks: BlockManager,
    ) -> None:
        """Pool the prompt rows this launch computes for embedding requests (before its sampling takes
        the hidden states); call before the sequences' computed counts advance."""
        row = first_row
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            req = seq.request
            start, row = row, row + n
            if req not in self.active or seq.index != 0:
                continue
            state: PoolState = req.rules[NAME]
            p0, prompt = seq.num_computed_tokens, req.num_prompt_tokens
            end = min(p0 + n, prompt)  # prompt rows [p0, end) are at rows [start, start + end - p0)
            if state.params.pooling == "mean" and end > state.known:
                lo = max(p0, state.known)
                rows = runner.hidden(launch, list(range(start + lo - p0, start + end - p0))).float()
                self._sum(seq, state, lo, rows, blocks)
            if end == prompt:
                if state.params.pooling == "last":
                    last = runner.hidden(launch, [start + prompt - 1 - p0])[0]
                    state.vector = last.to(torch.float32, copy=True)  # not a view of a graph's buffer
                else:
                    state.vector = state.total / prompt
                if state.params.normalize:
                    state.vector = torch.nn.functional.normalize(state.vector, dim=0)
                self.active.discard(req)

    def _sum(
        self, seq: Sequence, state: PoolState, lo: int, rows: torch.Tensor, blocks: BlockManager
    ) -> None:
        """Add the rows of prompt positions [lo, lo + len(rows)) to the request's sum, and keep the
        sum of each block they complete."""
        bs, n = self.block_size, rows.shape[0]
        total = rows.sum(0)
        state.total = total if state.total is None else state.total + total
        state.known = lo + n
        offset = lo % bs
        padded = rows.new_zeros(-(-(offset + n) // bs) * bs, rows.shape[1])
        padded[offset : offset + n] = rows
        sums = padded.view(-1, bs, rows.shape[1]).sum(1)  # [blocks touched, hidden]
        if state.partial is not None:
            sums[0] += state.partial
        full = state.known // bs
        first = lo // bs
        if full > state.stored and state.stored == first:  # every block from the first one is whole
            digests = blocks.digests(seq, full)
            for j in range(state.stored, full):
                self.store.put(digests[j], sums[j - first])
            state.stored = full
        state.partial = sums[full - first] if state.known % bs else None


def embedding_request(
    pooling: PoolingParams, params: SamplingParams | None, prompt: str | None
) -> SamplingParams:
    """The sampling an embedding request runs under: one greedy token, never answered, so the request
    ends in the step that computes its prompt. Raises ValueError for what it cannot take."""
    if params is not None:
        raise ValueError("an embedding request (pooling) takes no sampling params")
    if prompt is not None and is_pml_prompt(prompt):
        raise ValueError("embeddings are not available for PML (Prompt Cache) prompts")
    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, truncate_prompt_tokens=pooling.truncate_prompt_tokens
    )


def pooled_embedding(req: Request) -> list[float] | None:
    """The request's embedding as a list, once computed (None for other requests)."""
    state: PoolState | None = req.rules.get(NAME)
    if state is None or state.vector is None:
        return None
    return state.vector.tolist()


def embedding_output(out: RequestOutput) -> EmbeddingRequestOutput:
    """A finished embedding request's output in vLLM's shape; raises RuntimeError if it failed."""
    if out.embedding is None:
        why = out.error or (out.outputs[0].finish_reason if out.outputs else None)
        raise RuntimeError(f"embedding request {out.request_id} failed: {why}")
    return EmbeddingRequestOutput(
        out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding), out.num_cached_tokens
    )


__all__ = ["NAME", "PoolState", "Pooler", "embedding_output", "embedding_request", "pooled_embedding"]
