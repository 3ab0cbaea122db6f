"""The prefix-affinity router: its policy, the pools' cache events, and its index against real engines."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache_events import (
    MAX_CONSUMERS,
    CacheEventLog,
    CacheEvents,
    enable_cache_events,
    prompt_digests,
)
from prefixserve.ray_scaleout.router import PrefixIndex, Router, RoutingPolicy

BS = 4  # block size of the engines below: short prompts fill several blocks


def _digests(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def _router_holding(holdings: dict[str, list[bytes]], policy: RoutingPolicy | None = None) -> Router:
    router = Router(policy)
    for replica, digests in holdings.items():
        router.index.apply(replica, CacheEvents(added=digests, reset=True))
    return router


# ---- the policy ----------------------------------------------------------------------------------
def test_longest_cached_prefix_wins_while_load_is_within_the_threshold() -> None:
    router = _router_holding({"a": _digests("1", "2"), "b": _digests("1", "2", "3")})
    prompt = _digests("1", "2", "3", "4")
    assert router.choose(prompt, {"a": 0, "b": 0}) == "b"
    assert router.choose(prompt, {"a": 0, "b": 4}) == "b"  # 4 more: within max(4, 25%)
    assert router.choose(prompt, {"a": 40, "b": 50}) == "b"  # 10 more of 40: within 25%


def test_affinity_breaks_beyond_the_threshold_to_the_one_holding_most_of_the_rest() -> None:
    router = _router_holding({"a": _digests("1"), "b": _digests("1", "2", "3"), "c": []})
    prompt = _digests("1", "2", "3")
    assert router.choose(prompt, {"a": 2, "b": 7, "c": 2}) == "a"  # b overloaded; a holds 1 block
    assert router.choose(prompt, {"a": 3, "b": 7, "c": 2}) == "a"  # a within threshold, holds more
    assert router.choose(prompt, {"a": 9, "b": 9, "c": 2}) == "c"  # both holders overloaded


def test_misses_go_to_the_least_loaded_and_ties_to_the_less_loaded() -> None:
    router = _router_holding({"a": _digests("1"), "b": _digests("1")})
    assert router.choose(_digests("x", "y"), {"a": 3, "b": 1, "c": 2}) == "b"
    assert router.choose(_digests("1", "y"), {"a": 3, "b": 1}) == "b"
    assert router.choose([], {"a": 3, "b": 1}) == "b"  # a prompt shorter than a block


def test_misses_at_equal_load_take_turns_and_hits_do_not() -> None:
    router = Router()
    assert [router.choose(_digests(str(i)), {"a": 0, "b": 0, "c": 0}) for i in range(4)] == [
        "a",
        "b",
        "c",
        "a",
    ]
    router.index.apply("c", CacheEvents(added=_digests("p")))
    assert {router.choose(_digests("p", str(i)), {"a": 0, "b": 0, "c": 0}) for i in range(3)} == {"c"}


def test_sessions_stick_while_healthy_and_move_when_their_replica_goes() -> None:
    router = _router_holding({"a": _digests("1")})
    assert router.choose(_digests("9"), {"a": 5, "b": 0}, session="s") == "b"
    assert router.choose(_digests("1"), {"a": 0, "b": 9}, session="s") == "b"  # stuck despite a's cache
    assert router.choose(_digests("1"), {"a": 0}, session="s") == "a"  # b unhealthy: moves
    assert router.choose(_digests("9"), {"a": 5, "b": 0}, session="s") == "a"  # and sticks there
    router.forget_replica("a")
    assert router.index.digests_of("a") == set()
    assert router.choose(_digests("1"), {"a": 5, "b": 0}, session="s") == "b"


def test_bad_policy_and_no_replica_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="min_imbalance"):
        RoutingPolicy(min_imbalance=-1)
    with pytest.raises(RuntimeError, match="no healthy replica"):
        Router().choose([], {})


def test_index_match_counts_consecutive_leading_blocks_only() -> None:
    index = PrefixIndex()
    index.apply("a", CacheEvents(added=_digests("1", "3")))
    index.apply("b", CacheEvents(added=_digests("1", "2", "3")))
    assert index.match(_digests("1", "2", "3"), ["a", "b", "c"]) == {"a": 1, "b": 3, "c": 0}
    index.apply("b", CacheEvents(removed=_digests("2")))
    assert index.match(_digests("1", "2", "3"), ["a", "b"]) == {"a": 1, "b": 1}
    assert index.holders(b"3") == {"a", "b"}


# ---- the pool's events -----------------------------------------------------------------------------
def test_events_are_off_until_enabled_then_net_and_bounded() -> None:
    pool = BlockPool(4, 2)
    (b,) = pool.allocate(1)
    pool.register(b, b"d0")
    assert pool.cache_events is None  # nobody asked: nothing is logged
    log = enable_cache_events(pool, limit=3)
    assert log.drain() == CacheEvents(added=[b"d0"], reset=True)  # the first drain is a snapshot
    pool.release([b])
    pool.allocate(4)  # evicts d0
    assert log.drain() == CacheEvents(removed=[b"d0"])
    pool.release([0, 1, 2, 3])
    for i in range(4):  # 4 events > limit 3: the next drain is a snapshot
        (b,) = pool.allocate(1)
        pool.register(b, f"e{i}".encode())
    drained = log.drain()
    assert drained.reset and sorted(drained.added) == [b"e0", b"e1", b"e2", b"e3"]
    with pytest.raises(ValueError, match="limit"):
        enable_cache_events(BlockPool(2, 2), limit=0)


def test_each_consumer_follows_from_its_own_cursor() -> None:
    """Two routers (two ingresses) drain one log: each gets every change, whenever it drains."""
    held: set[bytes] = set()
    log = CacheEventLog(lambda: sorted(held), limit=100)
    log.added(b"before")  # nobody follows yet: not logged
    held.add(b"x")
    assert log.drain(consumer="a") == CacheEvents(added=[b"x"], reset=True)
    held.add(b"y")
    log.added(b"y")
    assert log.drain(consumer="b") == CacheEvents(added=[b"x", b"y"], reset=True)
    held.discard(b"x")
    log.removed(b"x")
    assert log.drain(consumer="b") == CacheEvents(removed=[b"x"])
    assert log.drain(consumer="a") == CacheEvents(added=[b"y"], removed=[b"x"])  # both, since its last
    assert log.drain(consumer="a") == CacheEvents() and not log._log  # seen by all: trimmed
    assert log.drain(full=True, consumer="b").reset  # a consumer that lost a drain resyncs
    assert log.consumers == {"a", "b"}


def test_a_consumer_that_stops_draining_is_dropped_and_resyncs() -> None:
    """The log never holds more than ``limit`` events for a consumer that went away; when it comes
    back its drain is a snapshot, and the consumer that kept draining lost nothing."""
    held: set[bytes] = set()
    log = CacheEventLog(lambda: sorted(held), limit=4)
    log.drain(consumer="live")
    log.drain(consumer="gone")
    for i in range(10):
        digest = f"d{i}".encode()
        held.add(digest)
        log.added(digest)
        assert len(log._log) <= 4
        if i % 3 == 0:
            assert log.drain(consumer="live").added == [
                f"d{j}".encode() for j in range(i - 2, i + 1) if j >= 0
            ]
    assert "gone" not in log.consumers and "live" in log.consumers
    back = log.drain(consumer="gone")
    assert back.reset and set(back.added) == held
    assert log.drain(consumer="live") == CacheEvents()  # d9 came with its last drain
    for i in range(MAX_CONSUMERS + 1):  # consumers too are bounded: the one furthest behind goes
        log.drain(consumer=f"c{i}")
    assert len(log.consumers) == MAX_CONSUMERS


def test_prompt_digests_are_the_engines_own(tiny_config_path: Path) -> None:
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", block_size=BS, num_kv_blocks=64, progress=False
    )
    ids = list(range(100, 123))  # 23 tokens: 5 full blocks cacheable
    llm.generate([{"prompt_token_ids": ids, "cache_salt": "t"}], SamplingParams(max_tokens=1))
    digests = prompt_digests(ids, BS, salt="t")
    assert len(digests) == 5
    assert set(digests) <= set(llm.engine.pool.cached_digests())
    assert not set(prompt_digests(ids, BS)) & set(llm.engine.pool.cached_digests())  # salt counts
    with pytest.raises(ValueError, match="positions"):
        prompt_digests(ids, BS, positions=[0, 1])
    assert enable_cache_events(llm.engine.pool).drain().root is None  # a model-dtype pool: b"root"


def test_an_fp8_pools_digests_are_predicted_from_the_root_its_events_carry(tiny_config_path: Path) -> None:
    """An FP8 KV cache chains its digests from a root naming its scheme and scales, so a router that
    predicts with the model-dtype root finds none of its blocks; the root comes with every drain."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        block_size=BS,
        num_kv_blocks=64,
        kv_cache_dtype="fp8",
        progress=False,
    )
    log = enable_cache_events(llm.engine.pool)
    assert log.drain().root == llm.engine.pool.root is not None
    ids = list(range(200, 223))
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))
    events = log.drain()
    assert events.root == llm.engine.pool.root
    digests = prompt_digests(ids, BS, root=events.root)
    assert len(digests) == 5 and set(digests) <= set(events.added)
    assert not set(prompt_digests(ids, BS)) & set(llm.engine.pool.cached_digests())


