"""Prefix-sharing group scheduling (BatchLLM 3.3) on the real scheduler and block pool, no model.

A fake step loop stands in for the engine: a scheduled chunk is "computed" at once, a sequence whose
prompt is done gains one token per step, and it finishes after ``max_tokens``.
"""

from __future__ import annotations

import random

from prefixserve.kv.block_pool import BlockPool
from prefixserve.sampling.params import SamplingParams
from prefixserve.scheduler.block_tables import BlockManager
from prefixserve.scheduler.groups import GroupJob, GroupState
from prefixserve.scheduler.prefix_tree import (
    build_tree,
    enlarge_first_level,
    first_level_groups,
    order_groups,
)
from prefixserve.scheduler.scheduler import Scheduler
from prefixserve.sequence import Request, SeqStatus, Sequence

BS = 4


def _seq(i: int, prompt: list[int], max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    req = Request(f"r{i}", None, list(prompt), list(range(len(prompt))), params)
    seq = Sequence(i, req, 0, list(prompt), list(range(len(prompt))))
    req.sequences.append(seq)
    return seq


def _compute(sched: Scheduler, scheduled: list) -> int:
    """Compute one step's chunks at once; returns the prompt tokens among them."""
    computed_prompt = 0
    for item in scheduled:
        seq = item.seq
        computed_prompt += max(
            0,
            min(seq.num_prompt_tokens, seq.num_computed_tokens + item.num_tokens) - seq.num_computed_tokens,
        )
        seq.num_computed_tokens += item.num_tokens
        sched.blocks.register_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            if seq.num_tokens - seq.num_prompt_tokens >= seq.request.params.max_tokens:
                sched.finish(seq)
            else:
                seq.append_token(7)
    return computed_prompt


def _run(sched: Scheduler, seqs: list[Sequence], on_step=None) -> tuple[int, list[list[Sequence]]]:
    """Step until done; returns prompt tokens computed and each step's admitted sequences."""
    computed_prompt = 0
    admitted: list[list[Sequence]] = []
    seen: set[int] = set()
    for _ in range(10_000):
        if not sched.has_work():
            break
        out = sched.schedule()
        admitted.append([s.seq for s in out.scheduled if s.seq.seq_id not in seen])
        seen.update(s.seq.seq_id for s in out.scheduled)
        computed_prompt += _compute(sched, out.scheduled)
        if on_step is not None:
            on_step(sched)
    assert not sched.has_work()
    return computed_prompt, admitted


def _dataset(seed: int, groups: int, members: int, prefix: int, distinct: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        head = [1000 * (g + 1) + j for j in range(prefix)]
        prompts += [head + [rng.randrange(50000, 60000) for _ in range(distinct)] for _ in range(members)]
    rng.shuffle(prompts)
    return prompts


def _grouped(prompts: list[list[int]], max_tokens: int) -> tuple[list[Sequence], list[GroupJob]]:
    seqs = [_seq(i, p, max_tokens) for i, p in enumerate(prompts)]
    groups = order_groups(first_level_groups(enlarge_first_level(build_tree(prompts))))
    jobs = [GroupJob(members=[seqs[i] for i in g.members], prefix_len=len(g.prefix)) for g in groups]
    return seqs, jobs


def test_groups_compute_each_prefix_once_under_memory_pressure_and_leak_nothing():
    prompts = _dataset(0, groups=6, members=5, prefix=24, distinct=6)
    # A pool too small for every group's prefix at once: FCFS with LRU recomputes shared prefixes.
    fcfs = Scheduler(BlockManager(BlockPool(40, BS)), max_num_batched_tokens=32, max_num_seqs=8)
    fcfs_seqs = [_seq(i, p, 3) for i, p in enumerate(prompts)]
    for s in fcfs_seqs:
        fcfs.add(s)
    fcfs_tokens, _ = _run(fcfs, fcfs_seqs)

    sched = Scheduler(BlockManager(BlockPool(40, BS)), 32, 8, kv_admit_threshold=0.9)
    seqs, jobs = _grouped(prompts, 3)
    for job in jobs:
        sched.add_group(job)
    held_seen = []
    tokens, admitted = _run(sched, seqs, on_step=lambda s: held_seen.append(s.held_group_blocks))
    # Each group: its leader computes its whole prompt, every other member only its distinct part.
    bound = sum(len(p) for p in prompts) - sum((len(j.members) - 1) * 24 for j in jobs)
    assert tokens == bound < fcfs_tokens
    assert max(held_seen) > 0 and held_seen[-1] == 0  # prefixes were held, and released at the end
    assert all(j.state is GroupState.DONE for j in jobs)
    pool = sched.blocks.pool
    pool.check_integrity()
    assert pool.num_used == 0
    # The leader runs before any other member of its group.
    step_of = {s.seq_id: k for k, step in enumerate(admitted) for s in step}
    for job in jobs:
        assert all(step_of[m.seq_id] > step_of[job.members[0].seq_id] for m in job.members[1:])


def test_distinct_prompts_go_before_the_next_groups_prefix():
    prompts = _dataset(1, groups=4, members=4, prefix=16, distinct=4)
    sched = Scheduler(BlockManager(BlockPool(256, BS)), 48, 64)
    seqs, jobs = _grouped(prompts, 4)
    for job in jobs:
        sched.add_group(job)
    _, admitted = _run(sched, seqs)
    leaders = {j.members[0].seq_id for j in jobs}
    steps = [[s.seq_id in leaders for s in step] for step in admitted]
    for kinds in steps:
        assert kinds == sorted(kinds)  # a step admits waiting members first, then starts new prefixes
    assert any(len(set(kinds)) == 2 for kinds in steps)  # and some step does both
    group_of = {m.seq_id: k for k, j in enumerate(jobs) for m in j.members}
    starts = [group_of[s.seq_id] for step in admitted for s in step if s.seq_id in leaders]
    assert starts == sorted(starts)  # groups start in their (Eq. 3) order


def test_leader_aborted_before_the_prefix_is_held_hands_the_lead_on():
    prompts = [[5] * 16 + [i, i + 1] for i in range(4)]
    sched = Scheduler(BlockManager(BlockPool(64, BS)), max_num_batched_tokens=8, max_num_seqs=8)
    seqs, jobs = _grouped(prompts, 2)
    (job,) = jobs
    sched.add_group(job)
    sched.schedule()  # the leader takes its first 8-token chunk
    first = job.leader
    assert first is not None and first.status is SeqStatus.RUNNING
    sched.finish(first)  # aborted mid-prefix
    _run(sched, seqs)
    assert job.state is GroupState.DONE
    assert sched.blocks.pool.num_used == 0
    sched.blocks.pool.check_integrity()


def test_every_member_aborted_before_the_group_starts():
    prompts = [[5] * 16 + [i] for i in range(3)] + [[9] * 16 + [i] for i in range(3)]
    sched = Scheduler(BlockManager(BlockPool(64, BS)), 64, 8)
    seqs, jobs = _grouped(prompts, 1)
    for job in jobs:
        sched.add_group(job)
    for m in jobs[-1].members:
        sched.finish(m)
    _run(sched, seqs)
    assert all(j.state is GroupState.DONE for j in jobs)
    assert sched.blocks.pool.num_used == 0


def test_an_idle_scheduler_lets_a_groups_hold_go_for_a_head_that_needs_the_pool():
    """A sequence that needs the whole pool waits at the head of the queue while a group holds its
    prefix block and nothing runs: the hold goes (the block stays cached) and every sequence ends."""
    members = [_seq(1 + i, [5] * 4 + [i], max_tokens=2) for i in range(2)]
    long = _seq(0, [3] * 20, max_tokens=4)  # 24 tokens: all 6 blocks of the pool
    sched = Scheduler(BlockManager(BlockPool(6, BS)), max_num_batched_tokens=32, max_num_seqs=2)
    job = GroupJob(members=members, prefix_len=4)
    sched.add_group(job)
    _compute(sched, sched.schedule().scheduled)  # the leader computes the prefix
    sched.finish(members[0])
    sched.add(long)  # heads the queue: the group's second member is released behind it
    held = []
    _run(sched, [long, *members], on_step=lambda s: held.append(s.held_group_blocks))
    assert held[0] == 1 and sched.num_preemptions > 0  # it was held when the long sequence needed it
    assert long.is_finished and members[1].is_finished
    assert job.state is GroupState.DONE and sched.held_group_blocks == 0
    assert sched.blocks.pool.num_used == 0
    sched.blocks.pool.check_integrity()
