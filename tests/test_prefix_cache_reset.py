"""Forgetting the prefix cache: ``BlockPool.forget_unheld``, ``LLM.reset_prefix_cache`` and
``POST /reset_prefix_cache``.

What must hold: every block nobody holds leaves the index (a router hears it), held blocks keep their
entries (pins, running requests), the host tier's prefix entries go while Prompt Cache modules stay,
nothing leaks, and the next prompt computes its tokens again with the same greedy output.
"""

from __future__ import annotations

import httpx
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache_events import enable_cache_events
from tests.test_prompt_cache import PROMPTS, SCHEMA

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DOC = [1000 + 7 * i for i in range(48)]  # 12 blocks of 4


def tiny(tiny_config_path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM(f"dummy:{tiny_config_path}", dtype="float32", device="cpu", progress=False, block_size=4, **kw)


def test_the_pool_forgets_only_blocks_nobody_holds() -> None:
    pool = BlockPool(8, 4)
    log = enable_cache_events(pool)
    log.drain(False, "router")  # the router's snapshot: nothing yet
    blocks = pool.allocate(6)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]) * 16)
    pool.release(blocks[3:])  # three free and cached, three still held
    assert pool.num_cached == 6
    assert pool.forget_unheld() == 3
    pool.check_integrity()
    assert pool.num_cached == 3 and pool.lookup([bytes([i]) * 16 for i in range(3)]) == blocks[:3]
    assert all(pool.cached_block(bytes([i]) * 16) is None for i in range(3, 6))
    events = log.drain(False, "router")
    assert sorted(events.removed) == [bytes([i]) * 16 for i in range(3, 6)]  # net: the three left
    assert sorted(events.added) == [bytes([i]) * 16 for i in range(3)]
    # forgotten blocks are plain free blocks now: handed out without counting as evictions
    pool.allocate(5)
    assert pool.evictions == 0
    assert pool.forget_unheld() == 0


def test_a_reset_makes_the_next_prompt_compute_again_with_the_same_output(tiny_config_path) -> None:
    llm = tiny(tiny_config_path)
    prompt = {"prompt_token_ids": [*DOC, 5, 6, 7]}
    first = llm.generate(prompt, GREEDY)[0]
    hit = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == len(DOC)
    cached = llm.engine.pool.num_cached
    assert llm.reset_prefix_cache() is True
    pool = llm.engine.pool
    pool.check_integrity()
    assert pool.num_cached == 0 and pool.num_used == 0
    again = llm.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hit.outputs[0].token_ids
    m = llm.metrics()
    assert m["prefix_cache_resets_total"] == 1 and m["prefix_cache_reset_blocks_total"] == cached


