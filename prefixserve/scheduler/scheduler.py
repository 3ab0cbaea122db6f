"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decode tokens and unfinished prefill chunks, oldest first), then
waiting sequences admitted while the token budget, the sequence cap and the block pool allow. When a
running sequence cannot get a block, the most recently admitted running sequence is preempted by
recompute: its blocks go back to the pool and it waits again at the front of the queue (its prompt's
full blocks usually come back from the prefix cache). Under the ``priority`` policy (``policy.py``)
the queue is ordered by priority and the least urgent running sequence is the one preempted.

Offline batches add prefix-sharing groups (``add_group``; BatchLLM section 3.3): each step feeds
decodes first, then distinct prompts (waiting members of started groups), then the next group's
common prefix, and a group's prefix is computed (by its leader) before its other members start;
the group holds those blocks until its last member ends, or until the scheduler idles with a head
of the queue that needs them (``_unstick``, which also asks the engine's ``reclaim`` for blocks held
outside every sequence).
With ``kv_admit_threshold`` set, admission also stops where the KV pool would pass that share of its
blocks (memory-centric token batching), so decode-heavy steps take prefill chunks while memory allows.

After a step, ``update_from_output`` puts the sampled tokens in place, checks stops (``stop.py``) and
frees the sequences that stopped: the post-step state stays with the scheduler, as nano-vllm's
``Scheduler.postprocess`` and vLLM v1's ``update_from_output`` keep it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prefixserve.scheduler.block_tables import BlockManager
from prefixserve.scheduler.groups import GroupJob, GroupState
from prefixserve.scheduler.policy import queue_policy
from prefixserve.scheduler.prompts_in_flight import PromptsInFlight
from prefixserve.scheduler.stop import stop_possible, stop_reason
from prefixserve.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from prefixserve.sampling.sampler import SampleResult


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for this sequence in this step


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)
    # prompt tokens found in the prefix cache by this step's first admissions (``Scheduler._admit``)
    cache_hit_tokens: int = 0
    # speculated sequences -> the drafts at the end of their token ids this step verifies
    drafts: dict[Sequence, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Speculate(Protocol):
    """The scheduler's ``speculate`` hook (``engine/speculative.Speculator``)."""

    def propose(self, running: list[Sequence], budget: int) -> None:
        """Before the step is planned: append drafts to the running sequences that take them."""

    def settle(self, out: SchedulerOutput) -> None:
        """After it is planned: keep the drafts each chunk reaches (``out.drafts``), give back the rest."""


@dataclass(frozen=True, slots=True)
class SchedulerHooks:
    """The engine's hooks, given at construction (None: the scheduler does without).

    For blocks held outside every sequence (``engine/module_holds.py``): ``reclaim(head, own)`` frees
    what it can when the scheduler is stuck behind ``head`` (``_unstick``; ``own``: what the head
    itself may do without) and returns how many blocks that freed; ``ready(seq)``: may ``seq`` be
    admitted now (False: not yet, the blocks it must hold first have no room; or it ended trying).
    ``refuse(seq, why)``: end a head that can never start, saying why. ``speculate``: speculative
    decoding (``engine/speculative.py``), whose ``propose(running, budget)`` appends drafts before
    the step is planned and ``settle(out)`` keeps those its chunks reach."""

    reclaim: Callable[[Sequence, bool], int] | None = None
    ready: Callable[[Sequence], bool] | None = None
    refuse: Callable[[Sequence, str], None] | None = None
    speculate: Speculate | None = None


def _to_fork(seq: Sequence) -> int:
    """The samples ``seq``'s request will still fork from it (n > 1, before its prompt is done)."""
    req = seq.request
    return req.params.num_samples - 1 if seq.index == 0 and not req.forked else 0


class Scheduler:
    """``hooks``: the engine's (``SchedulerHooks``), fixed for the scheduler's life."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        kv_admit_threshold: float | None = None,
        policy: str = "fcfs",
        *,
        hooks: SchedulerHooks | None = None,
        tenant_weights: dict[str, float] | None = None,
    ) -> None:
        self.blocks = blocks
        self._hooks = hooks if hooks is not None else SchedulerHooks()
        # the waiting queue's order, whom to preempt, and under ``fair`` each tenant's counter (policy.py)
        self.policy = queue_policy(policy, tenant_weights)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_admit_threshold = kv_admit_threshold  # None: admit while blocks last
        self.groups: deque[GroupJob] = deque()  # groups not started, in run order
        self._prefix_groups: list[GroupJob] = []  # groups whose leader computes the prefix
        self._group_of: dict[Sequence, GroupJob] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # digest of a prompt block -> the running sequence that will compute it
        self._in_flight = PromptsInFlight()

    # the hooks, read-only: given at construction, never assigned afterwards
    @property
    def hooks(self) -> SchedulerHooks:
        return self._hooks

    @property
    def reclaim(self) -> Callable[[Sequence, bool], int] | None:
        return self._hooks.reclaim

    @property
    def ready(self) -> Callable[[Sequence], bool] | None:
        return self._hooks.ready

    @property
    def refuse(self) -> Callable[[Sequence, str], None] | None:
        return self._hooks.refuse

    @property
    def speculate(self) -> Speculate | None:
        return self._hooks.speculate

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Is the first block this sequence would compute already being computed by another one?

        Requests that share a prompt and arrive together then compute it once: the first computes,
        the rest wait a step and find it in the prefix cache (and hold the very same blocks).
        """
        index = seq.num_computed_tokens // self.blocks.block_size
        if index >= self.blocks.cacheable_blocks(seq):
            return False
        digest = self.blocks.digests(seq, index + 1)[index]
        holder = self._in_flight.holder(digest)
        if holder is None or holder is seq:
            return False
        if not self.blocks.is_cached(digest):
            return True
        # cached, but a request that needs every prompt row's result (its keeper's) cannot take it
        # until they are kept: it waits for a holder that keeps them, never for one that does not
        return self.blocks.keeps_for(seq, holder) and not self.blocks.can_hit(seq, digest)

    def _mark_in_flight(self, seq: Sequence) -> None:
        full = self.blocks.cacheable_blocks(seq)
        start = seq.num_computed_tokens // self.blocks.block_size
        self._in_flight.mark(seq, self.blocks.digests(seq, full)[start:])

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.policy.enqueue(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (it already holds blocks)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def add_group(self, job: GroupJob) -> None:
        """Queue a prefix-sharing group; its members wait in it until the group starts."""
        for seq in job.members:
            seq.status = SeqStatus.WAITING
            self._group_of[seq] = job
        self.groups.append(job)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.groups or self._prefix_groups)

    @property
    def held_group_blocks(self) -> int:
        """Blocks the running groups hold for their prefixes (not counting members' own holds)."""
        return sum(len(job.held) for job in set(self._group_of.values()))

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and return its blocks to the pool."""
        try:
            self.running.remove(seq)  # one scan of the list, not two
        except ValueError:
            if seq in self.waiting:
                self.waiting.remove(seq)
        self.blocks.free(seq)
        self._in_flight.forget(seq)
        seq.status = SeqStatus.FINISHED
        job = self._group_of.pop(seq, None)
        if job is not None:
            job.member_finished(seq, self.blocks.pool)

    def check_stop(self, seq: Sequence, eos_ids: set[int], max_model_len: int, tokenizer: Any) -> None:
        """Finish ``seq`` if its last token stops it (EOS, stop id or string, length)."""
        reason = stop_reason(seq, eos_ids, max_model_len, tokenizer)
        if reason is not None:
            seq.finish_reason = reason
            self.finish(seq)

    def update_from_output(
        self,
        samplers: list[Sequence],
        indices: list[int],
        result: SampleResult,
        pending: dict[Sequence, list[tuple[int, Any, int]]],
        eos_ids: set[int],
        max_model_len: int,
        tokenizer: Any,
        counters: Counter[str],
        index_on_arrival: bool,
    ) -> None:
        """Put each sampled token in place of its placeholder and check whether the sequence stops.

        ``samplers[i]`` sampled row i; its placeholder sits at ``indices[i]`` of its token ids, and
        ``pending`` holds each sequence's placeholders still waiting, oldest first (the engine's
        in-flight bookkeeping, ``engine/in_flight.py``). ``index_on_arrival`` (launch-ahead): the
        block a token fills was computed at the next launch, so it is indexed now.

        Once per sequence per step, so the loop reads attributes directly, bumps the generated-tokens
        counter once, and calls ``check_stop`` only where ``stop_reason`` could return a reason (or
        search stop strings): its own conditions without the token and text lookups that decide
        most of them (``stop.stop_possible``), so the result is the same as calling it every time.
        """
        now = time.monotonic()
        tokens_out = result.tokens
        want_logprobs = result.logprobs is not None
        generated = 0
        try:
            for i, seq in enumerate(samplers):
                held = pending.get(seq)
                idx = indices[i]
                if not held or held[0][0] != idx or seq.status is SeqStatus.FINISHED:
                    continue  # aborted, failed or stopped while in flight (its placeholders are gone)
                if len(held) == 1:
                    del pending[seq]
                else:
                    held.pop(0)
                token_ids = seq.token_ids
                token_ids[idx] = tokens_out[i]
                req = seq.request
                p = req.params
                if want_logprobs and p.wants_chosen_logprobs:
                    seq.output_logprobs.append(result.logprobs[i])
                    seq.output_top_logprobs.append(result.top_logprobs[i] if result.top_logprobs else [])
                req.unreported += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                generated += 1
                if index_on_arrival:  # the block this token fills was computed at the next launch
                    self.blocks.register_computed(seq, idx + 1)
                if stop_possible(seq, eos_ids, max_model_len):
                    self.check_stop(seq, eos_ids, max_model_len, tokenizer)
        finally:
            if generated:
                counters["generation_tokens_total"] += generated

    def put_back(self, seqs: list[Sequence]) -> None:
        """Running sequences planned for a step that never went out (launch-ahead: the sampling of the
        step ahead of it failed after it was planned) go back to the queue's front, in their order, as
        preempted ones: their blocks (and whatever the plan reserved or copied for them) are freed, and
        admitted again they recompute. Those no longer running (failed meanwhile) are left alone."""
        out = SchedulerOutput()
        for seq in reversed(seqs):  # each goes to the front: the first planned ends up first
            if seq.status is SeqStatus.RUNNING:
                self._preempt(seq, out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self._in_flight.forget(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.policy.requeue(self.waiting, seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        speculate = self._hooks.speculate
        if speculate is not None:
            speculate.propose(self.running, budget)
        # Running sequences, in order: running[:i] are scheduled. This loop runs once per sequence per
        # step (B times at batch B), so it reads attributes directly and keeps to one call each.
        running, scheduled, copies = self.running, out.scheduled, out.copies
        reserve = self.blocks.reserve
        bs, ref_counts = self.blocks.block_size, self.blocks.pool.ref_counts
        # the freeing KV layout: how far a sequence's sliding pages reach (a long prompt's blocks are
        # taken ahead, its sliding pages chunk by chunk)
        covered = self.blocks.sliding.covered_tokens if self.blocks.sliding is not None else None
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            n = min(len(seq.token_ids) - computed, budget)
            table = seq.block_table
            if (
                computed < computed + n <= len(table) * bs
                and ref_counts[table[computed // bs]] < 2
                and (covered is None or computed + n <= covered(seq))
            ):
                # ``reserve``'s first case, inlined (most decode steps): the new tokens fit the blocks
                # held and the block written is not shared, so there is nothing to reserve or copy
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            while not reserve(seq, computed + n, copies):
                victim = self.policy.victim(running)
                at = len(running) - 1 if victim is running[-1] else running.index(victim)
                if at < i:  # planned for this step already (scheduled[at] is its entry): unplanned
                    budget += scheduled.pop(at).num_tokens
                    i -= 1
                    own = set(victim.block_table)  # and no copy into the blocks it gives back
                    copies[:] = [c for c in copies if c[1] not in own]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        self._advance_groups()
        budget = self._admit(out, budget)
        if not self.running and self.waiting:
            budget = self._unstick(out, budget)
        while self.groups and budget > 0 and self._room_for_more():
            self._start_group(self.groups.popleft())
            budget = self._admit(out, budget)
        if speculate is not None:
            speculate.settle(out)
        self.policy.charge(out.scheduled)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in order while the token budget, the caps and the pool allow.

        ``out.cache_hit_tokens`` (the ``prefix_cache_hit_tokens_total`` metric) counts the prompt
        tokens a sequence finds in the prefix cache at its first admission only, as vLLM's
        ``prefix_cache_hits`` counts a request's hits only while it was never preempted: a preempted
        sequence admitted again mostly takes back the blocks it computed itself, which saved it no
        prompt work, and its prompt was counted already.
        """
        deferred: list[Sequence] = []
        ready = self._hooks.ready
        self.policy.order(self.waiting)
        # a linear-attention hybrid holds a state slot per running sequence, max_num_seqs in all: a
        # sequence is admitted only where its request's samples still to fork (n > 1), and those of
        # the running requests, will find slots too (counted once a call, then kept up)
        forks = sum(_to_fork(s) for s in self.running) if self.blocks.states is not None else None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if forks is not None and len(self.running) + forks + 1 + _to_fork(seq) > self.max_num_seqs:
                self.waiting.appendleft(seq)
                break
            if ready is not None and not ready(seq):
                if seq.status is SeqStatus.FINISHED:  # ended trying (its request failed)
                    continue
                self.waiting.appendleft(seq)
                break
            hit = self.blocks.match_prefix(seq)
            if self._prefix_in_flight(seq):
                self.blocks.free(seq)  # its next blocks are being computed: take them from the cache soon
                deferred.append(seq)
                continue
            # Prompt Cache recovery rows go in the first step beside the own tokens: they count
            # against the budget, and wait for a step of their own when they do not fit beside others
            extra = seq.request.pending_recompute_tokens
            if extra and extra >= budget and budget < self.max_num_batched_tokens:
                self.blocks.free(seq)
                self.waiting.appendleft(seq)
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, max(1, budget - extra))
            if not self._under_threshold(seq, n) or not self.blocks.reserve(
                seq, seq.num_computed_tokens + n, out.copies
            ):
                self.blocks.free(seq)  # give the cache hits back; try again next step
                self.waiting.appendleft(seq)
                break
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if forks is not None:
                forks += _to_fork(seq)
            self._mark_in_flight(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            first = not seq.num_preemptions  # its first admission (see the docstring)
            if first:
                out.cache_hit_tokens += min(hit, seq.num_prompt_tokens)
            if first and seq.request.first_token_time is None and seq.index == 0 and not seq.request.forked:
                seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, hit)
                if seq.request.scheduled_time is None:
                    seq.request.scheduled_time = time.monotonic()
            budget -= n + extra
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _unstick(self, out: SchedulerOutput, budget: int) -> int:
        """Idle, yet the queue's head does not fit beside blocks held for later use: the groups' held
        prefixes (their blocks stay cached), then what ``reclaim`` lets go (the Prompt Cache holds of
        the requests waiting behind it, pieces no request holds, and last the head's own recovery
        copies). Without this the head would wait forever. A head that still does not fit never
        will: nothing but pinned blocks and its own is held. It is refused."""
        head = self.waiting[0]
        freed = False
        for job in set(self._group_of.values()):
            freed = freed or bool(job.held)
            job.let_go(self.blocks.pool)
        reclaim, refuse = self._hooks.reclaim, self._hooks.refuse
        for own in (False, True):
            if reclaim is not None:
                freed = reclaim(head, own) > 0 or freed
            if freed:
                budget = self._admit(out, budget)
            if self.running or not self.waiting or self.waiting[0] is not head:
                return budget
            freed = False
        if refuse is not None:
            refuse(head, self._why_stuck(head))
        return budget

    def _why_stuck(self, seq: Sequence) -> str:
        """The refusal's message: the numbers, and what holds the rest of the pool."""
        pool = self.blocks.pool
        need = self.blocks.pages_for(seq.num_tokens)
        return (
            f"the KV pool cannot hold this request: its {seq.num_tokens} tokens need {need} blocks of "
            f"{self.blocks.block_size} and, with nothing else running, {pool.num_free} of the pool's "
            f"{pool.num_blocks} are free; the rest hold pinned prompts (schemas registered with "
            "pin=True, or system prompts) or this request's own modules. Add KV blocks or pin less"
        )

    # ---- offline groups (BatchLLM) ---------------------------------------------------------------
    def _under_threshold(self, seq: Sequence, num_tokens: int) -> bool:
        """Memory-centric admission of group members: would this chunk keep the pool under the
        threshold? Online requests are admitted while blocks last, as before."""
        if self.kv_admit_threshold is None or not self.running or seq not in self._group_of:
            return True  # with nothing running, always make progress
        pool = self.blocks.pool
        new = self.blocks.blocks_needed(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        return pool.num_used + max(0, new) <= self.kv_admit_threshold * pool.num_blocks

    def _room_for_more(self) -> bool:
        """May another group start? Not while admitted work waits or the pool is past its threshold."""
        if self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        if not self.running:
            return True  # idle: always make progress (held prefixes alone never block a start)
        pool = self.blocks.pool
        limit = 1.0 if self.kv_admit_threshold is None else self.kv_admit_threshold
        return pool.num_used < limit * pool.num_blocks

    def _start_group(self, job: GroupJob) -> None:
        """Send the group's leader (or, with no prefix block to hold, every member) to waiting."""
        admit = job.start(self.blocks.block_size)
        if job.state is GroupState.PREFIX:
            self._prefix_groups.append(job)
            self._mark_prefix(job)
        for seq in admit:
            self.policy.enqueue(self.waiting, seq)

    def _mark_prefix(self, job: GroupJob) -> None:
        """A hybrid's group leader snapshots its linear layers' states at the group prefix's end too,
        where the other members' hits resume (``StateSlots.mark``)."""
        if self.blocks.states is not None and job.leader is not None:
            self.blocks.states.mark(job.leader, job.prefix_len)

    def _advance_groups(self) -> None:
        """Hold each group prefix that is now fully cached and release the group's other members.

        A leader that ended (aborted, or evicted from the cache) before the prefix was held hands
        the lead to the next member, so a group never waits on a sequence that will not come back."""
        bs = self.blocks.block_size
        for job in list(self._prefix_groups):
            if job.state is not GroupState.PREFIX:  # every member ended before the prefix was held
                self._prefix_groups.remove(job)
                continue
            assert job.leader is not None
            released = job.try_hold(self.blocks.pool, self.blocks.digests(job.leader, job.prefix_len // bs))
            if job.state is GroupState.READY:
                self._prefix_groups.remove(job)
                for seq in released:
                    self.policy.enqueue(self.waiting, seq)
            elif job.leader.status is SeqStatus.FINISHED and job.next_leader() is not None:
                self._mark_prefix(job)
                self.policy.enqueue(self.waiting, job.leader)
