"""The overload run's verdicts on issue 55's target, its Markdown and its plot (``benchmarks/overload.py``).

Judged on the R and 2R windows only (the ladder's points say how R was found): zero 5xx (a 503 is a
refusal), zero unresolved requests (neither served within their deadline nor refused), refusals at
2R at once (their p99 time within ``at_once``), and goodput(2R) / goodput(R) >= ``GOODPUT_MIN``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.harness import pyplot, write_text
from benchmarks.harness.output import write_json

GOODPUT_MIN = 0.9  # goodput at 2R over goodput at R
CLIENT_LAG_MAX_S = 0.25  # a load generator later than this sent an arrival schedule it was not given


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Each target with its value, bound and verdict, and warnings about the measurement itself."""
    w = result.get("windows") or {}
    at_once = float(result["settings"]["at_once"])
    judged = [w[k] for k in ("R", "2R") if k in w]
    targets: dict[str, dict[str, Any]] = {}
    fives = sum(s["http_5xx"] for s in judged)
    targets["no_5xx"] = {"value": fives, "bound": "== 0", "ok": bool(judged) and fives == 0}
    unresolved = sum(s["unresolved"] for s in judged)
    targets["all_resolved"] = {"value": unresolved, "bound": "== 0", "ok": bool(judged) and unresolved == 0}
    over = w.get("2R") or {}
    p99 = over.get("refusal_s_p99")
    refused = over.get("refused", 0)
    targets["refused_at_once"] = {
        "value": p99 if refused else None,
        "bound": f"p99 <= {at_once:g} s",
        "ok": bool(over) and (not refused or (p99 is not None and p99 <= at_once)),
    }
    ratio = None
    if "R" in w and "2R" in w and w["R"]["goodput_req_s"] > 0:
        ratio = w["2R"]["goodput_req_s"] / w["R"]["goodput_req_s"]
    targets["goodput_ratio"] = {
        "value": ratio,
        "bound": f">= {GOODPUT_MIN}",
        "ok": ratio is not None and ratio >= GOODPUT_MIN,
    }
    # issue 105: nothing captured or compiled once the server is ready, in any window (warm-up ones too)
    ladder = (result.get("ladder") or {}).get("points", [])
    served = [result.get("warm"), result.get("warm_overload"), *ladder]
    stalls = [(s.get("server") or {}) for s in [*served, *w.values()] if s]
    if stalls and all("graph_captures" in v for v in stalls):
        after = sum(v["graph_captures"] + v.get("compiles", 0) for v in stalls)
        targets["no_stall_after_ready"] = {"value": after, "bound": "== 0", "ok": after == 0}
    warnings = []
    for label, s in w.items():
        if s.get("client_lag_max_s", 0.0) > CLIENT_LAG_MAX_S:
            warnings.append(
                f"{label}: a client sent a request {s['client_lag_max_s']:.2f} s late (the load generator "
                "fell behind its schedule)"
            )
        loop_lag = (s.get("client_loop_lag") or {}).get("p99", 0.0)
        if loop_lag > CLIENT_LAG_MAX_S:
            warnings.append(
                f"{label}: a client's event loop ran {loop_lag:.2f} s late at its p99 (the load generator "
                "was too busy to read its streams: its times are inflated)"
            )
        if s["server"].get("http_5xx"):
            warnings.append(f"{label}: the server counted {s['server']['http_5xx']:.0f} 5xx answers")
    if result.get("exit_code") not in (0, None):
        warnings.append(f"the server exited {result.get('exit_code')} on SIGTERM")
    return {"targets": targets, "warnings": warnings, "ok": all(t["ok"] for t in targets.values())}


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def _row(s: dict[str, Any]) -> str:
    retry = "-" if s["retry_after_min"] is None else f"{s['retry_after_min']}-{s['retry_after_max']}"
    cells = [
        s["label"],
        f"{s['rate_req_s']:.3g}",
        s["requests"],
        s["served"],
        f"{s['goodput_req_s']:.2f}",
        s["refused_at_once"],
        s["refused_late"],
        f"{s['refused_429']} ({s['refused_429_retry_after']})",
        s["refused_503"],
        s["served_late"],
        s["http_4xx"],
        s["http_5xx"],
        s["client_timeout"],
        s["error"],
        s["unresolved"],
        f"{_fmt(s['ttft_p50_s'], '.2f')} / {_fmt(s['ttft_p99_s'], '.2f')}",
        f"{_fmt(s['refusal_s_p50'])} / {_fmt(s['refusal_s_p99'])}",
        retry,
        _fmt(s["client_lag_p99_s"]),
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


COLUMNS = [
    "window",
    "rate (req/s)",
    "requests",
    "served in deadline",
    "goodput (req/s)",
    "refused at once",
    "refused late",
    "429 (with Retry-After)",
    "503",
    "served late",
    "other 4xx",
    "5xx",
    "client timeouts",
    "other errors",
    "unresolved",
    "TTFT p50 / p99 (s)",
    "time to refusal p50 / p99 (s)",
    "Retry-After (s)",
    "client lag p99 (s)",
]
HEADER = ["| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]


def report(result: dict[str, Any], out_dir: Path) -> None:
    """NAME.json, NAME.md and NAME.png into ``out_dir``."""
    name = result["settings"]["name"]
    result["summary"] = summary = summarize(result)
    write_json(out_dir / f"{name}.json", result, indent=1)
    s, run = result["settings"], result["run"]
    w = result.get("windows") or {}
    d, slo = s["max_queue_delay"], s["slo"]
    lo, hi = s["output_tokens"]
    lines = [
        f"# Overload: Poisson chats at the sustainable rate and at twice it ({result['model_name']}, "
        f"{s['device']})",
        "",
        f"{run['device']}, commit {run['commit']}, {run['date']}; torch {run['torch']}, openai client "
        f"{run.get('openai')}. Server up in {_fmt(result.get('server_start_s'), '.0f')} s; the run took "
        f"{_fmt(result.get('wall_s'), '.0f')} s. Command: `python -m benchmarks.overload run --device "
        f"{s['device']}` (other options in the JSON's settings); server: `{s['server_command']}`.",
        "",
        f"Chats after one {s['system_prompt_tokens']}-token system prompt, user turns of "
        f"{s['user_tokens'][0]}-{s['user_tokens'][1]} tokens, answers of {lo}-{hi} tokens (EOS ignored, "
        f"streamed), Poisson arrivals from {s['clients']} client processes (the `openai` client, no "
        f"retries). Queue deadline D = {d:g} s (`--max-queue-delay`). A request's deadline is D + "
        f"{slo:g} s x its max_tokens ({d + slo * lo:g}-{d + slo * hi:g} s after it was sent); a refusal is "
        f"at once within {s['at_once']:g} s. Goodput: requests served within their deadline per second "
        "of arrivals.",
        "",
        f"R = **{_fmt(result.get('rate_req_s'), 'g')} req/s** "
        + (
            "(given with --rate)."
            if result.get("ladder") is None
            else f"(ladder: {result['ladder']['bound']}; a rate is sustained when >= 95% of its requests "
            "are served within their deadline and none got a 5xx)."
        ),
        "",
        "## Targets",
        "",
        "| target | value | bound | verdict |",
        "| --- | ---: | --- | --- |",
    ]
    for key, row in summary["targets"].items():
        verdict = "met" if row["ok"] else "**missed**"
        lines.append(f"| {key} | {_fmt(row['value'])} | {row['bound']} | {verdict} |")
    lines += ["", "## Windows", "", *HEADER]
    ladder = result.get("ladder") or {}
    shown = [ladder["burst"]] if ladder.get("burst") else ([result["warm"]] if result.get("warm") else [])
    shown += ladder.get("points", []) + ([result["warm_overload"]] if result.get("warm_overload") else [])
    shown += [w[k] for k in ("R", "2R") if k in w]
    lines += [_row(x) for x in shown]
    lines += [
        "",
        "The burst sends max-num-seqs chats at once (its rate: answers / time to all of them); ladder points "
        f"run {s['ladder_window']:g} s of arrivals, R and 2R {s['window']:g} s. Server counters over each "
        "window (429s at arrival by bound, and of them those decided in the HTTP process before the "
        "engine saw them; drops for the deadline, 5xx; the engine's mean arrival-to-first-token, how "
        "late the HTTP process's event loop ran on average: where a client's wait goes; CUDA graphs "
        "captured, Triton kernels compiled and engine steps over 0.5 s while serving, each stopping every "
        "stream and arrival):",
        "",
        "| window | refused: queue requests | queue tokens | deadline estimate | of them in HTTP "
        "| dropped for deadline | aborted | preemptions | 5xx | engine TTFT mean s | loop lag mean ms "
        "| graph captures (s) | graph misses | kernel compiles (s) | slow steps (s) |",
        "| --- " + "| ---: " * 14 + "|",
    ]
    rows = []
    for x in shown:
        v = x["server"]
        in_http = f"{v['refused_http']:.0f}" if "refused_http" in v else "-"  # runs before it was counted
        misses = f"{v['graph_misses']:.0f}" if "graph_misses" in v else "-"
        lines.append(
            f"| {x['label']} | {v['refused_queue_requests']:.0f} | {v['refused_queue_tokens']:.0f} "
            f"| {v['refused_deadline']:.0f} | {in_http} | {v['dropped_deadline']:.0f} | {v['aborted']:.0f} "
            f"| {v['preemptions']:.0f} | {v['http_5xx']:.0f} | {_mean(v, 'server_ttft', 1.0, '.2f')} "
            f"| {_mean(v, 'loop_lag', 1e3, '.1f')} | {_count_s(v, 'graph_captures', 'graph_capture_s')} "
            f"| {misses} "
            f"| {_count_s(v, 'compiles', 'compile_s')} | {_count_s(v, 'slow_steps', 'slow_step_host_s')} |"
        )
        rows.append(
            f"| {x['label']} | {_mean(v, 'intake', 1e3, '.1f')} | {_mean(v, 'to_engine', 1e3, '.1f')} "
            f"| {_mean(v, 'server_ttft', 1e3, '.1f')} | {_mean(v, 'from_engine', 1e3, '.1f')} "
            f"| {_mean(v, 'to_client', 1e3, '.1f')} | {_fmt(1e3 * x.get('ttft_mean_s', math.nan), '.1f')} "
            f"| {_mean(v, 'refusal', 1e3, '.1f')} | {_fmt(1e3 * x.get('refusal_s_mean', math.nan), '.1f')} |"
        )
    lines += [
        "",
        "A streamed request's way to its first token, server-side means over each window in ms (one "
        "monotonic clock): route start to handed to the engine (body, template, tokenization, gate), "
        "to the engine's arrival (queue or pipe, adds taken between steps), the engine's own arrival to "
        "first token, that output back in the HTTP process, to its first write; beside the clients' "
        "mean TTFT (what these do not cover: before the route started, the network, the client). "
        "Refusals: route start to the 429 written, beside the clients' mean time to a refusal:",
        "",
        "| window | intake | to engine | engine TTFT | first token back | first write | client TTFT "
        "| refusal (server) | refusal (client) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    lines += [
        "",
        "Refusals by kind, the clients' times from sent to the 429 in seconds: at arrival (the HTTP "
        "gate or the engine's check) and dropped from the queue after waiting (admitted on an estimate "
        "that proved short):",
        "",
        "Beside them, the engine's queue-wait estimate checked against the starts (mean estimated and "
        "actual wait of the requests that started, and how many started later than estimated by more "
        "than a quarter of the queue deadline), and the clients' own event-loop lateness (worst "
        "process, p99 / max):",
        "",
        "| window | at arrival | p50 / p99 | dropped | p50 / p99 | wait estimated / actual s | late starts "
        "| client loop lag p99 / max s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {x['label']} | {x['refused_at_arrival']} | {_fmt(x['refusal_at_arrival_s_p50'])} / "
            f"{_fmt(x['refusal_at_arrival_s_p99'])} | {x['refused_dropped']} | "
            f"{_fmt(x['refusal_dropped_s_p50'])} / {_fmt(x['refusal_dropped_s_p99'])} | "
            f"{_ratio(x['server'], 'wait_estimated', 'wait_starts')} / "
            f"{_ratio(x['server'], 'wait_actual', 'wait_starts')} | "
            f"{_fmt(x['server'].get('starts_late'), '.0f')} | "
            f"{_fmt((x.get('client_loop_lag') or {}).get('p99'))} / "
            f"{_fmt((x.get('client_loop_lag') or {}).get('max'))} |"
            for x in shown
            if "refused_dropped" in x
        ],
    ]
    samples = [f"{x['label']}: {x['error_sample']}" for x in shown if x.get("error_sample")]
    if samples or summary["warnings"]:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in summary["warnings"] + samples]
    write_text(out_dir, f"{name}.md", lines)
    plot(result, out_dir / f"{name}.png")


