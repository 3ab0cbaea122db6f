"""Prompt Cache accuracy recovery: ``link:K`` and ``blend:R`` recompute module rows in context.

What must hold exactly: recomputing every row (``link:K`` with K >= each module, ``blend:1.0``) is full
prefill of the same tokens at the same positions; ``none`` is the Prompt Cache path; the recomputed
rows live in the request's private block copies and never reach the blocks other requests read;
blocks never leak, under samples and preemption too. How much of the gap a partial setting closes
is measured in benchmarks/promptcache.py --recovery, not asserted here.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.promptcache.recompute import (
    Recompute,
    blend_blocks,
    block_runs,
    link_runs,
    parse_recompute,
)
from tests.test_prompt_cache import PROMPTS, SCHEMA, assert_only_modules_held, tiny

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
EVERYTHING = ("link:100000", "blend:1.0")


def full_prefill(llm: LLM, pml: str, salt: str) -> object:
    """The PML prompt's very tokens and positions as one plain prompt (a fresh salt: nothing reused)."""
    ids, pos = llm.engine.modules.layout_of(pml)
    return llm.generate({"prompt_token_ids": ids, "positions": pos, "cache_salt": salt}, PARAMS)[0]


def gap(a, b) -> float:
    """Largest difference between two outputs' chosen-token logprobs (same tokens asserted)."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    mine, theirs = a.outputs[0].token_logprobs, b.outputs[0].token_logprobs
    return max(abs(x - y) for x, y in zip(mine, theirs, strict=True))


# ---- the setting and the row choice (pure Python) ------------------------------------------------
def test_parse_recompute_accepts_the_three_forms_and_names_bad_ones() -> None:
    assert parse_recompute(None) == parse_recompute("none") == Recompute()
    assert parse_recompute("link:16") == Recompute("link", tokens=16)
    assert parse_recompute(" Blend:0.15 ").spec == "blend:0.15"
    assert parse_recompute("blend:1").ratio == 1.0 and not parse_recompute("blend:1").needs_deviation
    for bad, words in (
        ("link:0", "link takes"),
        ("link:x", "link takes"),
        ("blend:0", "blend takes"),
        ("blend:1.5", "blend takes"),
        ("blend:nan", "blend takes"),
        ("relink", "not one of"),
        ("link", "not one of"),
    ):
        with pytest.raises(ValueError, match=words) as err:
            parse_recompute(bad)
        assert str(err.value).startswith("module_recompute")


def test_link_runs_skip_the_first_piece_and_stop_at_a_piece_end() -> None:
    assert link_runs([40, 3, 20, 0], 4) == [(1, 0, 3), (2, 0, 4)]
    assert link_runs([10], 4) == []


def test_blend_blocks_pick_the_highest_scores_per_piece() -> None:
    rows, bs = [32, 64, 20], 16
    scores = [[9.0, 9.0], [0.1, 5.0, 0.2, 4.0], [1.0, 3.0]]
    assert blend_blocks(rows, scores, 0.25, bs) == [[], [1], [1]]  # ceil(0.25 * 64 / 16) = 1 block
    assert blend_blocks(rows, scores, 0.5, bs) == [[], [1, 3], [1]]
    assert blend_blocks(rows, scores, 1.0, bs) == [[], [0, 1, 2, 3], [0, 1]]
    assert blend_blocks(rows, [[], [], []], 0.3, bs) == [[], [0, 1], [0]]  # no scores: earliest blocks
    assert block_runs([3, 0, 1, 5, 4]) == [(0, 2), (3, 6)]


# ---- exactness ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["reference", "cascade", "auto"])
def test_recomputing_every_row_equals_full_prefill(tiny_config_path, attention: str) -> None:
    llm = tiny(tiny_config_path, attention=attention)
    llm.register_schema(SCHEMA)
    differs = 0.0
    for i, pml in enumerate(PROMPTS):
        none = llm.generate(pml, PARAMS, module_recompute="none")[0]  # first: own blocks cached
        full = full_prefill(llm, pml, f"full-{i}")
        nl, fl = none.outputs[0].token_logprobs, full.outputs[0].token_logprobs
        differs = max(differs, max(abs(a - b) for a, b in zip(nl, fl, strict=True)))
        for mode in EVERYTHING:
            out = llm.generate(pml, PARAMS, module_recompute=mode)[0]
            assert gap(out, full) < 1e-5, (mode, pml)
            assert out.num_recomputed_tokens > 0
    assert differs > 1e-3  # Prompt Cache alone is an approximation: the check above is not vacuous
    assert_only_modules_held(llm)


def test_recovery_rows_count_against_the_step_budget_and_stay_exact(tiny_config_path) -> None:
    """A 24-token step budget: the recovered rows (more than a budget each) take a step of their own
    beside one own token, requests queue behind them, and full recovery still equals full prefill."""
    llm = tiny(tiny_config_path, max_num_batched_tokens=24)
    llm.register_schema(SCHEMA)
    want = [full_prefill(llm, pml, f"b{i}") for i, pml in enumerate(PROMPTS)]
    steps = llm.metrics()["steps_total"]
    got = llm.generate(PROMPTS, PARAMS, module_recompute="link:100000")
    for out, full in zip(got, want, strict=True):
        assert out.num_recomputed_tokens > 24
        assert gap(out, full) < 1e-5
    assert llm.metrics()["steps_total"] - steps >= len(PROMPTS) + PARAMS.max_tokens - 1
    assert_only_modules_held(llm)


def test_recomputing_every_row_equals_full_prefill_on_the_default_model(default_llm: LLM) -> None:
    """Real weights (fp32, CPU): greedy output of full recovery is full prefill's."""
    llm = LLM(dtype="float32", device="cpu", num_kv_blocks=512, progress=False)
    schema = (
        '<schema name="town">Notes about a town.'
        '<module name="a"> Anna lives in the red house. The red house stands on Oak Street.</module>'
        '<module name="b"> Boris lives in the blue house. The blue house stands on Pine Street.</module>'
        '<module name="c"> Clara is a doctor. Boris is a pilot.</module></schema>'
    )
    llm.register_schema(schema)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    questions = (
        '<prompt schema="town"><c/><b/><a/> Question: on which street does Anna live? Answer:</prompt>',
        '<prompt schema="town"><b/><c/> Question: what is the job of Boris? Answer:</prompt>',
    )
    wants = []
    for pml in questions:
        ids, pos = llm.engine.modules.layout_of(pml)
        plain = {"prompt_token_ids": ids, "positions": pos}
        wants += [default_llm.generate(plain, params)[0].outputs[0].token_ids] * len(EVERYTHING)
    # every (question, mode) a request of one batch, each with its own private copies: a decode step
    # of the default model costs about the same for four rows as for one (a call each: +2.5 CPU-s)
    cases = [(pml, mode) for pml in questions for mode in EVERYTHING]
    outs = llm.generate([{"prompt": pml, "module_recompute": mode} for pml, mode in cases], params)
    for (pml, mode), out, want in zip(cases, outs, wants, strict=True):
        assert out.num_recomputed_tokens > 0, (mode, pml)
        assert out.outputs[0].token_ids == want, (mode, pml)


