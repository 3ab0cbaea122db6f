"""A scheduled step's inputs for the model runner: positions, lengths, block tables and token ids.

The engine hands the runner host arrays only; this module gathers them from the scheduled sequences
(``assemble_batch`` for the runner's ``StepBatch``, ``gather_token_ids`` for the ids at launch), with
the Prompt Cache's recovery rows leading the batch where a request still has some.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from prefixserve.engine.in_flight import LaunchedStep, PendingToken
from prefixserve.scheduler.block_tables import BlockManager
from prefixserve.scheduler.scheduler import ScheduledSeq, SchedulerOutput
from prefixserve.sequence import Request, Sequence
from prefixserve.worker.model_runner import ModelRunner, StepBatch

# Module rows to recompute in context: (the sequence, first row, end row) of its module blocks
RecomputeRun = tuple[Sequence, int, int]


def recompute_runs(sched: SchedulerOutput, to_recover: set[Request]) -> list[RecomputeRun]:
    """Accuracy recovery rows still to compute, for requests in their first prefill step.

    Each run (rows a..b-1 of the request's module blocks, private copies) goes in the same
    forward as the request's own tokens, as a sequence of its own whose context is the table up
    to its rows: each layer writes every new row's K/V before attending, so a run sees the runs
    before it, and the own tokens see all of them, at that very layer, exactly as one causal
    prefill would (recomputing every row is full prefill). One forward, not two: on a GPU an
    extra eager forward costs as much host time as the whole module-cached first token.
    """
    if not to_recover:  # nearly every step: no pass over the batch
        return []
    runs: list[RecomputeRun] = []
    seen: set[Request] = set()  # samples of one request share its copies: their rows go once
    for s in sched.scheduled:
        req = s.seq.request
        if req in to_recover and req not in seen and req.modules is not None:
            seen.add(req)
            runs += [(s.seq, a, b) for a, b in req.modules.recompute_runs]
    return runs


def take_recompute_ids(sched: SchedulerOutput, to_recover: set[Request]) -> list[int]:
    """The token ids of the recovery rows that lead this step's batch; their requests have none left
    to compute after it (``recompute_runs`` is empty for them from now on)."""
    runs = recompute_runs(sched, to_recover)
    ids: list[int] = [t for seq, a, b in runs for t in seq.token_ids[a:b]]
    for seq, _, _ in runs:
        seq.request.modules.recompute_runs = []  # type: ignore[union-attr]
        to_recover.discard(seq.request)
    return ids


def assemble_batch(
    sched: SchedulerOutput,
    blocks: BlockManager,
    runner: ModelRunner,
    module_rows: Any,
    to_recover: set[Request],
) -> StepBatch:
    """Gather the step's positions, lengths and block tables; the runner plans the device side.

    ``module_rows``: the Prompt Cache's module rows while any are in use, else None. ``to_recover``:
    requests with recovery rows still to compute, which lead the batch (``recompute_runs``).

    A speculated sequence (``sched.drafts``) goes in as one decode row per token of its chunk, each
    over the sequence's table up to its own position: each layer writes every row's K/V before
    attending, so row j sees the drafts before it, as one causal chunk would, and a step of decodes
    and speculated sequences stays a decode step (its CUDA graphs, its shared-segment kernels).
    """
    pos: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    seqs: list[Sequence] = []
    drafts = sched.drafts
    for s in sched.scheduled:  # once per sequence per step: a decode row's position is one index
        seq, n = s.seq, s.num_tokens
        c = seq.num_computed_tokens
        if n == 1:
            pos.append(seq.positions[c])
        else:
            pos += seq.positions[c : c + n]
            if drafts and seq in drafts:
                query_lens += [1] * n
                seq_lens += range(c + 1, c + n + 1)
                seqs += [seq] * n
                continue
        query_lens.append(n)
        seq_lens.append(c + n)
        seqs.append(seq)
    # one numpy gather from the block manager's mirror (lists would cost ~20 ns a block entry)
    tables = blocks.block_tables_np(seqs, seq_lens)
    group_tables = blocks.group_tables_np(seqs)  # the freeing layout's sliding pages
    runs = recompute_runs(sched, to_recover)
    if runs:  # module rows to recompute in context lead the batch, each run a sequence of its own
        bs = blocks.block_size
        width = max(tables.shape[1], *(-(-b // bs) for _, a, b in runs))
        lead = np.zeros((len(runs), width), dtype=np.int32)  # [R, W]
        for i, (seq, _, b) in enumerate(runs):
            lead[i, : -(-b // bs)] = seq.block_table[: -(-b // bs)]
        tables = np.concatenate((lead, np.pad(tables, ((0, 0), (0, width - tables.shape[1])))))
        pos = [p for seq, a, b in runs for p in seq.positions[a:b]] + pos
        query_lens = [b - a for _, a, b in runs] + query_lens
        seq_lens = [b for _, _, b in runs] + seq_lens
    states = blocks.states  # a hybrid's state slots (no recovery runs or drafts: it takes neither)
    slots = states.slots(seqs) if states is not None else None
    copies = states.take_copies() if states is not None else None
    snaps = None
    if states is not None and states.snapshots:  # prefix snapshots its chunks take
        snaps = [
            blocks.snapshot_rows(s.seq, s.seq.num_computed_tokens, s.num_tokens) for s in sched.scheduled
        ]
    return runner.prepare_batch(
        pos, query_lens, seq_lens, tables, module_rows, eager=bool(runs), group_tables=group_tables,
        state_slots=slots, state_copies=copies, state_snapshots=snaps,
    )  # fmt: skip


def gather_token_ids(
    scheduled: list[ScheduledSeq],
    ids: list[int],
    ahead_of: LaunchedStep | None,
    pending: dict[Sequence, list[PendingToken]],
    counters: Counter[str],
) -> tuple[list[int], list[int]]:
    """Append the step's token ids to ``ids``; returns the rows fed on the device (dst, src).

    ``ahead_of``: the launched step whose tokens are not on the host yet (launch-ahead); a row that
    computes one of them reads it on the device. Once per sequence per step: a decode row's id is
    read with one index, not a slice, and the prompt-token counter is bumped once for the batch (a
    ``Counter`` update per sequence cost more than the rest of the loop body).
    """
    dst: list[int] = []
    src: list[int] = []
    prompt_computed = 0
    for s in scheduled:
        seq, n = s.seq, s.num_tokens
        c = seq.num_computed_tokens
        if pending and seq in pending:  # tokens of this step still on the device (or a bug)
            for idx, launch, row in pending[seq]:
                if c <= idx < c + n:
                    if ahead_of is None or launch is not ahead_of.launch:
                        counters["prompt_tokens_computed_total"] += prompt_computed
                        raise RuntimeError(f"sequence {seq.seq_id} would compute a token not yet sampled")
                    dst.append(len(ids) + idx - c)
                    src.append(row)
        if n == 1:
            ids.append(seq.token_ids[c])
        else:
            ids += seq.token_ids[c : c + n]
        num_prompt = seq.request.num_prompt_tokens
        if c < num_prompt:
            prompt_computed += min(c + n, num_prompt) - c
    counters["prompt_tokens_computed_total"] += prompt_computed
    return dst, src


__all__ = ["RecomputeRun", "assemble_batch", "gather_token_ids", "recompute_runs", "take_recompute_ids"]
