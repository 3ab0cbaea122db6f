"""The scheduler's and block manager's host fast paths are exact, and the block-table mirror is right.

``RefBlockManager`` / ``RefScheduler`` carry the bodies these methods had before the fast paths (kept
verbatim as the reference). A model-free simulation (arrivals with shared prompts, chunked prefill,
n > 1 forks with copy-on-write, greedy siblings whose generated blocks are deduplicated, finishes,
aborts, and a pool small enough to preempt) must schedule identically, step by step, with both, and
leave the pool in the same state. Along the way the numpy mirror must equal every block table.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from prefixserve.attention.metadata import build_metadata
from prefixserve.kv.block_pool import BlockPool
from prefixserve.sampling.params import SamplingParams
from prefixserve.scheduler.block_tables import BlockManager
from prefixserve.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from prefixserve.sequence import Request, SeqStatus, Sequence


class RefBlockManager(BlockManager):
    """The block manager's methods as they were (no fast paths, no mirror)."""

    def digests(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        from prefixserve.kv.block_pool import block_digest

        bs, salt = self.block_size, seq.request.cache_salt
        digests = seq.block_digests
        for i in range(len(digests), num_full_blocks):
            parent = digests[i - 1] if i else None
            lo, hi = i * bs, (i + 1) * bs
            digests.append(block_digest(parent, seq.token_ids[lo:hi], seq.positions[lo:hi], salt))
        return digests[:num_full_blocks]

    def match_prefix(self, seq: Sequence) -> int:
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        hits = self.pool.lookup(self.digests(seq, self.cacheable_blocks(seq)))
        self.pool.acquire(hits)
        self.pool.touch(hits)
        seq.block_table = list(hits)
        seq.num_indexed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def reserve(self, seq: Sequence, upto_tokens: int, copies: list[tuple[int, int]]) -> bool:
        new_blocks = max(0, self.blocks_needed(upto_tokens) - len(seq.block_table))
        write_block = seq.num_computed_tokens // self.block_size
        cow = write_block < len(seq.block_table) and self.pool.ref_counts[seq.block_table[write_block]] > 1
        if new_blocks + int(cow) > self.pool.num_free:
            return False
        if cow:
            old = seq.block_table[write_block]
            (fresh,) = self.pool.allocate(1)
            copies.append((old, fresh))
            seq.block_table[write_block] = fresh
            self.pool.release([old])
        seq.block_table.extend(self.pool.allocate(new_blocks))
        return True

    def register_computed(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        digests = self.digests(seq, full)
        for i in range(seq.num_indexed_blocks, full):
            own = seq.block_table[i]
            existing = self.pool.lookup([digests[i]])
            if existing and existing[0] != own:
                self.pool.acquire(existing)
                self.pool.release([own])
                seq.block_table[i] = existing[0]
            else:
                self.pool.register(own, digests[i])
        seq.num_indexed_blocks = max(seq.num_indexed_blocks, full)

    def is_cached(self, digest: bytes) -> bool:
        return bool(self.pool.lookup([digest]))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.pool.acquire(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_digests = list(parent.block_digests)
        child.num_indexed_blocks = parent.num_indexed_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_indexed_blocks = 0
        seq.num_computed_tokens = 0


class RefScheduler(Scheduler):
    """``schedule`` and ``finish`` as they were."""

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.reserve(seq, seq.num_computed_tokens + n, out.copies):
                victim = self.running[-1]
                if victim.seq_id in scheduled:
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                scheduled.add(seq.seq_id)
                budget -= n
                i += 1
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            hit = self.blocks.match_prefix(seq)
            if self._prefix_in_flight(seq):
                self.blocks.free(seq)  # its next blocks are being computed: take them from the cache soon
                deferred.append(seq)
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.reserve(seq, seq.num_computed_tokens + n, out.copies):
                self.blocks.free(seq)  # give the cache hits back; try again next step
                self.waiting.appendleft(seq)
                break
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._mark_in_flight(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            first = not seq.num_preemptions  # hits of first admissions only (``Scheduler._admit``)
            if first:
                out.cache_hit_tokens += min(hit, seq.num_prompt_tokens)
            if first and seq.request.first_token_time is None and seq.index == 0 and not seq.request.forked:
                seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, hit)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return out


def simulate(
    scheduler_cls: type[Scheduler], manager_cls: type[BlockManager], seed: int, check_mirror: bool
) -> tuple[list, tuple]:
    rng = random.Random(seed)
    bs = 4
    pool = BlockPool(rng.choice([40, 64, 200]), bs)
    blocks = manager_cls(pool, True)
    sched = scheduler_cls(blocks, rng.choice([16, 48, 256]), rng.choice([4, 8, 32]))
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 24))] for _ in range(3)]
    seqs: list[Sequence] = []
    trace = []
    next_id = 0
    dedups = 0
    for _ in range(160):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            params = SamplingParams(n=rng.choice([1, 1, 3]), max_tokens=rng.randrange(1, 30))
            greedy = rng.random() < 0.5  # siblings generate the same tokens: their blocks deduplicate
            req = Request(f"r{next_id}", None, prompt, list(range(len(prompt))), params)
            req.stream = greedy  # (reused as a flag: tokens depend only on the position)
            seq = Sequence(next_id, req, 0, list(prompt), list(range(len(prompt))))
            next_id += 1
            req.sequences.append(seq)
            seqs.append(seq)
            sched.add(seq)
        out = sched.schedule()
        trace.append(
            (
                [(s.seq.seq_id, s.num_tokens) for s in out.scheduled],
                list(out.copies),
                [p.seq_id for p in out.preempted],
                out.cache_hit_tokens,
            )
        )
        if check_mirror:
            check_batch_tables(blocks, out)
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            before = list(seq.block_table)
            blocks.register_computed(seq)
            dedups += before != seq.block_table  # switched to a block another sequence registered
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            req = seq.request
            targets = [seq]
            if req.params.n > 1 and not req.forked:
                req.forked = True
                for index in range(1, req.params.n):
                    child = Sequence(next_id, req, index, list(seq.token_ids), list(seq.positions))
                    next_id += 1
                    req.sequences.append(child)
                    seqs.append(child)
                    blocks.fork(seq, child)
                    sched.add_running(child)
                    targets.append(child)
            for t in targets:
                token = (7 * t.num_tokens) % 50 if req.stream else rng.randrange(50)
                t.append_token(token)
                if t.num_tokens - t.num_prompt_tokens >= req.params.max_tokens or rng.random() < 0.02:
                    sched.finish(t)
        if rng.random() < 0.05:  # an abort of a random live sequence (running or waiting)
            live = [s for s in seqs if s.status is not SeqStatus.FINISHED]
            if live:
                sched.finish(rng.choice(live))
        if check_mirror:
            blocks.check_tables()
            pool.check_integrity()
    state = (list(pool.ref_counts), list(pool._free), dict(pool._block_of), pool.evictions)
    trace.append(dedups)
    return trace, state