def _count_s(counters: dict, count: str, seconds: str) -> str:
    """ "N (S s)" from a count and a seconds counter ("-" where not scraped)."""
    if count not in counters:
        return "-"
    return f"{counters[count]:.0f} ({counters.get(seconds, 0.0):.1f})"


def _ratio(counters: dict, num: str, den: str) -> str:
    """A mean from two counters' deltas over the window ("-" where not scraped or nothing counted)."""
    n, d = counters.get(num), counters.get(den)
    return "-" if n is None or not d else f"{n / d:.2f}"


def _mean(counters: dict, name: str, scale: float, spec: str) -> str:
    """A histogram's mean over the window from its _sum and _count deltas ("-" where not scraped)."""
    total, count = counters.get(f"{name}_sum"), counters.get(f"{name}_count")
    return "-" if not count or total is None else format(scale * total / count, spec)


def plot(result: dict[str, Any], path: Path) -> None:
    """Outcomes of the R and 2R windows over arrival time, and goodput against the offered rate."""
    plt = pyplot()
    if plt is None:
        return
    w = result.get("windows") or {}
    bin_s = float(result["settings"]["bin_s"])
    fig, axes = plt.subplots(1, len(w) + 1, figsize=(5 * (len(w) + 1), 4))
    for ax, (label, s) in zip(axes, w.items(), strict=False):
        bins = s["bins"]
        x = [bin_s * (i + 0.5) for i in range(len(bins["served"]))]
        bottom = [0] * len(x)
        for key, color in (("served", "tab:green"), ("refused", "tab:orange"), ("other", "tab:red")):
            ys = [v / bin_s for v in bins[key]]
            ax.bar(x, ys, width=bin_s * 0.9, bottom=bottom, color=color, label=key)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        ax.set_title(f"{label}: {s['rate_req_s']:g} req/s offered")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("requests/s")
        ax.legend(fontsize=8)
    ax = axes[-1]
    ladder = result.get("ladder") or {}
    pts = ladder.get("points", [])
    if pts:
        ax.plot(
            [p["rate_req_s"] for p in pts],
            [p["goodput_req_s"] for p in pts],
            "o",
            color="grey",
            label="ladder",
        )
    judged = [w[k] for k in ("R", "2R") if k in w]
    ax.plot(
        [s["rate_req_s"] for s in judged],
        [s["goodput_req_s"] for s in judged],
        "s-",
        color="tab:blue",
        label="R, 2R",
    )
    top = max([s["rate_req_s"] for s in judged + pts] or [1.0])
    ax.plot([0, top], [0, top], ":", color="grey", lw=1, label="goodput = offered")
    ax.set_xlabel("offered (req/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.legend(fontsize=8)
    fig.suptitle(f"Overload ({result['run']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["report", "summarize"]
