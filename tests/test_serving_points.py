"""The serving benchmark counts a rate as kept up with only when it is served, not just when latency
looks fine: a point that served 18.4 of 48 offered requests a second is over, whatever its latency."""

from __future__ import annotations

import pytest

from benchmarks.serving_gpu.points import over, summarize, sustainable

SLO = 0.05  # seconds per token


def _point(rate: float, served: float, norm: float = 0.01) -> dict:
    return {
        "rate_req_s": rate,
        "throughput_req_s": served,
        "norm_latency_mean": norm,
        "backlog_growth_s": 0.0,
    }


def test_a_rate_not_served_is_over() -> None:
    assert not over(_point(16, 15.9), SLO, 1.0)
    assert over(_point(48, 18.4), SLO, 1.0)  # latency within the SLO, but most of the load not served
    assert over(_point(16, 16.0, norm=0.2), SLO, 1.0)
    rates = sustainable([_point(16, 15.9), _point(32, 31.0), _point(48, 18.4)], SLO, 1.0)
    assert rates["measured"] == 32 and rates["bound"] == "between 32 and 48"


def test_goodput_counts_requests_within_the_slo() -> None:
    fast = {"error": None, "sent": 0.0, "due": 0.0, "first": 0.1, "end": 1.0, "tokens": 100, "chunks": []}
    slow = dict(fast, end=10.0)  # 0.1 s a token: over the SLO
    for r in (fast, slow):
        r.update(cached_tokens=0, prompt_tokens=10)
    out = summarize([fast, slow], 0.0, SLO)
    assert out["throughput_req_s"] == 2 / 10.0 and out["goodput_req_s"] == 1 / 10.0


def test_sustained_rate_interpolates_on_every_measure_that_failed() -> None:
    """Between the last rate kept up with and the first not, each failed measure is interpolated to
    its bound and the lowest crossing is the sustained rate: a rate that served too few requests
    counts even where its latency was also over (before, latency alone was interpolated)."""
    served_only = sustainable([_point(32, 31.7), _point(48, 34.8)], SLO, 1.0)  # 0.99 -> 0.725 served
    assert served_only["interpolated"] == pytest.approx(32 + (0.990625 - 0.95) / (0.990625 - 0.725) * 16)
    both = [_point(16, 16.0, norm=0.01), _point(24, 21.1, norm=0.052)]  # 0.88 served, latency just over
    got = sustainable(both, SLO, 1.0)["interpolated"]
    assert got == pytest.approx(16 + 0.05 / 0.12083333 * 8, rel=1e-4) and got < 20  # not 23.6
    latency_only = sustainable([_point(16, 16.0, norm=0.01), _point(24, 24.0, norm=0.09)], SLO, 1.0)
    assert latency_only["interpolated"] == pytest.approx(20.0)
    queued = dict(_point(24, 24.0), backlog_growth_s=9.0)
    assert sustainable([_point(16, 16.0), queued], SLO, 1.0)["interpolated"] == 16
