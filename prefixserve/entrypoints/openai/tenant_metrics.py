"""Per-tenant Prometheus counters with a bounded number of label values.

A tenant is a request's ``user`` (``scheduler/fair_share.py``); requests without one count as
``none``. Tenants are many and chosen by clients, so only heavy ones get a label of their own: the
first ``top`` tenants whose tokens surely reach ``1 / (2 top)`` of all tokens counted so far, once
``WARMUP x top`` requests are counted, found in bounded memory (Space-Saving, Metwally et al. 2005:
``8 top`` tenants tracked, a new one replacing the least counted and inheriting its count as its
error, so a heavy hitter is never missed and a light one is not taken for one). Every other tenant's requests,
and a labelled tenant's before it got its label, count under ``other``: each series only grows, and
there are at most ``top + 2`` of them per counter.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

OTHER, NONE = "other", "none"
LABEL_CHARS = 64  # a tenant's label is its name cut to this many characters
WARMUP = 16  # requests per label slot counted before any tenant is labelled
# (metric name, help, index in a tenant's totals)
COUNTERS = (
    ("tenant_requests", "requests finished, by tenant", 0),
    ("tenant_prompt_tokens_computed", "prompt tokens run through the model (not from cache), by tenant", 1),
    ("tenant_prompt_tokens_cached", "prompt tokens served from the prefix cache, by tenant", 2),
    ("tenant_generation_tokens", "tokens generated, by tenant", 3),
    ("tenant_queue_seconds", "time from arrival to first scheduled, summed, by tenant", 4),
)


class TenantMetrics(Collector):
    """The counters above; ``done`` from the engine thread, ``collect`` at scrape time."""

    def __init__(self, prefix: str, top: int = 20) -> None:
        if top < 1:
            raise ValueError(f"top must be >= 1, got {top}")
        self.prefix, self.top = prefix, top
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}  # label -> the COUNTERS' values
        self._tracked: dict[str, float] = {}  # Space-Saving: tenant -> tokens (an upper bound)
        self._errors: dict[str, float] = {}  # tenant -> the count it inherited (its overestimate)
        self._all = 0.0  # tokens of every tenant
        self._requests = 0
        self._labels: set[str] = set()

    def done(self, tenant: str | None, computed: int, cached: int, generated: int, queue_s: float) -> None:
        """A finished request's counts."""
        name = NONE if tenant is None else tenant[:LABEL_CHARS]
        tokens = computed + cached + generated
        with self._lock:
            label = self._label(name, tokens)
            row = self._totals.setdefault(label, [0.0] * len(COUNTERS))
            for i, value in enumerate((1, computed, cached, generated, max(0.0, queue_s))):
                row[i] += value

    def _label(self, name: str, tokens: int) -> str:
        self._all += tokens
        self._requests += 1
        if name in self._labels or name == NONE:
            return name
        tracked, errors = self._tracked, self._errors
        if name in tracked:
            tracked[name] += tokens
        elif len(tracked) < 8 * self.top:
            tracked[name] = tokens
        else:  # the least counted makes room, and its count is the newcomer's floor (and its error)
            least = min(tracked, key=tracked.__getitem__)
            errors.pop(least, None)
            errors[name] = tracked.pop(least)
            tracked[name] = errors[name] + tokens
        sure = tracked[name] - errors.get(name, 0.0)  # tokens it surely sent
        warm = self._requests >= WARMUP * self.top  # too few requests yet to tell heavy from first
        if warm and len(self._labels) < self.top and sure >= self._all / (2 * self.top):
            self._labels.add(name)
            del tracked[name]
            errors.pop(name, None)
            return name
        return OTHER

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            rows = {label: list(values) for label, values in self._totals.items()}
        for name, doc, i in COUNTERS:
            family = CounterMetricFamily(f"{self.prefix}_{name}", doc, labels=["tenant"])
            for label, values in sorted(rows.items()):
                family.add_metric([label], values[i])
            yield family


__all__ = ["NONE", "OTHER", "TenantMetrics"]
