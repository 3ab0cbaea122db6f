"""Prompt Cache holds in a small KV pool: waiting requests let go of their pieces for the queue's head
and take them again before their own admission; an intake with no room for its pieces waits for
admission instead of being refused; a request the pool can never hold ends with an error that says
why, and the engine keeps serving the others. Every run is bounded in steps, so a queue that waits
forever fails the test instead of hanging it."""

from __future__ import annotations

import httpx
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from tests.test_prompt_cache import PROMPTS, SCHEMA, assert_only_modules_held, tiny

MAX_STEPS = 2_000


pytestmark = pytest.mark.usefixtures("default_tokenizer")  # pools sized for its prompts


def run(llm: LLM, prompts: list, params: SamplingParams, mode: str | None = None) -> list:
    """The prompts' final outputs, in order, from at most MAX_STEPS engine steps."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        if isinstance(prompt, str):
            engine.add_request(rid, prompt, params, module_recompute=mode)
        else:
            engine.add_request(rid, params=params, prompt_token_ids=prompt)
    finals = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished(), "the queue waited forever"
    return [finals[rid] for rid in ids]


def samples(outs: list) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize(
    ("mode", "blocks"),
    [("none", 12), ("link:5", 14), ("link:5", 16), ("link:5", 12)],
)
def test_waiting_requests_let_go_of_their_pieces_for_the_head(tiny_config_path, mode, blocks) -> None:
    """Each pool here had waited forever (12 and 14-16 blocks: requests waiting behind the head held
    pieces and recovery copies it needed) or refused the last prompt at intake (12 with recovery:
    no room for its pieces). Now every request ends with the answers of a pool with room for all,
    wherever it recovered the same rows; none holds a block afterwards."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=2)
    roomy = tiny(tiny_config_path, max_num_seqs=8)
    roomy.register_schema(SCHEMA)
    want = run(roomy, PROMPTS, params, mode)
    llm = tiny(tiny_config_path, num_kv_blocks=blocks, max_num_seqs=8)
    llm.register_schema(SCHEMA)
    got = run(llm, PROMPTS, params, mode)
    assert all(c.finish_reason == "length" for o in got for c in o.outputs)
    pairs = zip(got, want, strict=True)
    same = [(g, w) for g, w in pairs if g.num_recomputed_tokens == w.num_recomputed_tokens]
    assert len(same) >= (len(PROMPTS) if mode == "none" else 2)
    assert samples([g for g, _ in same]) == samples([w for _, w in same])
    metrics = llm.metrics()
    assert metrics["module_holds_let_go_total"] + metrics["module_holds_deferred_total"] > 0
    if mode != "none" and blocks > 12:
        assert any(o.num_recomputed_tokens > 0 for o in got)
    assert_only_modules_held(llm)


def test_pieces_let_go_come_back_after_their_schema_is_removed(tiny_config_path) -> None:
    """A request that let its pieces go takes them back by key: a schema unregistered meanwhile costs
    an encode, and the answer is the same."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = tiny(tiny_config_path, module_recompute="link:5")
    llm.register_schema(SCHEMA)
    want = run(llm, PROMPTS[1:2], params)[0]
    engine = llm.engine
    engine.add_request("late", PROMPTS[1], params)
    held = engine.requests["late"].modules
    assert held is not None and held.blocks and held.private
    engine.modules.let_go(held)
    llm.unregister_schema("travel")
    encodes = llm.metrics()["module_encodes_total"]
    finals = [o for _ in range(100) for o in engine.step() if o.finished]
    assert finals[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert finals[0].num_recomputed_tokens == want.num_recomputed_tokens > 0
    assert llm.metrics()["module_encodes_total"] > encodes
    engine.modules.move_out()
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0


def test_a_head_that_fits_only_without_its_recovery_runs_without_it(tiny_config_path) -> None:
    """Pinned pieces leave room for the prompt, but not beside its recovery copies made at intake: it
    drops them (plain Prompt Cache, as under memory pressure) instead of being refused."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[2].replace("?", ", and what should I see first near the old river and the markets?")
    plain = tiny(tiny_config_path, num_kv_blocks=15)
    plain.register_schema(SCHEMA, pin=True)
    want = run(plain, [prompt], params, "none")[0]
    llm = tiny(tiny_config_path, num_kv_blocks=15)
    llm.register_schema(SCHEMA, pin=True)  # 10 of the 15 blocks
    llm.engine.add_request("probe", prompt, params, module_recompute="link:100000")
    assert llm.engine.requests["probe"].modules.private  # copies made at intake, leaving 1 block
    llm.engine.abort("probe")
    llm.engine.step()
    got = run(llm, [prompt], params, "link:100000")[0]
    assert got.outputs[0].finish_reason == "length" and got.error is None
    assert got.num_recomputed_tokens == 0 and got.num_cached_tokens == want.num_cached_tokens
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert llm.metrics()["module_recompute_skipped_total"] > 0


