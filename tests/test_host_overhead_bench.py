"""benchmarks/host_overhead.py keeps running against the engine, and its proposed engine is exact."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import host_overhead as bench
from prefixserve.sampling.params import SamplingParams


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_measure_runs_and_accounts_for_the_step(mode: str) -> None:
    r = bench.measure(8, 64, 3, "engine", mode)
    parts = sum(v for k, v in r["mean_us"].items() if k != "total")
    assert r["mean_us"]["total"] > 0
    assert parts == pytest.approx(r["mean_us"]["total"], rel=0.05, abs=5)
    assert r["shared_segments_per_step"] > 0
    # every phase nests where the script expects it (else a component goes negative: update the script)
    assert min(r["mean_us"].values()) >= 0


def _run(variant: str, mode: str) -> tuple[list[list[int]], dict[str, float]]:
    eng, _ = bench.make_engine(12, 64, 8, variant, mode)
    rng = np.random.default_rng(1)
    shared = rng.integers(0, bench.VOCAB, 64).tolist()
    for i in range(12):
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(5, 40)), n=1 + i % 2)
        eng.add_request(f"r{i}", params=params, prompt_token_ids=shared + rng.integers(0, 32, 20).tolist())
        eng.step()
    while eng.has_unfinished():
        eng.step()
    tokens = [list(seq.token_ids) for req in eng._all_requests for seq in req.sequences]
    eng.pool.check_integrity()
    eng.blocks.check_tables()
    return tokens, dict(eng.counters)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_proposed_engine_generates_the_same(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = bench.Engine.add_request

    def add_request(self, *args, **kwargs):  # remember every request, finished ones included
        req = original(self, *args, **kwargs)
        self.__dict__.setdefault("_all_requests", []).append(req)
        return req

    monkeypatch.setattr(bench.Engine, "add_request", add_request)
    want = _run("engine", mode)
    got = _run("proposed", mode)
    assert got == want
