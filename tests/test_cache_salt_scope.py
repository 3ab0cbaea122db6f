"""Cache salts with a scope (issue 106, salt scope): a salt isolates a request's blocks from the first
block holding tenant content on, and the blocks wholly before it (public: the system messages, an
application's pinned prompt) are shared across salts. What a tenant can observe of another is only
that a public prefix was cached; its private blocks never match another salt's, even for equal text.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.kv.block_pool import chain_digests
from prefixserve.kv.cache_events import prompt_digests
from tests.conftest import assert_pool_empty

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_public_blocks_digest_unsalted_and_the_rest_per_salt() -> None:
    ids, places = list(range(100, 100 + 5 * BS)), list(range(5 * BS))
    plain = chain_digests(None, ids, places, None, BS)
    salted = chain_digests(None, ids, places, "a", BS)
    scoped = chain_digests(None, ids, places, "a", BS, public=2)
    assert scoped[:2] == plain[:2]
    assert not set(scoped[2:]) & (set(plain) | set(salted))  # past the public part: the tenant's alone
    other = chain_digests(None, ids, places, "b", BS, public=2)
    assert other[:2] == scoped[:2] and not set(other[2:]) & set(scoped[2:])
    # the engine extends a sequence's digests as its blocks fill: a chain continued part-way is the same
    head = chain_digests(None, ids[:BS], places[:BS], "a", BS, public=2)
    assert head + chain_digests(head[-1], ids[BS:], places[BS:], "a", BS, public=1) == scoped
    # the replicas' routing keys: public tokens short of a whole block leave that block salted
    keys = prompt_digests([*ids, 7], BS, salt="a", public=2 * BS + 5)
    assert keys == scoped


@pytest.fixture(scope="module")
def llm(tiny_config_path: Path) -> LLM:
    return LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, progress=False)


def _prompt(system: list[int], own: list[int], salt: str | None, public: int | None) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": [*system, *own]}
    if salt is not None:
        prompt["cache_salt"] = salt
    if public is not None:
        prompt["public_tokens"] = public
    return prompt


def test_tenants_share_the_public_blocks_and_nothing_after(llm: LLM) -> None:
    """Two tenants, one system prompt of 3 blocks and 5 tokens, and the same private text: under the
    after-system scope the second tenant's prompt hits the 3 public blocks and no private one (its
    text equals the first tenant's); an unsalted request hits the public blocks too. Under the whole
    prompt scope nothing is shared. Greedy tokens equal a run without the cache."""
    base = 1000 + uuid.uuid4().int % 20000  # this test's own tokens: nothing cached before
    system = [base + i for i in range(3 * BS + 5)]
    own = [base + 500 + i for i in range(2 * BS + 3)]
    public = len(system)
    a = llm.generate(_prompt(system, own, "tenant-a", public), GREEDY)[0]
    b = llm.generate(_prompt(system, own, "tenant-b", public), GREEDY)[0]
    plain = llm.generate(_prompt(system, own, None, None), GREEDY)[0]
    whole = llm.generate(_prompt(system, own, "tenant-c", None), GREEDY)[0]  # vLLM's scope: all salted
    again = llm.generate(_prompt(system, own, "tenant-a", public), GREEDY)[0]
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 3 * BS  # the public blocks: the private ones are tenant-a's
    assert plain.num_cached_tokens == 3 * BS
    assert whole.num_cached_tokens == 0
    assert again.num_cached_tokens == len(system) + len(own) - 1 - (len(system) + len(own) - 1) % BS
    want = llm.generate({"prompt_token_ids": [*system, *own], "cache_salt": uuid.uuid4().hex}, GREEDY)
    for out in (a, b, plain, whole, again):
        assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_pool_empty(llm)


def test_bad_public_tokens_are_refused_and_the_engine_goes_on(llm: LLM) -> None:
    ids = list(range(300, 340))
    with pytest.raises(ValueError, match="public_tokens must be an integer >= 0"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": "x", "public_tokens": -1}, GREEDY)
    with pytest.raises(ValueError, match="public_tokens needs a cache_salt"):
        llm.generate({"prompt_token_ids": ids, "public_tokens": 8}, GREEDY)
    assert len(llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids) == 4
    assert_pool_empty(llm)


def _chat(http: Any, system: str, user: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "default", "max_tokens": 2, "temperature": 0, **extra}
    body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chats_share_the_system_messages_across_salts(tiny_server: Any) -> None:
    """Over HTTP: ``cache_salt_scope: "after-system"`` shares a salted chat's system messages (the
    second tenant's cached tokens are the system part's whole blocks, short of its own turn, which is
    word for word the first tenant's); "prompt" shares nothing; an unknown scope is a 400 naming the
    field, and the server goes on."""
    import httpx

    system = f"Session {uuid.uuid4().hex}. You are a careful assistant for a bicycle shop. " * 6
    user = "My chain skips on the smallest cog, what should I check first? " * 3
    scoped = {"cache_salt_scope": "after-system"}
    with httpx.Client(base_url=tiny_server.url, timeout=120) as http:
        first = _chat(http, system, user, cache_salt="tenant-a", **scoped)
        second = _chat(http, system, user, cache_salt="tenant-b", **scoped)
        apart = _chat(http, system, user, cache_salt="tenant-c", cache_salt_scope="prompt")
        hi = [{"role": "user", "content": "hi"}]
        body = {"model": "default", "messages": hi, "cache_salt_scope": "x"}
        bad = http.post("/v1/chat/completions", json=body)
        again = _chat(http, system, user, cache_salt="tenant-a", **scoped)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second, apart, again)]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert cached[0] == 0 and cached[2] == 0
    assert 64 <= cached[1] < prompt_tokens - BS  # the system part, not the tenant's own turn
    assert cached[3] > cached[1]  # tenant-a's own turn hits its own blocks
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt_scope"


def test_replica_routing_keys_follow_the_scope(tiny_config_path: Path) -> None:
    """Behind ``--replicas``: the ingress's routing keys of two tenants' salted chats share the system
    part's digests and none after it (so both go where the system prompt is cached, and neither is
    sent after the other's private blocks); a salted request naming an application has the pinned
    prompt's digests in front. Each key is among the blocks the engine caches for that request."""
    import json

    from prefixserve.protocols.openai.prepare import OpenAIContext, prepare
    from prefixserve.protocols.openai.salt_scope import public_tokens
    from prefixserve.ray_scaleout.serve_ingress import IngressCore, ReplicaSet
    from tests.test_serve_ingress import FakeReplica, _run

    rail = "You answer questions about trains, briefly and politely. " * 3
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, system_prompts={"rail": rail},
        progress=False,
    )  # fmt: skip
    ctx = OpenAIContext(
        model=llm.engine.model_name, tokenizer=llm.engine.tokenizer, system_prompts={"rail": rail},
        cache_salt_scope="after-system",
    )  # fmt: skip
    core = IngressCore(ReplicaSet({"a": FakeReplica()}), ctx, BS)
    system = "You are the support desk of a bicycle shop; answer in two sentences. " * 3
    user = "How tight should a chain be on a single-speed bike? " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    keys = {}
    for salt in ("t1", "t2"):
        body = {"model": "default", "messages": messages, "cache_salt": salt}
        keys[salt], _ = _run(core.routing_key("/v1/chat/completions", json.dumps(body).encode(), {}))
        prep = prepare(ctx, "/v1/chat/completions", body)
        ids = llm.engine.tokenizer.encode(prep.prompts[0], add_special_tokens=True)
        public = public_tokens(ctx, prep, ids)
        assert public >= 3 * BS and prep.public_text is not None
        llm.generate({"prompt_token_ids": ids, "cache_salt": salt, "public_tokens": public}, GREEDY)
        assert set(keys[salt]) <= set(llm.engine.pool.cached_digests())
    shared = [d for d in keys["t1"] if d in keys["t2"]]
    assert len(shared) >= 3 and keys["t1"][: len(shared)] == shared == keys["t2"][: len(shared)]
    assert len(keys["t1"]) > len(shared)  # the private blocks differ
    body = {"model": "default", "prompt": user, "application": "rail", "cache_salt": "t1"}
    key, _ = _run(core.routing_key("/v1/completions", json.dumps(body).encode(), {}))
    pinned = llm.engine.system_prompt_kv["rail"].digests
    assert key[: len(pinned)] == list(pinned) and len(key) > len(pinned)
    # OpenAI's prompt_cache_key: the affinity key (before the user), so requests naming it share a replica
    body = {"model": "default", "messages": messages, "prompt_cache_key": "ferry-app", "user": "u1"}
    assert _run(core.routing_key("/v1/chat/completions", json.dumps(body).encode(), {}))[1] == "ferry-app"
    llm.shutdown()