def check_batch_tables(blocks: BlockManager, out: SchedulerOutput) -> None:
    """block_tables_np of a batch equals the zero-padded tables cut to each sequence's needs."""
    if not out.scheduled:
        return
    seqs = [s.seq for s in out.scheduled]
    lens = [s.seq.num_computed_tokens + s.num_tokens for s in out.scheduled]
    lists = [seq.block_table[: blocks.blocks_needed(n)] for seq, n in zip(seqs, lens, strict=True)]
    got = blocks.block_tables_np(seqs, lens)
    want = build_metadata(blocks.block_size, [1] * len(seqs), lens, lists, "cpu").block_tables_np
    assert got.dtype == np.int32 and np.array_equal(got, want)


@pytest.mark.parametrize("seed", range(12))
def test_schedules_match_the_reference(seed: int) -> None:
    want_trace, want_state = simulate(RefScheduler, RefBlockManager, seed, check_mirror=False)
    got_trace, got_state = simulate(Scheduler, BlockManager, seed, check_mirror=True)
    assert sum(len(t[0]) for t in got_trace[:-1]) > 50  # the workload did something
    assert got_trace == want_trace
    assert got_state == want_state


def test_workload_exercises_preemption_cow_and_dedup() -> None:
    seen = {"preempted": 0, "copies": 0, "dedups": 0}
    for seed in range(12):
        trace, _ = simulate(Scheduler, BlockManager, seed, check_mirror=False)
        seen["dedups"] += trace.pop()
        seen["preempted"] += sum(len(t[2]) for t in trace)
        seen["copies"] += sum(len(t[1]) for t in trace)
    assert seen["preempted"] > 0 and seen["copies"] > 0 and seen["dedups"] > 0, seen


def test_block_tables_np_cuts_long_tables_and_refuses_short_ones() -> None:
    pool = BlockPool(64, 4)
    blocks = BlockManager(pool)
    req = Request("r", None, list(range(10)), list(range(10)), SamplingParams())
    a = Sequence(0, req, 0, list(range(10)), list(range(10)))
    b = Sequence(1, req, 0, list(range(10)), list(range(10)))
    assert blocks.reserve(a, 10, []) and blocks.reserve(b, 4, [])
    got = blocks.block_tables_np([a, b], [5, 4])  # a holds 3 blocks, needs 2; b holds and needs 1
    assert got.tolist() == [a.block_table[:2], [b.block_table[0], 0]]
    with pytest.raises(ValueError, match="needs"):
        blocks.block_tables_np([b], [9])
    blocks.free(a)
    blocks.check_tables()
    with pytest.raises(ValueError, match="needs"):
        blocks.block_tables_np([a], [1])
    many = [Sequence(10 + i, req, 0, [1], [0]) for i in range(40)]  # grows the mirror's rows
    for s in many:
        assert blocks.reserve(s, 1, [])
    blocks.check_tables()
    assert blocks.block_tables_np(many, [1] * 40)[:, 0].tolist() == [s.block_table[0] for s in many]
