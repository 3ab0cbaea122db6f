"""What one load point measured: latency and throughput from the clients' records; the sustainable rate."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.harness import mean, pct

SERVED_FRACTION = 0.95  # a rate is kept up with only if at least this share of it is served


def summarize(results: list[dict[str, Any]], start_at: float, slo: float | None = None) -> dict[str, Any]:
    """Latency and throughput of one point, from the clients' records; with ``slo`` (seconds per
    token) also the goodput: requests a second that finished within it."""
    ok = [r for r in results if r["error"] is None and r["end"] is not None and r["tokens"] > 0]
    errors = [r["error"] for r in results if r["error"] is not None]
    out: dict[str, Any] = {"requests": len(results), "ok": len(ok), "errors": len(errors)}
    if errors:
        out["error_kinds"] = sorted({e.split(":")[0] for e in errors})
        out["error_sample"] = errors[0][:300]
    if not ok:
        return out
    e2e = [r["end"] - r["sent"] for r in ok]
    first = [(r["first"] if r["first"] is not None else r["end"]) - r["sent"] for r in ok]
    norm = [(r["end"] - r["sent"]) / r["tokens"] for r in ok]
    tpot = [(e - f) / (r["tokens"] - 1) for r, e, f in zip(ok, e2e, first, strict=True) if r["tokens"] > 1]
    gaps: list[float] = []
    max_gap = 0.0
    for r in ok:
        prev = None
        for t, k in r.get("chunks") or []:
            if prev is not None:
                gaps += [(t - prev) / k] * k
                max_gap = max(max_gap, t - prev)
            prev = t
    span = max(r["end"] for r in ok) - min(r["due"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    # the queue building up: TTFT of the last quarter of arrivals against the first quarter's (a finite
    # window hides an overload from the mean latency, not from this)
    by_due = [f for _, f in sorted(zip([r["due"] for r in ok], first, strict=True))]
    quarter = max(1, len(by_due) // 4)
    backlog = mean(by_due[-quarter:]) - mean(by_due[:quarter])
    lag = [r["sent"] - r["due"] for r in results if r.get("sent") is not None and r.get("due") is not None]
    counted = sum(r.get("counted", 0) for r in ok)
    out.update(
        duration_s=span,
        throughput_req_s=len(ok) / span,
        throughput_tok_s=tokens / span,
        generated_tokens=tokens,
        norm_latency_mean=mean(norm),
        norm_latency_p99=pct(norm, 0.99),
        e2e_mean_s=mean(e2e),
        e2e_p99_s=pct(e2e, 0.99),
        ttft_mean_s=mean(first),
        ttft_p99_s=pct(first, 0.99),
        backlog_growth_s=backlog,
        itl_mean_s=mean(gaps),
        itl_p99_s=pct(gaps, 0.99),
        itl_max_s=max_gap,
        tpot_mean_s=mean(tpot),
        tpot_p99_s=pct(tpot, 0.99),
        cached_prompt_fraction=sum(r["cached_tokens"] for r in ok)
        / max(1, sum(r["prompt_tokens"] for r in ok)),
        prompt_tokens_mean=mean([float(r["prompt_tokens"]) for r in ok]),
        client_lag_max_s=max(lag) if lag else 0.0,
        client_lag_p99_s=pct(lag, 0.99) if lag else 0.0,
        streamed_token_fraction=counted / max(1, tokens),
    )
    if slo is not None:
        out["goodput_req_s"] = sum(n <= slo for n in norm) / span
    return out


def over(point: dict[str, Any], slo: float, backlog_s: float) -> bool:
    """The server did not keep up at this point: timed out, served fewer than ``SERVED_FRACTION`` of
    the offered requests a second (failed and unfinished ones count as not served), mean normalised
    latency over the SLO, or a queue that grew by more than ``backlog_s`` of TTFT across the window."""
    return bool(
        point.get("timed_out")
        or not point.get("throughput_req_s", 0.0) >= SERVED_FRACTION * point["rate_req_s"]
        or not point.get("norm_latency_mean", float("inf")) <= slo
        or not point.get("backlog_growth_s", float("inf")) <= backlog_s
    )


def sustainable(points: list[dict[str, Any]], slo: float, backlog_s: float = float("inf")) -> dict[str, Any]:
    """The highest rate the server keeps up with (``over``): measured, and interpolated linearly between
    the last point kept up with and the first not, on each measure that failed there (the served
    fraction against ``SERVED_FRACTION``, the normalised latency against the SLO), the lowest crossing;
    at the last rate kept up with where the first failure has no crossing (a timeout, a growing queue).
    Points in rate order."""
    pts = sorted(points, key=lambda p: p["rate_req_s"])
    last_ok = None
    first_bad = None
    for p in pts:
        if over(p, slo, backlog_s):
            first_bad = p
            break
        last_ok = p
    out: dict[str, Any] = {"slo_s_per_token": slo, "backlog_growth_limit_s": backlog_s}
    if last_ok is None:
        out.update(measured=None, interpolated=None, bound="below the lowest rate measured")
        out["lowest_rate"] = pts[0]["rate_req_s"] if pts else None
        return out
    out["measured"] = last_ok["rate_req_s"]
    if first_bad is None:
        out.update(interpolated=None, bound=f">= {last_ok['rate_req_s']:g} (never crossed)")
        return out
    r0, r1 = last_ok["rate_req_s"], first_bad["rate_req_s"]
    out["interpolated"] = _crossing(last_ok, first_bad, slo, backlog_s)
    out["bound"] = f"between {r0:g} and {r1:g}"
    return out


def _crossing(ok: dict[str, Any], bad: dict[str, Any], slo: float, backlog_s: float) -> float:
    """Where between a point kept up with and the next one not the first measure crossed its bound."""
    r0, r1 = ok["rate_req_s"], bad["rate_req_s"]
    if bad.get("timed_out") or not bad.get("backlog_growth_s", float("inf")) <= backlog_s:
        return r0  # no measure to interpolate on
    # each failed measure as (value where kept up, value where not, bound), rising past the bound
    measures = [
        (-ok["throughput_req_s"] / r0, -bad.get("throughput_req_s", 0.0) / r1, -SERVED_FRACTION),
        (ok["norm_latency_mean"], bad.get("norm_latency_mean", float("inf")), slo),
    ]
    rates = [r1]
    for v0, v1, bound in measures:
        if v1 > bound:  # this measure failed at r1
            rates.append(r0 + (bound - v0) * (r1 - r0) / (v1 - v0) if math.isfinite(v1) and v1 > v0 else r0)
    return min(rates)
