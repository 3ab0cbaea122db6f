"""Offline batch mode end to end: same greedy outputs as the online path, fewer prompt tokens computed,
no leaks; OpenAI Batch files through the Python API and the CLI, with bad lines and resume."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from tests.conftest import assert_pool_empty


def _tiny(config: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=f"dummy:{config}", dtype="float32", attention="auto", progress=False, **kwargs)


def _shuffled_groups(seed: int, groups: int, members: int, prefix: int, distinct: int) -> list[dict]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        head = [rng.randrange(3, 500) for _ in range(prefix)]
        for _ in range(members):
            prompts.append({"prompt_token_ids": head + [rng.randrange(3, 500) for _ in range(distinct)]})
    rng.shuffle(prompts)
    return prompts


@pytest.mark.parametrize("grouping", ["first_level", "tree"])
def test_batch_schedule_matches_online_greedy_and_computes_less(tiny_config_path: Path, grouping: str):
    prompts = _shuffled_groups(0, groups=8, members=4, prefix=48, distinct=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # A pool that cannot keep every group's prefix: online LRU evicts what shuffled groups need later.
    small = {"num_kv_blocks": 24, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    online = _tiny(tiny_config_path, **small)
    expected = [o.outputs[0].token_ids for o in online.generate(prompts, params)]
    batch = _tiny(tiny_config_path, **small)
    got = batch.generate(prompts, params, schedule="batch", grouping=grouping)
    assert [o.outputs[0].token_ids for o in got] == expected
    on, off = online.metrics(), batch.metrics()
    assert off["prefix_cache_hit_tokens_total"] > on["prefix_cache_hit_tokens_total"]
    assert_pool_empty(online)
    assert_pool_empty(batch)
    batch.engine.scheduler.blocks.pool.check_integrity()


def test_batch_schedule_with_n_samples_salts_and_a_bad_prompt(tiny_config_path: Path):
    llm = _tiny(tiny_config_path)
    base = [7] * 40
    prompts = [{"prompt_token_ids": [*base, i], "cache_salt": "a" if i % 2 else None} for i in range(6)]
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, schedule="batch")
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 4 for c in o.outputs) for o in outs)
    assert_pool_empty(llm)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([{"prompt_token_ids": base}, {"prompt_token_ids": [5] * 5000}], params, schedule="batch")
    assert not llm.engine.has_unfinished()
    assert_pool_empty(llm)
    with pytest.raises(ValueError, match="schedule"):
        llm.generate(["x"], params, schedule="fifo")


def test_batch_schedule_in_a_pool_of_one_context_ends_like_online(tiny_config_path: Path):
    """A sequence that needs the whole pool (max_tokens None runs to it) beside a prefix group: the
    batch schedule must not wait forever on the group's held prefix block."""
    prefix = list(range(600, 616))  # one full block, shared by two prompts: a group
    prompts = [{"prompt_token_ids": [12]}] + [{"prompt_token_ids": [*prefix, t]} for t in (35, 22)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)
    pool = {"num_kv_blocks": 6, "max_num_seqs": 2, "async_scheduling": False}
    expected = [o.outputs[0].token_ids for o in _tiny(tiny_config_path, **pool).generate(prompts, params)]
    llm = _tiny(tiny_config_path, **pool)
    got = llm.generate(prompts, params, schedule="batch")
    assert [o.outputs[0].token_ids for o in got] == expected
    assert [len(t) for t in expected] == [95, 79, 79]  # each ran to the 96-token context
    assert_pool_empty(llm)


def _batch_file(path: Path, rows: list[dict | str]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _rows() -> list[dict | str]:
    system = "You answer in one short sentence about geography and nothing else. " * 3
    rows: list[dict | str] = []
    for i, q in enumerate(["Where is Kyoto?", "Where is Lisbon?", "Where is Oslo?", "Where is Quito?"]):
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "max_tokens": 5,
            "temperature": 0,
        }
        rows.append({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    rows.append(
        {
            "custom_id": "cmpl-0",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": ["Once upon a time", "The capital of France"],
                "max_tokens": 4,
                "temperature": 0,
            },
        }
    )
    rows.append("{broken")
    rows.append({"custom_id": "chat-0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    rows.append(
        {
            "custom_id": "bad-body",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "temperature": -1},
        }
    )
    rows.append(
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "word " * 9000, "max_tokens": 2},
        }
    )
    return rows


@pytest.mark.slow
def test_batch_file_answers_like_the_server_and_resumes(default_llm: LLM, tmp_path: Path):
    from prefixserve.protocols.openai.prepare import OpenAIContext, prepare, response_body

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _batch_file(src, _rows())
    summary = default_llm.batch(src, out, progress=False)
    assert summary["rows_written"] == 9 and summary["error_rows"] == 4
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 9
    rows = {r["custom_id"]: r for r in lines if r["error"] is None}
    # Bodies are the server's: run one row through the online path and compare (ids aside).
    ctx = OpenAIContext(
        model=default_llm.engine.model_name, tokenizer=default_llm.get_tokenizer(), system_prompts={}
    )
    row = json.loads(src.read_text().splitlines()[1])
    prep = prepare(ctx, row["url"], row["body"])
    online = default_llm.generate(prep.prompts, prep.params)
    want = response_body(ctx, prep, online)
    got = rows["chat-1"]["response"]["body"]
    assert got["choices"] == want["choices"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert rows["chat-1"]["response"]["status_code"] == 200 and rows["chat-1"]["error"] is None
    assert len(rows["cmpl-0"]["response"]["body"]["choices"]) == 2
    assert rows["bad-body"]["response"]["status_code"] == 400
    assert "temperature" in rows["bad-body"]["response"]["body"]["error"]["message"]
    assert "context length" in rows["too-long"]["response"]["body"]["error"]["message"]
    errors = [r["error"] for r in lines if r["error"]]
    assert {e["code"] for e in errors} == {"invalid_json", "duplicate_custom_id"}
    assert any(e["message"].startswith("line 6:") for e in errors)
    # A second run with the same paths has nothing left to do.
    again = default_llm.batch(src, out, progress=False)
    assert again["rows_written"] == 0 and again["rows_skipped"] == 9
    assert len(out.read_text().splitlines()) == 9
    assert_pool_empty(default_llm)