def test_a_finished_sample_does_not_keep_a_waiting_requests_holds(tiny_config_path) -> None:
    """A preempted n=2 request whose other sample has finished lets its holds go like one not
    started: the head behind it runs, with the answers it has alone."""
    a = '<prompt schema="travel"><tokyo/><rome/> Where do I start?</prompt>'
    b = '<prompt schema="travel"><rome/><plan days="three"/><short/> Where do I start?</prompt>'

    def answers(prompts: list[tuple[str, str | None, int]]) -> dict:
        llm = tiny(tiny_config_path, num_kv_blocks=12, max_num_seqs=6)
        llm.register_schema(SCHEMA)
        engine = llm.engine
        for rid, (prompt, salt, max_tokens) in enumerate(prompts):
            params = SamplingParams(n=2, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(str(rid), prompt, params, cache_salt=salt)
        finals = {}
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished():
                break
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert_only_modules_held(llm)
        return finals

    together = answers([(a, None, 35), (b, "a", 2)])
    alone = answers([(a, None, 35)])
    for out in together.values():
        assert [c.finish_reason for c in out.outputs] == ["length", "length"], out.error
    assert samples([together["0"]]) == samples([alone["0"]])


def test_a_request_preempted_after_its_recovery_lets_its_holds_go(tiny_config_path) -> None:
    """A request that ran its recovery rows and was preempted lets its copies go too when the head
    needs them; it computes those rows again, into fresh copies, when it is admitted again."""
    llm = tiny(tiny_config_path, num_kv_blocks=10, max_num_seqs=2)
    llm.register_schema(SCHEMA)
    engine = llm.engine

    def add(rid: str, prompt: str | list[int], max_tokens: int, **kw: object) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if isinstance(prompt, list):
            engine.add_request(rid, params=params, prompt_token_ids=prompt)
        else:
            engine.add_request(rid, prompt, params, **kw)

    add("ids", [17262], 1)
    add("head", '<prompt schema="travel"><long/><plan days="1 2 3"/> Compare them.</prompt>', 29)
    add("recovers", PROMPTS[2], 3, module_recompute="blend:0.5")
    finals = {}
    for step in range(MAX_STEPS):
        if step == 4:
            add("late", '<prompt schema="travel"><tokyo/><short/> x</prompt>', 1, cache_salt="b")
        if step > 4 and not engine.has_unfinished():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert {rid: o.outputs[0].finish_reason for rid, o in finals.items()} == dict.fromkeys(
        ("ids", "head", "recovers", "late"), "length"
    )
    assert finals["recovers"].num_recomputed_tokens > 0
    assert llm.metrics()["module_holds_let_go_total"] > 0
    assert_only_modules_held(llm)


def test_launch_ahead_does_not_refuse_a_sequence_its_step_in_flight_ends(tiny_config_path) -> None:
    """Launch-ahead schedules before it has the tokens of the step in flight, so a sequence whose last
    token is in flight may preempt itself for the row after it: not a reason to refuse it."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for launch_ahead in (False, True):
        llm = tiny(tiny_config_path, num_kv_blocks=11, async_scheduling=launch_ahead)
        llm.register_schema(SCHEMA, pin=True)  # 10 of the 11 blocks
        out = run(llm, [list(range(1000, 1011))], params)[0]
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6, out.error


def test_a_failure_taking_pieces_again_ends_that_request_only(tiny_config_path) -> None:
    """An encode failing while a let-go request takes its pieces again ends that request with an
    error; the others run, and no block is left held."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = tiny(tiny_config_path, module_recompute="link:5")
    llm.register_schema(SCHEMA)
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], params)
    engine.add_request("b", params=params, prompt_token_ids=list(range(1000, 1020)))
    engine.modules.let_go(engine.requests["a"].modules)
    engine.modules.move_out(drop_host=True)  # so the piece must be encoded again

    def broken(*_: object) -> None:
        raise RuntimeError("device error while encoding")

    engine.modules.encode = broken
    finals = {}
    for _ in range(50):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["a"].outputs[0].finish_reason == "error" and finals["a"].error is None  # a 500
    assert finals["b"].outputs[0].finish_reason == "length"
    assert not engine.has_unfinished()
    engine.modules.move_out()
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0


def pinned_pool(tiny_config_path) -> LLM:
    llm = tiny(tiny_config_path, num_kv_blocks=16)
    llm.register_schema(SCHEMA, pin=True)  # 10 of the 16 blocks, for good
    return llm


LONG = list(range(1000, 1000 + 16 * 12))  # within the context, but needs 13 blocks with its answer


def test_a_request_the_pool_can_never_hold_ends_with_the_reason(tiny_config_path) -> None:
    llm = pinned_pool(tiny_config_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    short, long, pml = run(llm, [list(range(1000, 1020)), LONG, PROMPTS[0]], params)
    assert [c.finish_reason for c in long.outputs] == ["error"]
    assert "KV pool cannot hold this request" in long.error and "pin=True" in long.error
    for out in (short, pml):
        assert out.outputs[0].finish_reason == "length" and out.error is None
    engine = llm.engine
    engine.pool.check_integrity()
    assert not engine.requests and engine.pool.num_used == engine.modules.gpu_blocks


def test_http_answers_a_request_the_pool_can_never_hold_with_a_400(tiny_config_path) -> None:
    from prefixserve.entrypoints.openai.server import ServerThread, build_app  # the server's packages

    config = EngineConfig(model=f"dummy:{tiny_config_path}", dtype="float32", device="cpu", num_kv_blocks=16)
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/schemas", json={"schema": SCHEMA, "pin": True})
        assert r.status_code == 201, r.text
        body = {"prompt": LONG, "max_tokens": 8, "temperature": 0}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "kv_capacity_exceeded"
        assert "KV pool cannot hold this request" in r.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
            text = "".join(s.iter_text())
            assert s.status_code == 400  # known before the first byte goes
        assert "kv_capacity_exceeded" in text
        ok = http.post("/v1/completions", json=body | {"prompt": LONG[:40]})
        assert ok.status_code == 200, ok.text
