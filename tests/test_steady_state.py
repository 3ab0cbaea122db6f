"""A long-running engine: documents keep one run of block ids after the pool wraps, and a request
admitted with scattered block ids gives the same greedy outputs (tiny dummy model, CPU, cascade).

On a GPU the third burst of a document's questions ran at half the first's: by then every free block
was cached, and the pool handed the new document its least recently used blocks one by one
(scattered, descending ids), so the shared-segment kernels lost their whole-tile reads. CPU speed
does not show it; the block ids do.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.kv.cache_events import prompt_digests
from prefixserve.kv.fragmentation import run_lengths
from tests.conftest import assert_pool_empty

DOC_TOKENS = 512  # 32 blocks of 16
QUESTIONS = 6
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def burst(name: str, salt: str | None = None) -> tuple[list[int], list[dict]]:
    """A new document and its questions (token ids: no tokenizer in the way)."""
    rng = random.Random(name)
    doc = [rng.randrange(100, 40000) for _ in range(DOC_TOKENS)]
    prompts = []
    for _ in range(QUESTIONS):
        prompt = {"prompt_token_ids": doc + [rng.randrange(100, 40000) for _ in range(24)]}
        if salt is not None:
            prompt["cache_salt"] = salt
        prompts.append(prompt)
    return doc, prompts


def doc_runs(llm: LLM, doc: list[int], salt: str | None = None) -> list[int]:
    """Run lengths of the document's cached blocks (in prompt order)."""
    pool = llm.engine.pool
    blocks = pool.lookup(prompt_digests(doc, pool.block_size, salt=salt))
    assert len(blocks) == (DOC_TOKENS - 1) // pool.block_size
    return run_lengths(blocks)


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_config_path: Path) -> LLM:
    # 96 blocks: a burst (32 document blocks, 6 x 2 own) fits twice, so the third wraps the pool;
    # 128-token prefill chunks: the document is computed in four of them
    return LLM(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        attention="cascade",
        num_kv_blocks=96,
        max_num_batched_tokens=128,
        progress=False,
    )


def test_documents_keep_one_run_after_the_pool_wraps(llm: LLM) -> None:
    pool = llm.engine.pool
    first = {}
    for name in ("A", "B", "C", "D"):
        doc, prompts = burst(name)
        first[name] = tokens(llm.generate(prompts, PARAMS))
        assert doc_runs(llm, doc) == [(DOC_TOKENS - 1) // pool.block_size], name
        assert_pool_empty(llm)
    m = llm.metrics()
    assert m["kv_scattered_allocations_total"] == 0
    assert m["kv_run_evicted_blocks_total"] > 0  # C and D were placed over cached blocks
    assert m["kv_free_fragmentation"] == 0.0 and m["kv_free_runs"] == 1
    # the same burst again, after its blocks were evicted: the same outputs
    doc, prompts = burst("A", salt="again")
    assert tokens(llm.generate(prompts, PARAMS)) == first["A"]


def test_scattered_blocks_give_the_same_outputs(llm: LLM) -> None:
    """Every other block held: the request's blocks are all runs of one, and its outputs do not change."""
    pool = llm.engine.pool
    doc, prompts = burst("S", salt="contiguous")
    contiguous = tokens(llm.generate(prompts, PARAMS))
    assert doc_runs(llm, doc, "contiguous") == [(DOC_TOKENS - 1) // pool.block_size]
    held = pool.allocate(pool.num_free)
    pool.release([b for b in held if b % 2])  # free: the odd ids, no two adjacent
    before = llm.metrics()
    doc, prompts = burst("S", salt="scattered")
    scattered = tokens(llm.generate(prompts, PARAMS))
    after = llm.metrics()
    pool.release([b for b in held if b % 2 == 0])
    assert set(doc_runs(llm, doc, "scattered")) == {1}
    assert after["kv_scattered_allocations_total"] > before["kv_scattered_allocations_total"]
    assert after["cascade_steps_total"] > before["cascade_steps_total"]  # the shared path ran on them
    assert scattered == contiguous
    assert_pool_empty(llm)
