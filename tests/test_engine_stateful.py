"""Stateful fuzzing of one engine: random interleavings of adds, aborts, steps and prefix-cache resets.

The other engine tests each drive one scenario (a preemption, an abort in flight, a fork). This one lets
Hypothesis mix them on one small engine (cascade attention, a pool small enough to preempt, prefill
chunks small enough to split prompts, launch-ahead on or off) with prompts built from a few shared
prefixes, so prefix-cache hits, shared-segment attention, forks, stops and aborts meet in the same
steps. What must hold whatever the order:

* every request ends exactly once (an abort with ``finish_reason`` "abort"), streamed outputs are
  prefixes of the final one, nothing ends with "error", and the engine drains to an empty pool;
* the pool's ref counts are exactly the live sequences' block tables after every rule;
* lengths respect ``max_tokens``, ``min_tokens`` and the stop ids;
* a greedy or seeded request gives the tokens (and text) of the same request run alone on a plain
  engine (reference attention, no prefix cache, no preemption, no launch-ahead); an aborted one a
  prefix of them.
"""

from __future__ import annotations

import json
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prefixserve import LLM, SamplingParams
from prefixserve.engine import PLACEHOLDER_TOKEN
from prefixserve.kv.block_pool import chain_digests
from prefixserve.scheduler.batch_queue import queue_groups
from prefixserve.sequence import SeqStatus
from tests.conftest import TINY_CONFIG, assert_pool_empty

EOS = 2  # TINY_CONFIG's eos_token_id
MAX_TOKENS = 24
DRAIN_STEPS = 3000  # far more than the largest workload needs: reaching it means a stuck request

SMALL_VOCAB = 96  # the tiny model over ids < 96: its greedy outputs loop, so ngram drafts are proposed
_rng = random.Random(20240611)  # and kept, and EOS comes up on its own; every prompt id is below 96
_BASE = [_rng.randrange(20, SMALL_VOCAB) for _ in range(100)]
_OTHER = [_rng.randrange(20, SMALL_VOCAB) for _ in range(80)]
# nested and unrelated prefixes, ending inside a block and on block edges (block sizes 4 and 16)
PREFIXES = [(), tuple(_BASE[:16]), tuple(_BASE[:37]), tuple(_BASE[:64]), tuple(_BASE[:100]), tuple(_OTHER)]

# the oracle: one plain engine per tiny config, and its outputs per (prompt, params)
_REFERENCE: dict[Path, LLM] = {}
_MEMO: dict[tuple, list[dict]] = {}


