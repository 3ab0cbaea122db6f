"""Fair shares between tenants (``scheduling_policy="fair"``, issue 106): virtual token counters.

On the policy alone: the queue's order (least counter, then arrival), the lift of a tenant that
rejoins, the victim, the charge and its weights, bad weights refused. On the engine: two tenants that
both keep requests waiting receive service within the VTC paper's bound of each other at every step
(first come first served, given the same queue, does not: the test can fail); a light tenant's
requests keep flowing while a heavy one floods; greedy text is unchanged; no block leaks.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from types import SimpleNamespace

import engine_checks
import pytest

from prefixserve import SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.entrypoints.args import _tenant_weights
from prefixserve.scheduler.fair_share import OUTPUT_WEIGHT, PROMPT_WEIGHT, FairShare

PROMPT, OUTPUT = 12, 8  # each request's prompt tokens and generated tokens
COST = PROMPT_WEIGHT * PROMPT + OUTPUT_WEIGHT * OUTPUT  # one request's counted service


def _seq(tenant: str | None, arrival: float, prompt: int = 10, computed: int = 0) -> SimpleNamespace:
    request = SimpleNamespace(tenant=tenant, arrival_time=arrival)
    return SimpleNamespace(request=request, num_prompt_tokens=prompt, num_computed_tokens=computed)


def test_the_queue_follows_the_counters_and_a_returning_tenant_is_lifted() -> None:
    policy, waiting = FairShare({"b": 2.0}), deque()
    a1, a2, b1 = _seq("a", 0.0), _seq("a", 1.0), _seq("b", 2.0)
    for s in (a1, a2, b1):
        policy.enqueue(waiting, s)
    assert list(waiting) == [a1, a2, b1]  # all at 0: arrival order
    # a step of a1's prompt (10 tokens) and b1's prompt plus 2 drafts (12 tokens, weight 2)
    step = [SimpleNamespace(seq=a1, num_tokens=10), SimpleNamespace(seq=_seq("b", 3.0), num_tokens=12)]
    policy.charge(step)
    assert policy.counters == {"a": 10 * PROMPT_WEIGHT, "b": (10 * PROMPT_WEIGHT + 2 * OUTPUT_WEIGHT) / 2}
    waiting.remove(a1)
    policy.order(waiting)
    assert list(waiting) == [b1, a2]  # b's counter is the smaller now
    running = [a1, _seq("b", 4.0), _seq("b", 5.0)]
    assert policy.victim(running) is a1  # the tenant with the largest counter
    # tenant c arrives with nothing waiting: lifted to the least counter among those waiting (b's)
    policy.enqueue(waiting, _seq("c", 6.0))
    assert policy.counter("c") == policy.counter("b")
    # a decode step: one token at OUTPUT_WEIGHT
    policy.charge([SimpleNamespace(seq=_seq(None, 7.0, prompt=4, computed=9), num_tokens=1)])
    assert policy.counter(None) == OUTPUT_WEIGHT


@pytest.mark.parametrize("weights", [{"a": 0}, {"a": -1.0}, {"a": float("inf")}, {"a": "2"}, {"": 1.0}])
def test_bad_weights_are_refused_naming_the_tenant(weights: dict) -> None:
    with pytest.raises(ValueError, match="weight"):
        FairShare(weights)
    with pytest.raises(ValueError, match="weight"):
        EngineConfig(scheduling_policy="fair", tenant_weights=weights)
    with pytest.raises(ValueError, match="TENANT=WEIGHT"):
        _tenant_weights(["nameless"])
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, fair"):
        EngineConfig(scheduling_policy="lottery")


def _engine(tiny_config_path: Path, policy: str, **extra: object) -> Engine:
    settings: dict = dict(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", scheduling_policy=policy,
        enable_prefix_caching=False, **(settings | extra),
    )  # fmt: skip
    return Engine(config, progress=False)


PARAMS = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)


def _prompt(tenant: str, i: int) -> list[int]:
    return [100 + (7 * i + 13 * len(tenant) + k) % 3000 for k in range(PROMPT)]


def _service_gaps(engine: Engine, counts: dict[str, int]) -> tuple[list[float], dict[str, list[int]]]:
    """Queue ``counts[t]`` requests for each tenant (in that order, all at once) and run them; at each
    step while every tenant still has requests unfinished, the largest difference between two
    tenants' service so far (prompt tokens at their first output, then generated tokens, weighted as
    the counters are), measured from the outputs; and each tenant's finishing steps."""
    for tenant, n in counts.items():
        for i in range(n):
            ids = _prompt(tenant, i)
            engine.add_request(f"{tenant}-{i}", None, PARAMS, prompt_token_ids=ids, tenant=tenant)
    service = dict.fromkeys(counts, 0.0)
    left = dict(counts)
    seen: dict[str, int] = {}
    finished: dict[str, list[int]] = {t: [] for t in counts}
    gaps, step = [], 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            tenant = out.request_id.rsplit("-", 1)[0]
            done = len(out.outputs[0].token_ids)
            new = done - seen.get(out.request_id, 0)
            if new and out.request_id not in seen:
                service[tenant] += PROMPT_WEIGHT * PROMPT
            service[tenant] += OUTPUT_WEIGHT * new
            seen[out.request_id] = done
            if out.finished:
                left[tenant] -= 1
                finished[tenant].append(step)
        if all(left.values()):
            gaps.append(max(service.values()) - min(service.values()))
    return gaps, finished