# ---- the index against real engines ------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_config_path: Path) -> dict[str, LLM]:
    """Three tiny engines with pools small enough that a few requests evict blocks."""
    llms = {
        name: LLM(
            model=f"dummy:{tiny_config_path}", device="cpu", block_size=BS, num_kv_blocks=24, progress=False
        )
        for name in ("r0", "r1", "r2")
    }
    enable_cache_events(llms["r2"].engine.pool, limit=5)  # r2 overflows often: snapshots get exercised
    return llms


@pytest.fixture(scope="module")
def routers() -> tuple[Router, Router]:
    """Two routers over ``engines`` for all the examples (two ingresses, each its own consumer of the
    engines' events): both indexes must track them throughout."""
    return Router(), Router()


PREFIXES = [list(range(10 + 40 * k, 10 + 40 * k + 13)) for k in range(4)]  # 4 shared 13-token starts
request = st.tuples(st.integers(0, 3), st.lists(st.integers(5, 900), min_size=0, max_size=9))
step = st.tuples(request, st.integers(0, 2), st.booleans(), st.booleans(), st.booleans())
requests = st.lists(step, min_size=1, max_size=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests)
def test_router_index_equals_every_engines_prefix_cache(
    engines: dict[str, LLM],
    routers: tuple[Router, Router],
    steps: list[tuple[tuple[int, list[int]], int, bool, bool, bool]],
) -> None:
    """Random requests, routed by either router or sent anywhere, on engines that evict; after each,
    each router drains or not (two ingresses polling at their own times): a router that drained
    holds exactly each engine's prefix cache."""
    replicas = engines
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for (prefix, tail), load_bias, routed, drains_a, drains_b in steps:
        ids = PREFIXES[prefix] + tail
        digests = prompt_digests(ids, BS)
        loads = {r: (load_bias * 3 if i == load_bias else 0) for i, r in enumerate(replicas)}
        router = routers[load_bias % 2]
        target = router.choose(digests, loads) if routed else list(replicas)[load_bias]
        replicas[target].generate([{"prompt_token_ids": ids}], params)
        for consumer, (follower, drains) in enumerate(zip(routers, (drains_a, drains_b), strict=True)):
            if not drains:
                continue
            for name, llm in replicas.items():
                follower.index.apply(name, llm.engine.drain_cache_events(consumer=f"ingress-{consumer}"))
                assert follower.index.digests_of(name) == set(llm.engine.pool.cached_digests()), name