def test_batch_rows_take_their_public_part(tiny_config_path: Path) -> None:
    """Offline batch rows (``batch_runner.RequestSpec``) carry their public part to the engine: two
    salted rows over one system prompt, the second (its own group: groups never cross salts) reads
    the first's public blocks from the prefix cache."""
    from prefixserve.config import EngineConfig
    from prefixserve.engine import Engine
    from prefixserve.entrypoints.batch_runner import RequestSpec, submit_grouped

    engine = Engine(EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256))
    system = [2000 + i for i in range(3 * BS + 2)]
    specs = [
        RequestSpec(f"r{k}", None, GREEDY, [*system, 70 + k, 80], f"s{k}", public_tokens=len(system))
        for k in range(2)
    ]
    errors, _ = submit_grouped(engine, specs)
    assert errors == [None, None]
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    assert sorted(cached.values()) == [0, 3 * BS]


MODULES = """<schema name="shop">You answer for a bicycle shop. Its notes follow.
<module name="chains">Chains wear; a worn chain skips on the smallest cogs and wears the cassette.</module>
<module name="brakes">Rim brakes need pads with grooves; disc brakes need rotors free of oil.</module>
<module name="order">Order <param name="part" len="6"/> for the customer.</module>
</schema>"""
ASK = " My chain skips on the smallest cogs and the brakes squeal, what should I look at first?" * 2
SHOP = f'<prompt schema="shop"><chains/><brakes/><order part="a chain"/>{ASK}</prompt>'


