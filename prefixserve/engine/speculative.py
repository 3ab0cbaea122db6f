"""Speculative decoding by prompt lookup (vLLM's ``ngram`` method): drafts proposed from a sequence's
own tokens, all checked by the step that would have decoded one token.

A sequence's last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up
earlier in its prompt and output, and the ``num_speculative_tokens`` that followed their latest
occurrence are appended as drafts before the step is scheduled (``Speculator.propose``, the
scheduler's ``speculate`` hook). The step then computes the last real token and the drafts as one
chunk, and each of those rows is sampled as the next token would be (``in_flight.mark_launched``).
Verification (``place_verified``) keeps the drafts while each equals the token sampled at the row
before it, then the first sampled token that differs (or the one after the last draft): up to K + 1
tokens a step for one step's weight reads. Where an answer quotes its context (questions on a
document, code edits, extraction) most drafts hold.

Exact: under greedy sampling each kept token is the argmax at its row, what one-token steps would
have chosen; under random sampling a draft ``d`` is kept with probability p(d) (the sampled token
equals it) and otherwise the sampled token, drawn from p given that it is not ``d``, is taken: the
rejection rule for a proposal that is certain of its token, so the output's distribution is the
model's. Rows whose choice depends on what precedes them in the step (penalties, logit bias,
min_tokens, bad words, grammars, thinking budgets) and rows that keep logprobs are not speculated.

The KV rows computed for drafts that are dropped lie past the sequence's computed tokens and are
written over later; blocks holding drafts are indexed in the prefix cache only once verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixserve.config import SpeculativeConfig
from prefixserve.sampling.params import BAD_WORDS, MIN_TOKENS, PROCESSES_LOGITS, THINKING_BUDGET
from prefixserve.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from collections import Counter

    from prefixserve.sampling.sampler import SampleResult
    from prefixserve.scheduler.scheduler import Scheduler, SchedulerOutput

# a row whose choice depends on the rows before it in the step, or that keeps more than its token
_NOT_SPECULATED = MIN_TOKENS | BAD_WORDS | PROCESSES_LOGITS | THINKING_BUDGET


@dataclass(slots=True)
class Verified:
    """A speculated sequence of a launched step: its drafts and where its rows' tokens start."""

    seq: Sequence
    num_drafts: int
    first: int  # index in the step's sampled tokens of the row that computed its last real token


def lookup(tokens: np.ndarray, longest: int, shortest: int, count: int) -> list[int]:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (``longest`` down to ``shortest`` tokens) found before it; empty where none is.

    One pass finds where the last token occurred before (each such place followed by a token); the
    suffix's earlier tokens are then compared at those places only."""
    size = len(tokens)
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # suffix tokens matched, ending at each place
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(longest, size - 1)):
        alive &= ends >= back
        alive[alive] = tokens[ends[alive] - back] == tokens[size - 1 - back]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < shortest:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]]) + 1
    return tokens[end : end + count].tolist()


