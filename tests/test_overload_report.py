"""The overload benchmark's books: every request lands in exactly one outcome, a refusal after waiting
its queue deadline is not "at once", and the verdicts read the R and 2R windows only."""

from __future__ import annotations

import argparse

from benchmarks.overload import OUTCOMES, outcome, window_stats
from benchmarks.overload_report import summarize

ARGS = argparse.Namespace(max_queue_delay=2.0, slo=0.1, at_once=0.5, bin_s=1.0)


def _rec(i: int, **kw: object) -> dict:
    r = {"i": i, "due": 0.0, "sent": 0.0, "first": None, "end": None, "tokens": 0, "error": None}
    r.update(kw)
    return r


def test_each_record_is_one_outcome() -> None:
    served = _rec(0, first=0.2, end=3.0, tokens=10, finish="length")
    late = _rec(1, first=2.5, end=9.0, tokens=10, finish="length")  # deadline 2 + 0.1 x 10 = 3 s
    at_once = _rec(2, error="HTTP 429", status=429, failed=0.01, retry_after="2", code="queue_timeout")
    dropped = _rec(3, error="HTTP 429", status=429, failed=2.05, retry_after="1", code="queue_timeout")
    broken = _rec(4, first=0.2, end=1.0, tokens=3, finish="abort")
    kinds = [outcome(r, 3.0, 0.5) for r in (served, late, at_once, dropped, broken)]
    assert kinds == ["served", "served_late", "refused_at_once", "refused_late", "error"]
    assert outcome(_rec(5, error="HTTP 500", status=500, failed=0.1), 3.0, 0.5) == "http_5xx"
    assert outcome(_rec(6, error="HTTP 400", status=400, failed=0.1), 3.0, 0.5) == "http_4xx"
    assert outcome(_rec(7, error="deadline"), 3.0, 0.5) == "client_timeout"
    assert set(kinds) <= set(OUTCOMES)


def test_window_counts_and_verdicts() -> None:
    reqs = [{"i": i, "offset": i * 0.1, "body": {"max_tokens": 10}} for i in range(4)]
    fine = [_rec(i, first=0.1, end=1.0, tokens=10, finish="length") for i in range(4)]
    r = window_stats(ARGS, reqs, fine, rate=10.0)
    assert r["served"] == 4 and r["unresolved"] == 0 and r["goodput_req_s"] == 4 / 0.4
    over = [
        *fine[:2],
        _rec(2, error="HTTP 429", status=429, failed=0.01, retry_after="3"),
        _rec(3, first=0.1, end=9.0, tokens=10, finish="length"),  # served past its deadline
    ]
    o = window_stats(ARGS, reqs, over, rate=10.0)
    assert (o["served"], o["refused_at_once"], o["served_late"], o["unresolved"]) == (2, 1, 1, 1)
    assert o["refused_429_retry_after"] == 1 and o["retry_after_max"] == 3
    for s, label in ((r, "R"), (o, "2R")):
        s.update(label=label, server={})
    result = {"settings": {"at_once": 0.5}, "windows": {"R": r, "2R": o}}
    t = summarize(result)["targets"]
    assert t["no_5xx"]["ok"] and t["refused_at_once"]["ok"]
    assert not t["all_resolved"]["ok"] and t["all_resolved"]["value"] == 1
    assert t["goodput_ratio"]["value"] == 0.5 and not t["goodput_ratio"]["ok"]
