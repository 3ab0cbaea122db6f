"""Launch-ahead bookkeeping: placeholders for sampled tokens that are still on the device.

With async scheduling a step returns while the device works, and with launch-ahead the next step is
even launched before the host has this step's tokens. Until a token arrives its sequence carries a
``PLACEHOLDER_TOKEN`` (so lengths, positions and block reservations are right), recorded here per
sequence; ``Scheduler.update_from_output`` puts the token in its place. vLLM v1 keeps the same
bookkeeping in its ``async_scheduler.py`` (output placeholders).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from prefixserve.engine.speculative import Verified
from prefixserve.sampling.params import RowParams, SamplingParams
from prefixserve.sampling.sampler import SampleResult
from prefixserve.scheduler.block_tables import BlockManager
from prefixserve.scheduler.scheduler import ScheduledSeq, SchedulerOutput
from prefixserve.scheduler.stop import ends_by_length
from prefixserve.sequence import PLACEHOLDER_TOKEN, Request, Sequence
from prefixserve.worker.model_runner import Launch


@dataclass(frozen=True, slots=True)
class TakenTokens:
    """A step's tokens waited for early: its sampling's result (None: the step sampled nothing)."""

    result: SampleResult | None


@dataclass(slots=True)
class LaunchedStep:
    """A launched step: its sampled tokens are on their way from the device."""

    samplers: list[Sequence]  # sequences that sample a token (each holds a placeholder)
    indices: list[int]  # where each sampler's placeholder sits in its token ids
    touched: set[Request]
    launch: Launch
    # what its sampling takes (rows, params, generators) until it is issued; kept past the launch when
    # grammar-constrained rows need the tokens of the step ahead for their mask (launch-ahead)
    sampling: tuple[list[int], list[SamplingParams], list[torch.Generator | None]] | None = None
    verified: list[Verified] = field(default_factory=list)  # speculated sequences (rows after the samplers')
    row_seqs: list[Sequence] = field(default_factory=list)  # the sequence of each speculated row
    # its tokens, where they were waited for as soon as its sampling went out and the rules took them
    # then (``Engine._take_tokens``); None: not yet
    taken: TakenTokens | None = None

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """The sequence each sampled row is for: the samplers', then the speculated rows'."""
        return self.samplers + self.row_seqs if self.row_seqs else self.samplers


# A placeholder still waiting for its token: (its index in the token ids, the launch sampling it, the row)
PendingToken = tuple[int, Launch, int]

# A placeholder taken off the end of its sequence for now: (the sequence, the token id, its position)
HiddenToken = tuple[Sequence, int, int]


class InFlightTokens:
    """Each sequence's placeholders still waiting for their tokens, oldest first."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: dict[Sequence, list[PendingToken]] = {}

    def mark_launched(
        self,
        scheduled: list[ScheduledSeq],
        num_recompute_rows: int,
        launch: Launch,
        blocks: BlockManager,
        fork: Callable[[Sequence], list[Sequence]],
        drafts: dict[Sequence, int] | None = None,
    ) -> tuple[LaunchedStep, list[int], list[SamplingParams], list[torch.Generator | None]]:
        """Mark the step's tokens computed, index filled blocks, split off n > 1 samples (``fork``),
        and give each sampling sequence a placeholder for its token until it arrives.

        ``num_recompute_rows``: the Prompt Cache recovery rows that lead the batch (nothing is sampled
        from them). Returns the launched step and what its sampling takes: the hidden rows, their
        parameters and generators. One pass over the batch (the host's cost per sequence is mostly
        reaching each sequence's objects): placeholders go in before the sampling is issued, which
        reads no token ids; should that fail, the engine drops them with the sequences' other
        pending tokens. ``drafts``: speculated sequences (``speculative.py``): each samples every row
        of its chunk, after the samplers' rows, and holds no placeholder; the blocks its drafts fill
        are indexed once verified.
        """
        pending = self.pending
        register_computed, bs = blocks.register_computed, blocks.block_size
        step = LaunchedStep([], [], set(), launch)
        samplers, indices, touched = step.samplers, step.indices, step.touched
        rows: list[int] = []
        params = RowParams()
        flags = 0
        generators: list[torch.Generator | None] = []
        end = num_recompute_rows
        verified, spec_rows = step.verified, []
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            req = seq.request
            touched.add(req)
            end += n
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            # register_computed indexes nothing unless a block filled up since its last call (it
            # never indexes past the computed tokens): most decode steps skip the call
            drafted = drafts.get(seq, 0) if drafts else 0
            if computed // bs > seq.num_indexed_blocks:
                held = pending.get(seq)
                known = len(held) if held else drafted
                register_computed(seq, len(seq.token_ids) - known if known else None)
            if computed < len(seq.token_ids):
                continue  # a prefill chunk that does not reach the end: nothing to sample yet
            if drafted:
                verified.append(Verified(seq, drafted, len(spec_rows)))
                spec_rows.extend(range(end - 1 - drafted, end))
                step.row_seqs.extend([seq] * (drafted + 1))
                flags |= req.param_flags
                continue
            p = req.params
            flags |= req.param_flags
            if p.num_samples == 1 or req.forked:
                targets: tuple[Sequence, ...] | list[Sequence] = (seq,)
            else:
                targets = fork(seq)  # copies seq's tokens before its placeholder
            for target in targets:
                token_ids, positions = target.token_ids, target.positions
                entry = (len(token_ids), launch, len(samplers))
                token_ids.append(PLACEHOLDER_TOKEN)  # target.append_token, inlined
                positions.append(positions[-1] + 1)
                held = pending.get(target)
                if held is None:
                    pending[target] = [entry]
                else:
                    held.append(entry)
                rows.append(end - 1)
                samplers.append(target)
                indices.append(entry[0])
                params.append(p)
                generators.append(target.generator)
        for v in verified:  # the speculated rows go after the samplers'
            v.first += len(rows)
            params.extend([v.seq.request.params] * (v.num_drafts + 1))
            generators.extend([v.seq.generator] * (v.num_drafts + 1))
        rows.extend(spec_rows)
        params.flags = flags
        return step, rows, params, generators

    def hide(self, launched_after: LaunchedStep | None) -> list[HiddenToken]:
        """Take the placeholders of the step launched after the one completing off the ends of its
        sequences for now, so texts, stop checks and outputs see the sequences as of that step."""
        if launched_after is None:
            return []
        hidden = []
        pending = self.pending
        for seq in launched_after.samplers:
            held = pending.get(seq)
            if held and held[-1][1] is launched_after.launch and len(seq.token_ids) == held[-1][0] + 1:
                hidden.append((seq, seq.token_ids.pop(), seq.positions.pop()))
        return hidden

    def unhide(self, hidden: list[HiddenToken]) -> None:
        """Put hidden placeholders back; a sequence that stopped meanwhile drops its later token."""
        pending = self.pending
        for seq, token, position in hidden:
            if not seq.is_finished:
                seq.token_ids.append(token)
                seq.positions.append(position)
                continue
            held = pending.get(seq)
            if held:
                held.pop()
                if not held:
                    del pending[seq]

    def drop(self, seq: Sequence) -> None:
        """A sequence that ends now: its in-flight tokens will never be read, so its placeholders go."""
        held = self.pending.pop(seq, None)
        if held:
            del seq.token_ids[-len(held) :]
            del seq.positions[-len(held) :]

    def drop_surely_finished(self, sched: SchedulerOutput, max_model_len: int) -> None:
        """Launch-ahead: leave out sequences whose in-flight token is their last by length (max_tokens
        or the context); their row would be computed for nothing."""
        pending, limit = self.pending, max_model_len
        keep = [s for s in sched.scheduled if s.seq not in pending or not ends_by_length(s.seq, limit)]
        if len(keep) < len(sched.scheduled):
            sched.scheduled = keep


__all__ = [
    "PLACEHOLDER_TOKEN",
    "HiddenToken",
    "InFlightTokens",
    "LaunchedStep",
    "PendingToken",
    "TakenTokens",
]
