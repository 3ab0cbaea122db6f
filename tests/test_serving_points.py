"""The serving benchmark counts a rate as kept up with only when it is served, not just when latency
looks fine: a point that served 18.4 of 48 offered requests a second is over, whatever its latency."""

from __future__ import annotations

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
