"""The replicas' Prometheus metrics as one exposition with a ``replica`` label on every sample.

Each replica's /metrics is the single server's (``openai/metrics.py``); the ingress scrapes them and
serves them together, so one scrape of the replicated endpoint shows every engine apart. Families are
merged (one HELP and TYPE per family, all replicas' samples under it), as Prometheus requires.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    """A collector yielding the merged families (prometheus_client formats them)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_replica_metrics(texts: Mapping[str, str], label: str = "replica") -> bytes:
    """``texts``: each replica's exposition text by replica name; returns one exposition."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                merged.add_sample(s.name, {label: replica, **s.labels}, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))  # type: ignore[arg-type]
    return bytes(generate_latest(registry))


__all__ = ["merge_replica_metrics"]