def test_a_schemas_modules_are_public_under_the_scope(tiny_config_path: Path) -> None:
    """A salted PML prompt whose public tokens cover its module rows reads its schema's modules as
    encoded at registration, unsalted, like every tenant (neither tenant encodes anything) while its
    arguments and text stay its own; without them a salt encodes its own modules, as before. Greedy
    tokens agree."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", dtype="float32", num_kv_blocks=256,
        module_recompute="none", progress=False,
    )  # fmt: skip
    llm.register_schema(MODULES)

    def run(salt: str, public: int) -> tuple[list[int], int, int]:
        before = llm.metrics()["module_encodes_total"]
        prompt = {"prompt": SHOP, "cache_salt": salt, "public_tokens": public}
        out = llm.generate(prompt, GREEDY)[0]
        encoded = llm.metrics()["module_encodes_total"] - before
        return out.outputs[0].token_ids, encoded, out.num_cached_tokens

    a, encoded_a, cached_a = run("tenant-a", 4096)
    b, encoded_b, cached_b = run("tenant-b", 4096)
    c, encoded_c, _ = run("tenant-c", 0)
    again, _, cached_again = run("tenant-a", 4096)
    assert encoded_a == encoded_b == 0 and encoded_c > 0  # the scope shares them; "prompt" does not
    assert cached_b == cached_a  # the modules only: tenant-a's own blocks are not tenant-b's
    assert cached_again >= cached_a + 2 * BS  # tenant-a's own blocks are its own to hit
    assert a == b == c == again
    held = llm.engine.modules
    salts = {salt for (_, salt) in held.schemas["shop"].keys}
    assert salts == {None, "tenant-c"}
    assert not llm.engine.requests and llm.engine.pool.num_used == held.gpu_blocks