def test_the_index_holds_through_evictions(engines: dict[str, LLM], routers: tuple[Router, Router]) -> None:
    """Whatever examples hypothesis drew above, every engine now evicts (distinct prompts filling a
    pool of 24 blocks several times over), and both routers' indexes still equal each prefix cache."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for name, llm in engines.items():
        before = llm.engine.pool.evictions
        for k in range(12):
            llm.generate([{"prompt_token_ids": list(range(2000 + 40 * k, 2000 + 40 * k + 17))}], params)
        assert llm.engine.pool.evictions > before, name
        for consumer, router in enumerate(routers):
            router.index.apply(name, llm.engine.drain_cache_events(consumer=f"ingress-{consumer}"))
            assert router.index.digests_of(name) == set(llm.engine.pool.cached_digests()), name


def test_replica_metrics_merge_into_one_family_each_with_a_replica_label() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from prefixserve.ray_scaleout.serve_metrics import merge_replica_metrics

    texts = {}
    for name, count in (("replica-0", 2), ("replica-1", 5)):
        registry = CollectorRegistry()
        Counter("prefixserve_requests", "Requests", ["route"], registry=registry).labels("/v1").inc(count)
        texts[name] = generate_latest(registry).decode()
    merged = merge_replica_metrics(texts).decode()
    assert merged.count("# TYPE prefixserve_requests_total counter") == 1
    (family,) = [f for f in text_string_to_metric_families(merged) if f.name == "prefixserve_requests"]
    got = {(s.labels["replica"], s.value) for s in family.samples if s.name.endswith("_total")}
    assert got == {("replica-0", 2.0), ("replica-1", 5.0)}


def test_round_robin_ignores_prefixes_and_takes_turns() -> None:
    a, b = b"a" * 16, b"b" * 16
    router = _router_holding({"r0": [a, b], "r1": []}, RoutingPolicy(routing="round_robin"))
    picks = [router.choose([a, b], {"r0": 0, "r1": 0}) for _ in range(4)]
    assert picks == ["r0", "r1", "r0", "r1"]
    assert router.choose([a], {"r1": 0}) == "r1"  # only the healthy ones take turns
    with pytest.raises(ValueError, match="routing"):
        RoutingPolicy(routing="random")