def test_backlogged_tenants_get_service_within_the_bound(tiny_config_path: Path) -> None:
    """Tenant a queues 16 requests before tenant b's 16; 4 run at a time. With ``fair`` the two
    tenants' service differs by at most twice one request's cost plus one step's admissions at every
    step both are backlogged (the VTC paper's bound, with the step's granularity); first come first
    served serves a's whole backlog first, far past it. Texts are the greedy ones either way."""
    bound = 2 * COST + 4 * COST
    fair = _engine(tiny_config_path, "fair")
    gaps, _ = _service_gaps(fair, {"a": 16, "b": 16})
    assert gaps and max(gaps) <= bound, max(gaps)
    assert engine_checks.blocks_in_use(fair) == 0
    fcfs = _engine(tiny_config_path, "fcfs")
    gaps, _ = _service_gaps(fcfs, {"a": 16, "b": 16})
    assert max(gaps) > bound  # the same queue without counters: a is served first (3x here)


def test_a_light_tenant_keeps_flowing_while_a_heavy_one_floods(tiny_config_path: Path) -> None:
    """A heavy tenant queues 30 requests, then a light one 3, with weights 1 and 2: under ``fair`` the
    light tenant's requests all finish within the first rounds (its counter is lifted to the heavy
    one's on arrival, then grows at half the rate); under first come first served they finish last."""
    fair = _engine(tiny_config_path, "fair", tenant_weights={"light": 2.0})
    _, fair_done = _service_gaps(fair, {"heavy": 30, "light": 3})
    fcfs = _engine(tiny_config_path, "fcfs")
    _, fcfs_done = _service_gaps(fcfs, {"heavy": 30, "light": 3})
    assert max(fair_done["light"]) < min(fcfs_done["light"])
    assert max(fair_done["light"]) <= max(fair_done["heavy"]) / 4
    assert sorted(fcfs_done["light"])[0] >= max(fcfs_done["heavy"][:-3])
    assert engine_checks.blocks_in_use(fair) == 0


def test_samples_of_one_request_are_admitted_together(tiny_config_path: Path) -> None:
    """A sharing group is not split needlessly: tenant b's ``n=4`` request queued behind tenant a's
    backlog starts its four samples in one step (they share the counter's order), and they share the
    prompt's blocks; the texts are the greedy ones either way."""
    engine = _engine(tiny_config_path, "fair", max_num_seqs=8)
    for i in range(6):
        engine.add_request(f"a-{i}", None, PARAMS, prompt_token_ids=_prompt("a", i), tenant="a")
    group = SamplingParams(n=4, max_tokens=OUTPUT, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request("b-0", None, group, prompt_token_ids=_prompt("b", 0), tenant="b")
    started: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        engine.step()
        for seq in engine.scheduler.running:
            started.setdefault(f"{seq.request.request_id}/{seq.seq_id}", step)
    samples = {k: v for k, v in started.items() if k.startswith("b-0/")}
    assert len(samples) == 4 and len(set(samples.values())) == 1, samples
    assert engine_checks.blocks_in_use(engine) == 0


def test_each_api_key_is_a_tenant(tiny_config_path: Path) -> None:
    """A server with two API keys counts each key's requests to its own tenant, whatever ``user`` the
    body claims (a client cannot speak for another tenant); the key itself is not the name."""
    import httpx

    from prefixserve.entrypoints.openai.requests import key_tenant
    from prefixserve.entrypoints.openai.server import ServerThread, build_app

    engine = _engine(tiny_config_path, "fair")
    app = build_app(engine=engine, api_key=["key-one", "key-two"])
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        for key in ("key-one", "key-two", "key-two"):
            body = {"model": "default", "prompt": "hello tenants", "max_tokens": 2, "user": "mallory"}
            r = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert http.post("/v1/completions", json=body, headers={"x-api-key": "other"}).status_code == 401
    counters = engine.scheduler.policy.counters
    one, two = key_tenant("key-one"), key_tenant("key-two")
    assert set(counters) == {one, two} and counters[two] > counters[one] > 0
    assert "key-one" not in one