def test_pins_and_running_requests_keep_their_blocks(tiny_config_path) -> None:
    system = "You answer questions about the travel desk."
    llm = tiny(tiny_config_path, system_prompts={"desk": system})
    pinned = llm.metrics()["kv_blocks_pinned"]
    assert pinned > 0
    chat = [{"role": "user", "content": "Where to?"}]
    want = llm.chat(chat, GREEDY, application="desk")[0]
    engine = llm.engine
    engine.add_request(
        "running", prompt_token_ids=[*DOC, 9], params=SamplingParams(max_tokens=8, ignore_eos=True)
    )
    engine.step()  # its prompt is in blocks it holds
    pool = engine.pool
    held = [b for b in range(pool.num_blocks) if pool.ref_counts[b] and pool.digest_of(b) is not None]
    assert len(held) > pinned and pool.num_cached > len(held)  # the chat's turn is cached, unheld
    assert llm.reset_prefix_cache() is False  # a request is still in the engine: its blocks stay
    assert [b for b in range(pool.num_blocks) if pool.digest_of(b) is not None] == held
    while engine.has_unfinished():
        engine.step()
    assert llm.reset_prefix_cache() is True
    assert engine.pool.num_used == pinned  # only the pinned system prompt is held
    got = llm.chat(chat, GREEDY, application="desk")[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens >= want.num_cached_tokens > 0  # the pin still serves it
    engine.pool.check_integrity()


@pytest.mark.usefixtures("default_tokenizer")  # the PML prompts' lengths
def test_host_prefix_entries_go_and_prompt_modules_stay(tiny_config_path) -> None:
    llm = tiny(tiny_config_path, num_kv_blocks=40, spill_prefix_cache=True, module_recompute="none")
    llm.register_schema(SCHEMA)
    want = llm.generate(PROMPTS[0], GREEDY)[0]
    docs = [[2000 + 31 * d + i for i in range(40)] for d in range(4)]  # 10 blocks each: some spill
    for doc in docs:
        llm.generate({"prompt_token_ids": [*doc, 3]}, GREEDY)
    spill, host = llm.engine.spill, llm.engine.modules.host
    prefix = {k for k in host.keys() if k.startswith("p-")}  # noqa: SIM118  (a HostTier, not a dict)
    modules = set(host.keys()) - prefix
    assert spill.spilled_blocks > 0 and prefix and modules  # both kinds of entry share the tier
    assert spill.slots.available < spill.slots.capacity
    assert llm.reset_prefix_cache() is True
    assert set(host.keys()) == modules
    assert spill.slots.available == spill.slots.capacity  # every prefix slot came back
    out = llm.generate({"prompt_token_ids": [*docs[0], 3]}, GREEDY)[0]
    assert out.num_cached_tokens == 0  # neither the pool nor host memory had it
    got = llm.generate(PROMPTS[0], GREEDY)[0]  # its modules come back from host memory
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    llm.engine.pool.check_integrity()


def test_http_route_resets_and_needs_the_api_key(tiny_config_path) -> None:
    from prefixserve.entrypoints.openai.server import ServerThread, build_app  # the server's packages

    config = EngineConfig(model=f"dummy:{tiny_config_path}", dtype="float32", device="cpu", num_kv_blocks=128)
    key = {"Authorization": "Bearer k"}
    with (
        ServerThread(build_app(config, api_key="k")) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as http,
    ):
        body = {"prompt": "The travel desk opens at nine and closes at five. " * 3, "max_tokens": 2}
        usage = [http.post("/v1/completions", json=body, headers=key).json()["usage"] for _ in range(2)]
        assert usage[1]["prompt_tokens_details"]["cached_tokens"] > 0
        assert http.post("/reset_prefix_cache").status_code == 401
        r = http.post("/reset_prefix_cache", headers=key)
        assert r.status_code == 200 and r.json() == {"object": "prefix_cache_reset", "reset": True}, r.text
        after = http.post("/v1/completions", json=body, headers=key).json()["usage"]
        assert after["prompt_tokens_details"]["cached_tokens"] == 0
        assert "prefixserve_prefix_cache_resets_total 1.0" in http.get("/metrics").text


@pytest.mark.gpu
def test_gpu_reset_with_host_spill(tiny_config_path) -> None:
    """On CUDA, with the prefix cache spilling to pinned host slots: a reset gives every slot back and
    the next prompt is computed again with the same greedy output."""
    llm = LLM(
        f"dummy:{tiny_config_path}", dtype="float32", device="cuda", progress=False, block_size=16,
        num_kv_blocks=24, spill_prefix_cache=True,
    )  # fmt: skip
    docs = [[3000 + 29 * d + i for i in range(96)] for d in range(5)]  # 6 blocks each: some spill
    first = [llm.generate({"prompt_token_ids": [*doc, 3]}, GREEDY)[0] for doc in docs]
    spill = llm.engine.spill
    assert spill.spilled_blocks > 0 and spill.slots.available < spill.slots.capacity
    assert llm.reset_prefix_cache() is True
    assert spill.slots.available == spill.slots.capacity and llm.engine.pool.num_cached == 0
    again = [llm.generate({"prompt_token_ids": [*doc, 3]}, GREEDY)[0] for doc in docs]
    assert all(a.num_cached_tokens == 0 for a in again)  # neither the pool nor host memory had them
    assert [a.outputs[0].token_ids for a in again] == [f.outputs[0].token_ids for f in first]
    llm.engine.pool.check_integrity()