class Speculator:
    """Proposes each step's drafts (the scheduler's ``speculate`` hook, given to it at construction).

    ``max_model_len``: the longest a sequence may grow. The engine makes the speculator before the
    scheduler, when that length is not yet decided (pinned system prompts take blocks first, by steps
    of the scheduler's), and completes it with ``set_max_model_len``: until then nothing is drafted."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int | None = None) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.drafted: dict[Sequence, int] = {}  # this step's speculated sequences -> their drafts

    def set_max_model_len(self, max_model_len: int) -> None:
        """The engine's limit on a sequence's length, once decided: drafts are proposed from now on."""
        self.max_model_len = max_model_len

    def _room(self, seq: Sequence, max_model_len: int) -> int:
        """Drafts ``seq`` may take: it decodes, may be speculated, and all K + 1 tokens fit its limits."""
        req = seq.request
        p = req.params
        # (an embedding request samples one token, max_tokens=1: the room below is never positive)
        if (
            seq.status is not SeqStatus.RUNNING
            or req.param_flags & _NOT_SPECULATED
            or p.wants_chosen_logprobs
            or p.structured_outputs is not None
        ):
            return 0
        size = len(seq.token_ids)
        if seq.num_computed_tokens != size - 1 or size <= req.num_prompt_tokens:
            return 0  # a prompt still computing, or no output yet
        room = max_model_len - size - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - (size - req.num_prompt_tokens) - 1)
        return min(room, self.spec.num_speculative_tokens)

    def propose(self, running: list[Sequence], budget: int) -> None:
        """Before the step is scheduled: append drafts to the running sequences that take them, while
        the step's token budget has room beside one token for each running sequence."""
        self.drafted = {}
        spec, max_model_len = self.spec, self.max_model_len
        if max_model_len is None:  # not yet set (the engine's set-up still pinning system prompts)
            return
        if spec.disable_by_batch_size is not None and len(running) > spec.disable_by_batch_size:
            return
        spare = budget - len(running)
        for seq in running:
            if spare <= 0:
                break
            room = min(self._room(seq, max_model_len), spare)
            if room <= 0:
                continue
            # a view of the ids, gone before they grow (an array exporting its buffer cannot resize)
            drafts = lookup(
                np.frombuffer(seq.token_ids, dtype=np.int64),
                spec.prompt_lookup_max,
                spec.prompt_lookup_min,
                room,
            )
            if drafts:
                last = seq.positions[-1]
                seq.token_ids.extend(drafts)
                seq.positions.extend(range(last + 1, last + 1 + len(drafts)))
                self.drafted[seq] = len(drafts)
                spare -= len(drafts)

    def settle(self, out: SchedulerOutput) -> None:
        """After scheduling: a speculated sequence keeps the drafts its chunk reaches; one that was not
        scheduled (or was preempted) gives them all back. ``out.drafts``: what the step verifies."""
        if not self.drafted:
            return
        chunk = {s.seq: s.num_tokens for s in out.scheduled}
        for seq, count in self.drafted.items():
            keep = max(0, min(count, chunk.get(seq, 0) - 1))
            if keep < count:
                del seq.token_ids[len(seq.token_ids) - (count - keep) :]
                del seq.positions[len(seq.positions) - (count - keep) :]
            if keep:
                out.drafts[seq] = keep
        self.drafted = {}


def place_verified(
    verified: list[Verified],
    result: SampleResult,
    scheduler: Scheduler,
    eos_ids: set[int],
    max_model_len: int,
    tokenizer: Any,
    counters: Counter[str],
) -> None:
    """Keep each speculated sequence's drafts up to the first one its sampled tokens disagree with,
    then that sampled token (or the one after the last draft); stops are checked token by token, and
    the blocks the kept tokens filled are indexed."""
    tokens = result.tokens
    drafted = accepted = generated = 0
    for v in verified:
        seq = v.seq
        if seq.status is SeqStatus.FINISHED:
            continue  # aborted or failed since its launch
        sampled = tokens[v.first : v.first + v.num_drafts + 1]
        start = len(seq.token_ids) - v.num_drafts
        drafts = seq.token_ids[start:].tolist()
        kept = 0
        while kept < v.num_drafts and sampled[kept] == drafts[kept]:
            kept += 1
        del seq.token_ids[start:]
        del seq.positions[start:]
        seq.num_computed_tokens = start + kept  # the last real token's and the kept drafts' KV
        drafted += v.num_drafts
        accepted += kept
        req = seq.request
        for token in sampled[: kept + 1]:
            seq.append_token(token)
            req.unreported += 1
            generated += 1
            scheduler.check_stop(seq, eos_ids, max_model_len, tokenizer)
            if seq.status is SeqStatus.FINISHED:
                break
        else:
            scheduler.blocks.register_computed(seq)
        v.num_drafts = 0  # placed: nothing is left to give back
    counters["spec_decode_draft_tokens_total"] += drafted
    counters["spec_decode_accepted_tokens_total"] += accepted
    counters["generation_tokens_total"] += generated


def give_back(drafts: dict[Sequence, int]) -> None:
    """A step that failed: its speculated sequences' drafts come off their token ids (the requests
    then end with the tokens they had)."""
    for seq, count in drafts.items():
        if not count:
            continue
        del seq.token_ids[len(seq.token_ids) - count :]
        del seq.positions[len(seq.positions) - count :]
    drafts.clear()


__all__ = ["Speculator", "Verified", "give_back", "lookup", "place_verified"]
