"""Per-tenant metrics (issue 106): tokens computed, cached and generated and queue time by tenant, with
a bounded number of label values (the heavy tenants labelled, the rest as ``other``), over HTTP."""

from __future__ import annotations

import random
import uuid
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from prefixserve.entrypoints.openai.tenant_metrics import NONE, OTHER, TenantMetrics


def _values(metrics: TenantMetrics, name: str) -> dict[str, float]:
    out = {}
    for family in metrics.collect():
        for sample in family.samples:
            if sample.name == f"p_{name}_total":
                out[sample.labels["tenant"]] = sample.value
    return out


def test_heavy_tenants_get_labels_and_the_rest_count_as_other() -> None:
    """Two tenants with most of the traffic and 2,000 light ones: at most ``top`` labels plus ``other``
    and ``none``; the heavy two labelled; every token counted once; memory bounded; series only grow."""
    metrics, rng = TenantMetrics("p", top=4), random.Random(0)
    want = 0
    before: dict[str, float] = {}
    for i in range(6000):
        tenant = rng.choice(["heavy-a", "heavy-b"]) if i % 2 else f"light-{rng.randrange(2000)}"
        if i % 97 == 0:
            tenant = None
        metrics.done(tenant, computed=10, cached=5, generated=20, queue_s=0.01)
        want += 1
        if i % 500 == 0:
            now = _values(metrics, "tenant_requests")
            assert all(now.get(k, 0) >= v for k, v in before.items())  # counters never go back
            before = now
    requests = _values(metrics, "tenant_requests")
    assert {"heavy-a", "heavy-b"} <= set(requests) and OTHER in requests and NONE in requests
    assert len(requests) <= 4 + 2 and sum(requests.values()) == want
    assert len(metrics._tracked) <= 8 * 4
    assert _values(metrics, "tenant_generation_tokens")["heavy-a"] == 20 * requests["heavy-a"]


def _scrape(http: Any) -> dict[str, float]:
    """Each per-tenant counter of a live server, summed over its tenants."""
    out: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("prefixserve_tenant_"):
            name = line.split("{")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_server_counts_every_request_by_its_user(tiny_server: Any) -> None:
    """Three completions of one user: the counters (under ``other`` until the server has counted
    enough requests to label a heavy tenant) grow by 3 requests, 9 generated tokens, the prompts' tokens
    computed or cached, and their queue time."""
    import httpx

    user = f"tenant-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=tiny_server.url, timeout=120) as http:
        before = _scrape(http)
        prompts = 0
        for i in range(3):
            body = {"model": "default", "prompt": f"Count me {i} " * 20, "max_tokens": 3, "user": user}
            r = http.post("/v1/completions", json={**body, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            prompts += r.json()["usage"]["prompt_tokens"]
        after = _scrape(http)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew["prefixserve_tenant_requests_total"] == 3
    assert grew["prefixserve_tenant_generation_tokens_total"] == 9
    computed, cached = (
        grew["prefixserve_tenant_prompt_tokens_computed_total"],
        grew["prefixserve_tenant_prompt_tokens_cached_total"],
    )
    assert computed + cached == prompts and computed > 0
    assert grew["prefixserve_tenant_queue_seconds_total"] >= 0
    registry = CollectorRegistry()
    registry.register(TenantMetrics("q"))
    assert b"q_tenant_requests" in generate_latest(registry)