def _reference(config: Path, prompt: tuple[int, ...], params: SamplingParams) -> list[dict]:
    """What each sample of ``prompt`` gives run alone: ids, text, reasons, logprobs."""
    key = (config, prompt, repr(params))
    if key not in _MEMO:
        if config not in _REFERENCE:
            _REFERENCE[config] = LLM(
                model=f"dummy:{config}",
                device="cpu",
                dtype="float32",
                attention="reference",
                enable_prefix_caching=False,
                num_kv_blocks=256,
                async_scheduling=False,
                progress=False,
            )
        llm = _REFERENCE[config]
        out = llm.generate({"prompt_token_ids": list(prompt)}, params)[0]
        _MEMO[key] = [
            {
                "ids": list(c.token_ids),
                "text": c.text,
                "reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": c.token_logprobs,
                "prompt_logprobs": out.prompt_token_logprobs,
            }
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        assert_pool_empty(llm)
    return _MEMO[key]


def _check_digests(engine, req) -> None:
    """Each sequence's digests are those of its tokens now, and its indexed blocks are in the index
    under them: a stale digest would index a block's KV under tokens it does not hold."""
    bs = engine.blocks.block_size
    for seq in req.sequences:
        digests = seq.block_digests
        if not digests:
            continue
        end = len(digests) * bs
        ids, places = list(seq.token_ids[:end]), list(seq.positions[:end])
        assert len(ids) == end and PLACEHOLDER_TOKEN not in ids, (req.request_id, "digest over a placeholder")
        want = chain_digests(None, ids, places, req.cache_salt, bs)
        assert digests == want, f"{req.request_id}: stale block digests"
        for i in range(min(seq.num_indexed_blocks, len(seq.block_table))):
            held = engine.pool.digest_of(seq.block_table[i])
            assert held is None or held == digests[i], f"{req.request_id}: block {i} indexed as other tokens"


@dataclass
class Tracked:
    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    stream: bool
    aborted: bool = False
    streamed: list = field(default_factory=list)  # the non-final outputs
    final: object = None


class EngineMachine(RuleBasedStateMachine):
    configs: dict[str, Path]  # set by the test function: the tiny model, and the same over 96 ids

    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None
        self.by_id: dict[str, deque[Tracked]] = {}  # request id -> its requests still to end, in order
        self.done: list[Tracked] = []
        self.serial = 0
        self.broken = False

    # ---- set-up -------------------------------------------------------------------------------
    @initialize(
        vocab=st.sampled_from(["small", "small", "full"]),
        mode=st.sampled_from(["sync", "async", "speculative", "speculative"]),
        drafts=st.sampled_from([1, 3, 5]),
        disable_above=st.sampled_from([None, None, 2]),
        block_size=st.sampled_from([4, 16]),
        pool_tokens=st.sampled_from([320, 448, 768]),
        max_batched=st.sampled_from([16, 40, 96]),
        max_seqs=st.sampled_from([3, 256]),
        policy=st.sampled_from(["fcfs", "priority"]),
        spill=st.booleans(),
        stream_interval=st.sampled_from([1, 3]),
    )
    def build(
        self,
        vocab,
        mode,
        drafts,
        disable_above,
        block_size,
        pool_tokens,
        max_batched,
        max_seqs,
        policy,
        spill,
        stream_interval,
    ) -> None:
        self.policy = policy
        self.config_path = self.configs[vocab]
        async_scheduling = mode == "async"
        spec = None
        if mode == "speculative":  # prompt lookup: the small suffix alphabet and greedy loops repeat
            spec = {
                "method": "ngram",
                "num_speculative_tokens": drafts,
                "disable_by_batch_size": disable_above,
            }
        self.llm = LLM(
            model=f"dummy:{self.config_path}",
            device="cpu",
            dtype="float32",
            attention="cascade",
            block_size=block_size,
            num_kv_blocks=pool_tokens // block_size,
            max_num_batched_tokens=max_batched,
            max_num_seqs=max_seqs,
            async_scheduling=async_scheduling,
            scheduling_policy=policy,
            spill_prefix_cache=spill,
            stream_interval=stream_interval,
            speculative_config=spec,
            progress=False,
        )
        self.engine = self.llm.engine
        assert self.engine.launch_ahead is async_scheduling

    # ---- rules --------------------------------------------------------------------------------
    @rule(data=st.data(), count=st.integers(1, 4))
    def add(self, data, count: int) -> None:
        for _ in range(count):
            prompt, params, kw = self._draw_request(data)
            rid = self._new_id(data)
            self.engine.add_request(rid, prompt_token_ids=list(prompt), params=params, **kw)
            self.by_id.setdefault(rid, deque()).append(Tracked(rid, prompt, params, kw["stream"]))

    @rule(data=st.data(), count=st.integers(2, 5))
    def add_group(self, data, count: int) -> None:
        """An offline batch's requests, queued as prefix-sharing groups (``schedule="batch"``)."""
        reqs = []
        for _ in range(count):
            prompt, params, kw = self._draw_request(data)
            self.serial += 1
            rid = f"g{self.serial}"
            reqs.append(
                self.engine.add_request(rid, prompt_token_ids=list(prompt), params=params, queue=False, **kw)
            )
            self.by_id.setdefault(rid, deque()).append(Tracked(rid, prompt, params, kw["stream"]))
        queue_groups(self.engine, reqs, data.draw(st.sampled_from(["first_level", "tree"]), label="grouping"))

    def _draw_request(self, data) -> tuple[tuple[int, ...], SamplingParams, dict]:
        prefix = data.draw(st.sampled_from(PREFIXES), label="prefix")
        suffix = data.draw(st.lists(st.integers(20, 25), min_size=0 if prefix else 1, max_size=20))
        prompt = prefix + tuple(suffix)
        kind = data.draw(st.sampled_from(["greedy", "greedy", "greedy_n", "seeded"]), label="kind")
        n = 1 if kind == "greedy" else data.draw(st.integers(1 if kind == "seeded" else 2, 3), label="n")
        max_tokens = data.draw(st.integers(1, MAX_TOKENS), label="max_tokens")
        plain = _reference(self.config_path, prompt, _PLAIN)[0]
        stop_ids: list[int] = []
        if data.draw(st.booleans(), label="stop ids"):
            # ids the greedy continuation does produce, so stops do happen (and EOS, rarely chosen)
            stop_ids = data.draw(
                st.lists(st.sampled_from(plain["ids"] + [EOS]), min_size=1, max_size=3, unique=True)
            )
        stop: list[str] = []
        text = plain["text"]
        if text and data.draw(st.integers(0, 3), label="stop strings") == 0:
            at = data.draw(st.integers(0, len(text) - 1), label="stop at")
            stop = [text[at : at + data.draw(st.integers(1, 3), label="stop len")]]
        extra: dict = {}
        processing = data.draw(st.sampled_from(["none", "none", "none", "repetition", "presence", "bias"]))
        if processing == "repetition":
            extra["repetition_penalty"] = 1.3
        elif processing == "presence":
            extra.update(presence_penalty=0.8, frequency_penalty=-0.4)
        elif processing == "bias":
            extra["logit_bias"] = {data.draw(st.sampled_from(plain["ids"]), label="biased"): -30.0}
        params = SamplingParams(
            n=n,
            temperature=0.0 if kind != "seeded" else data.draw(st.sampled_from([0.7, 1.5]), label="temp"),
            seed=None if kind != "seeded" else data.draw(st.integers(0, 3), label="seed"),
            max_tokens=max_tokens,
            min_tokens=data.draw(
                st.sampled_from([0, 0, 0, 1, max_tokens // 2, max_tokens]), label="min_tokens"
            ),
            stop_token_ids=stop_ids,
            stop=stop or None,
            include_stop_str_in_output=bool(stop) and data.draw(st.booleans(), label="include stop"),
            ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
            logprobs=data.draw(st.sampled_from([None, None, 0, 2]), label="logprobs"),
            prompt_logprobs=data.draw(st.sampled_from([None, None, None, 0, 3]), label="prompt_logprobs"),
            **extra,
        )
        kw = {
            "stream": data.draw(st.booleans(), label="stream"),
            "cache_salt": data.draw(st.sampled_from([None, None, "salt"]), label="salt"),
            "priority": data.draw(st.integers(0, 2), label="priority") if self.policy == "priority" else 0,
        }
        return prompt, params, kw

    def _new_id(self, data) -> str:
        """A fresh id, or now and then the id of an aborted request whose old self is still in flight."""
        reusable = sorted(r for r, q in self.by_id.items() if q and all(t.aborted for t in q))
        if reusable and data.draw(st.integers(0, 3), label="reuse") == 0:
            return data.draw(st.sampled_from(reusable), label="reused id")
        self.serial += 1
        return f"r{self.serial}"

    def _add_with_an_id_in_use_is_refused(self, data) -> None:
        if not self._live():
            return
        rid = data.draw(st.sampled_from(self._live()), label="id in use")
        before = len(self.engine.scheduler.waiting)
        try:
            self.engine.add_request(rid, prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))
        except ValueError:
            pass
        else:
            raise AssertionError(f"a second request {rid!r} was accepted")
        assert len(self.engine.scheduler.waiting) == before

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(self._live()), label="abort id")
        assert self.engine.abort(rid), f"{rid} is live but abort found nothing"
        self._live_tracked(rid).aborted = True

    @rule(n=st.integers(1, 8))
    def step(self, n: int) -> None:
        for _ in range(n):
            self._take(self.engine.step())

    @rule(data=st.data())
    def now_and_then(self, data) -> None:
        """The rarer moves, one rule so that adds, steps and aborts make most of a run."""
        move = data.draw(st.sampled_from(["drain", "reset", "reset", "refuse", "unknown"]), label="move")
        if move == "drain":
            self._drain()
            assert_pool_empty(self.llm)
        elif move == "reset":
            assert self.engine.reset_prefix_cache() is (not self.engine.requests)
        elif move == "refuse":
            self._add_with_an_id_in_use_is_refused(data)
        else:
            assert not self.engine.abort("never-added")

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def blocks_are_held_by_live_sequences(self) -> None:
        if self.llm is None:
            return
        engine = self.engine
        engine.pool.check_integrity()
        engine.blocks.check_tables()
        sched = engine.scheduler
        placed = set(sched.running) | set(sched.waiting)
        for job in [*sched.groups, *sched._prefix_groups]:
            placed.update(job.pending)
        for req in engine.requests.values():
            for seq in req.sequences:  # every unfinished sequence is somewhere the scheduler looks
                assert seq.status is SeqStatus.FINISHED or seq in placed, (
                    f"{req.request_id} sample {seq.index} is {seq.status.name} but neither running, "
                    "waiting nor in a group"
                )
        holds: Counter[int] = Counter()
        for req in engine.requests.values():
            for seq in req.sequences:
                if seq.status is SeqStatus.FINISHED or seq.status is SeqStatus.WAITING:
                    assert not seq.block_table, f"{req.request_id} holds blocks while {seq.status}"
                holds.update(seq.block_table)
            _check_digests(engine, req)
        for job in set(engine.scheduler._group_of.values()):
            holds.update(job.held)  # an offline group's hold on its prefix
        counts = engine.pool.ref_counts
        wrong = {b: (counts[b], holds[b]) for b in range(len(counts)) if counts[b] != holds[b]}
        assert not wrong, f"block: (ref count, holders) disagree: {wrong}"
        assert set(engine.requests) <= set(self._pending_ids())

    # ---- helpers ------------------------------------------------------------------------------
    def _live(self) -> list[str]:
        return sorted(self.engine.requests) if self.llm is not None else []

    def _live_tracked(self, rid: str) -> Tracked:
        return self.by_id[rid][-1]  # the engine's request under an id is the last one added

    def _pending_ids(self) -> list[str]:
        return [r for r, q in self.by_id.items() if q]

    def _take(self, outputs) -> None:
        for out in outputs:
            queue = self.by_id.get(out.request_id)
            assert queue, f"output for {out.request_id}, which has no request to end"
            t = queue[0]
            if not out.finished:
                assert t.stream, f"{t.rid}: a progress output of a request that does not stream"
                t.streamed.append(out)
                continue
            queue.popleft()
            t.final = out
            self.done.append(t)
            try:
                self._check(t)
            except BaseException:
                self.broken = True  # no draining in teardown: it would only report the same thing again
                raise

    def _drain(self) -> None:
        for _ in range(DRAIN_STEPS):
            if not self.engine.has_unfinished():
                break
            self._take(self.engine.step())
        assert not self.engine.has_unfinished(), f"stuck: {sorted(self.engine.requests)}"
        left = {r: [t.aborted for t in q] for r, q in self.by_id.items() if q}
        assert not left, f"requests that never ended: {left}"

    def _check(self, t: Tracked) -> None:
        out, p = t.final, t.params
        where = f"{t.rid} (prompt of {len(t.prompt)}, {p}, stream={t.stream}, aborted={t.aborted})"
        assert list(out.prompt_token_ids) == list(t.prompt), where
        assert sorted(c.index for c in out.outputs) == list(range(p.n)), where
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        ref = None
        # a seeded sample is the reference's except under speculation: there each speculated row draws
        # from the generator (a rejected draft's row too), so the draws shift; only the distribution holds
        if p.temperature == 0.0 or (p.seed is not None and self.engine.config.speculative_config is None):
            ref = _reference(self.config_path, t.prompt, p)
        for c in out.outputs:
            ids = list(c.token_ids)
            assert PLACEHOLDER_TOKEN not in ids, where
            assert c.finish_reason in ("stop", "length", "abort"), (where, c.finish_reason, out.error)
            assert len(ids) <= p.max_tokens, where
            if c.finish_reason == "abort":
                assert t.aborted, where
            if c.finish_reason == "length":
                assert len(ids) == p.max_tokens, where
            by_id = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
            if by_id:
                assert len(ids) > p.min_tokens and ids[-1] in stops, (where, ids)
                want = None if (not p.ignore_eos and ids[-1] == EOS) else ids[-1]
                assert c.stop_reason == want, (where, c.stop_reason)
            elif c.finish_reason == "stop":
                assert c.stop_reason in p.stop and len(ids) > p.min_tokens, (where, c.stop_reason)
            body = ids[:-1] if by_id else ids
            assert not stops & set(body), (where, ids)  # an earlier stop would have ended it
            if p.logprobs is not None:
                assert len(c.logprobs) == len(ids), where
            if ref is not None:
                r = ref[c.index]
                if c.finish_reason == "abort":
                    assert ids == r["ids"][: len(ids)], (where, ids, r["ids"])
                else:
                    got = (ids, c.finish_reason, c.stop_reason, c.text)
                    assert got == (r["ids"], r["reason"], r["stop_reason"], r["text"]), (where, got, r)
                    if p.logprobs is not None:
                        assert c.token_logprobs == pytest.approx(r["logprobs"], abs=1e-3), where
        if p.prompt_logprobs is not None:
            want = _reference(self.config_path, t.prompt, p)[0]["prompt_logprobs"]
            got = out.prompt_token_logprobs
            if got is None and t.aborted:
                return  # aborted before its prompt was done: nothing to report
            assert got is not None and got[0] is None and want[0] is None and len(got) == len(t.prompt), where
            assert got[1:] == pytest.approx(want[1:], abs=1e-3), where
        finals = {c.index: c for c in out.outputs}
        for s in t.streamed:
            for c in s.outputs:
                final = finals[c.index]
                assert list(c.token_ids) == list(final.token_ids)[: len(c.token_ids)], where
                assert final.text.startswith(c.text), (where, c.text, final.text)

    def teardown(self) -> None:
        if self.llm is None or self.broken:
            return
        self._drain()
        assert_pool_empty(self.llm)
        self.engine.blocks.check_tables()
        assert not self.engine.in_flight_tokens.pending and self.engine._launched is None


_PLAIN = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

SETTINGS = settings(
    max_examples=3,  # 23 s at 4 on the 2-core CI machine beside the other worker (8 took two minutes)
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    # no shrinking: a failing interleaving of this size took over ten minutes to shrink; the unshrunk
    # example and the engine's logged traceback name the bug well enough
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_engine_stateful(tiny_config_path: Path, tmp_path: Path) -> None:
    small = tmp_path / "config.json"
    small.write_text(json.dumps({**TINY_CONFIG, "vocab_size": SMALL_VOCAB}))
    EngineMachine.configs = {"full": tiny_config_path, "small": small}
    # one intra-op thread: the tiny model's ops are far too small to split, and on a 2-core machine
    # shared with another test run, two spinning OpenMP threads made steps ~30x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_state_machine_as_test(EngineMachine, settings=SETTINGS)
    finally:
        torch.set_num_threads(threads)