def test_none_is_the_prompt_cache_path(tiny_config_path) -> None:
    """``none`` set on the engine, on the schema or on the request: the same outputs, nothing private."""
    by_engine = tiny(tiny_config_path, module_recompute="none")
    by_engine.register_schema(SCHEMA)
    by_schema = tiny(tiny_config_path, module_recompute="link:64")  # the engine's setting is another
    by_schema.register_schema(SCHEMA, module_recompute="none")
    by_request = tiny(tiny_config_path, module_recompute="link:64")
    by_request.register_schema(SCHEMA)
    a = by_engine.generate(PROMPTS, PARAMS)
    b = by_schema.generate(PROMPTS, PARAMS)
    c = by_request.generate(PROMPTS, PARAMS, module_recompute="none")
    for x, y, z in zip(a, b, c, strict=True):
        assert gap(x, y) == gap(x, z) == 0.0
        for out in (x, y, z):
            assert out.num_recomputed_tokens == 0 and out.module_rows_private == 0
            assert out.module_rows_shared == out.num_cached_tokens > 0
    default = by_request.generate(PROMPTS[0], PARAMS)[0]
    assert default.num_recomputed_tokens > 0  # the engine's setting recovers


# ---- isolation and bookkeeping -----------------------------------------------------------------
def module_kv(llm: LLM) -> dict[str, torch.Tensor]:
    kv = llm.engine.runner.kv.tensor
    return {e.key: kv[:, :, e.blocks].clone() for e in llm.engine.modules.entries.values() if e.blocks}


def test_recomputed_rows_never_reach_the_shared_blocks(tiny_config_path) -> None:
    llm = tiny(tiny_config_path, max_num_seqs=8)
    llm.register_schema(SCHEMA)
    before = llm.generate(PROMPTS, PARAMS, module_recompute="none")
    stored = module_kv(llm)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=2)
    for mode in ("link:4", "blend:0.5", "link:100000"):
        llm.generate(PROMPTS, params, module_recompute=mode)  # together: copies and shared blocks mixed
    after = module_kv(llm)
    assert stored.keys() == after.keys()
    for key, kv in stored.items():
        assert torch.equal(kv, after[key]), key
    llm.reset_prefix_cache()  # the questions' blocks are computed again, as the first time
    again = llm.generate(PROMPTS, PARAMS, module_recompute="none")
    for x, y in zip(before, again, strict=True):
        assert gap(x, y) == 0.0
    assert_only_modules_held(llm)


def test_outputs_and_metrics_count_recomputed_and_private_rows(tiny_config_path) -> None:
    llm = tiny(tiny_config_path)
    llm.register_schema(SCHEMA)
    pieces = []
    for pml in PROMPTS:  # each prompt's pieces, nothing recomputed
        mp = llm.engine.modules.prepare(pml, None, "none")
        llm.engine.modules.release(mp.blocks)
        pieces.append((mp.piece_rows, mp.module_tokens))
    start = llm.metrics()
    k = 4
    outs = llm.generate(PROMPTS, PARAMS, module_recompute=f"link:{k}")
    for (rows, module_tokens), out in zip(pieces, outs, strict=True):
        assert len(rows) > 1
        assert out.num_recomputed_tokens == sum(min(k, r) for r in rows[1:])
        assert out.module_rows_shared + out.module_rows_private == module_tokens
        assert out.module_rows_private >= out.num_recomputed_tokens
        assert out.num_cached_tokens == module_tokens - out.num_recomputed_tokens
    m = llm.metrics()
    for key, field in (
        ("module_recomputed_tokens_total", "num_recomputed_tokens"),
        ("module_rows_private_total", "module_rows_private"),
        ("module_rows_shared_total", "module_rows_shared"),
    ):
        assert m[key] - start[key] == sum(getattr(o, field) for o in outs), key
    assert_only_modules_held(llm)


def test_schema_setting_request_override_and_engine_default(tiny_config_path) -> None:
    llm = tiny(tiny_config_path, module_recompute="link:2")
    llm.register_schema(SCHEMA)
    assert llm.generate(PROMPTS[0], PARAMS)[0].num_recomputed_tokens > 0  # the engine's default
    llm.register_schema(SCHEMA, replace=True, module_recompute="none")
    assert llm.schemas()[0]["module_recompute"] == "none"
    assert llm.generate(PROMPTS[0], PARAMS)[0].num_recomputed_tokens == 0  # the schema's
    out = llm.generate({"prompt": PROMPTS[0], "module_recompute": "blend:1.0"}, PARAMS)[0]  # the request's
    assert out.num_recomputed_tokens == out.module_rows_private > 0
    assert_only_modules_held(llm)


def test_the_default_is_link_64(tiny_config_path) -> None:
    llm = LLM(f"dummy:{tiny_config_path}", dtype="float32", device="cpu", progress=False, num_kv_blocks=256)
    llm.register_schema(SCHEMA)
    assert llm.engine.config.module_recompute == "link:64"
    assert llm.generate(PROMPTS[0], PARAMS)[0].num_recomputed_tokens > 0
    assert_only_modules_held(llm)


def test_bad_settings_are_refused_and_the_engine_goes_on(tiny_config_path) -> None:
    with pytest.raises(ValueError, match="module_recompute"):
        tiny(tiny_config_path, module_recompute="sometimes")
    llm = tiny(tiny_config_path)
    llm.register_schema(SCHEMA)
    with pytest.raises(ValueError, match="link takes"):
        llm.generate(PROMPTS[0], PARAMS, module_recompute="link:-1")
    with pytest.raises(ValueError, match="blend takes"):
        llm.generate("plain text", PARAMS, module_recompute="blend:2")  # checked for any prompt
    with pytest.raises(ValueError, match="not one of"):
        llm.register_schema(SCHEMA.replace("travel", "t2"), module_recompute="all")
    assert [s["name"] for s in llm.schemas()] == ["travel"]
    assert_only_modules_held(llm)
    assert len(llm.generate(PROMPTS[0], PARAMS, module_recompute="link:3")[0].outputs[0].token_ids) == 8


@pytest.mark.usefixtures("default_tokenizer")  # its pool sizes
def test_a_pool_short_of_blocks_runs_without_recovery_rather_than_refusing(tiny_config_path) -> None:
    """Private copies are held for a request's life: with the pool near its reserve the request
    runs as plain Prompt Cache (and says so), never refused, and equals the ``none`` path."""
    llm = tiny(tiny_config_path, num_kv_blocks=22, kv_admit_threshold=0.6)  # keep 8 blocks free
    llm.register_schema(SCHEMA)  # 10 module blocks: 12 free, so 4 for private copies
    # PROMPTS[1] has 4 pieces: link:2 copies one block in each of the last 3, recomputing all takes 5
    want = llm.generate(PROMPTS[1], PARAMS, module_recompute="none")[0]
    got = llm.generate(PROMPTS[1], PARAMS, module_recompute="link:100000")[0]
    assert got.num_recomputed_tokens == 0 and got.module_rows_private == 0
    assert gap(got, want) == 0.0
    assert llm.metrics()["module_recompute_skipped_total"] == 1
    assert llm.generate(PROMPTS[1], PARAMS, module_recompute="link:2")[0].num_recomputed_tokens > 0
    assert_only_modules_held(llm)


@pytest.mark.usefixtures("default_tokenizer")  # its pool sizes
def test_preemption_keeps_recovered_prompts_exact(tiny_config_path) -> None:
    want = None
    for blocks in (256, 34):
        # no reserve: every request gets its private copies, so the two pools compute the same KV
        llm = tiny(tiny_config_path, num_kv_blocks=blocks, max_num_seqs=8, kv_admit_threshold=1.0)
        llm.register_schema(SCHEMA)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2)
        outs = llm.generate(PROMPTS, params, module_recompute="link:5")
        assert all(o.num_recomputed_tokens > 0 for o in outs)
        got = [[c.token_ids for c in o.outputs] for o in outs]
        want = want or got
        assert got == want, blocks
        assert_only_modules_held(llm)
    assert llm.metrics()["preemptions_total"] > 0


# ---- over HTTP ---------------------------------------------------------------------------------
def test_http_takes_module_recompute_on_completions_and_schemas(tiny_config_path) -> None:
    from prefixserve.entrypoints.openai.server import ServerThread, build_app  # the server's packages

    config = EngineConfig(model=f"dummy:{tiny_config_path}", dtype="float32", device="cpu", num_kv_blocks=256)
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/schemas", json={"schema": SCHEMA, "module_recompute": "link:3"})
        assert r.status_code == 201, r.text
        assert r.json()["module_recompute"] == "link:3"
        body = {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/v1/completions", json=body | {"module_recompute": "blend:0.5"}).status_code == 200
        bad = http.post("/v1/completions", json=body | {"module_recompute": "blend:7"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "module_recompute", bad.text
        other = {"schema": SCHEMA.replace("travel", "t2"), "module_recompute": "x"}
        bad = http.post("/v1/schemas", json=other)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "module_recompute", bad.text
        metrics = http.get("/metrics").text
        name = "prefixserve_module_recomputed_tokens_total "
        recomputed = [ln for ln in metrics.splitlines() if ln.startswith(name)]
        assert recomputed and float(recomputed[0].split()[1]) > 0


@pytest.mark.gpu
def test_gpu_recovery_equals_full_prefill_through_the_triton_path(tiny_config_path) -> None:
    """On CUDA (fp32, Triton kernels, decode graphs): full recovery gives full prefill's greedy tokens,
    and partial recovery leaves the shared module blocks as they were."""
    llm = LLM(f"dummy:{tiny_config_path}", dtype="float32", device="cuda", num_kv_blocks=256, progress=False)
    if llm.get_tokenizer() is None:
        pytest.skip("the default model (its tokenizer) is not installed")
    llm.register_schema(SCHEMA)
    stored = module_kv(llm)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i, pml in enumerate(PROMPTS):
        ids, pos = llm.engine.modules.layout_of(pml)
        want = llm.generate({"prompt_token_ids": ids, "positions": pos, "cache_salt": f"g{i}"}, params)
        for mode in EVERYTHING:
            got = llm.generate(pml, params, module_recompute=mode)
            assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, mode
    llm.generate(PROMPTS * 4, params, module_recompute="blend:0.5")
    for key, kv in module_kv(llm).items():
        assert torch.equal(kv, stored[key]), key
    assert_only_modules_held(llm)
