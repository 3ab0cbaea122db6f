"""The soak run's verdicts on issue 55's targets, its Markdown and its plot (``benchmarks/soak.py``).

Judged on bursts past the warm-up: "first" and "last" are medians over ``window`` bursts of a kind
(one burst's tokens/s moves by a few percent with the client processes and the GC; a median of a
few does not), so the speed target compares the pool's fresh start with its wrapped steady state.
Memory is judged from the first burst after the pool wrapped (``_settled``): before it, what the
pool's size bounds still fills; the growth from the warm-up and a fitted slope are kept beside it.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness import pyplot, write_text
from benchmarks.harness.output import write_json

SPEED_MIN = 0.95  # last bursts' tokens/s over the first's, for chats and for documents
GROWTH_MAX = 0.01  # resident and CUDA memory, last window over first, after warm-up


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _settled(timed: list[dict[str, Any]], bursts: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    """The bursts memory is judged on: those after the first that evicted from the prefix cache. Until
    the pool has wrapped once, what is sized by it (the prefix index, its digests, the host-side books
    of cached blocks) still fills; after it, a server's memory is what it will be for days. All timed
    bursts when too few of them come after it to judge (2 windows of each end)."""
    wrapped = next((b["i"] for b in bursts if b["evicted_blocks"] > 0), None)
    after = [b for b in timed if wrapped is not None and b["i"] > wrapped]
    return after if len(after) >= 4 * window else timed


def _slope(points: list[tuple[int, float | None]]) -> float:
    """Least-squares growth per burst (0 for fewer than two points)."""
    pts = [(x, y) for x, y in points if y is not None]
    if len(pts) < 2:
        return 0.0
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else 0.0


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Speed ratios, memory growth, leaks and totals, each target with its verdict."""
    window = int(result["settings"]["window"])
    bursts = result["bursts"]
    timed = [b for b in bursts if not b["warm"]]
    targets: dict[str, dict[str, Any]] = {}
    for kind in ("chat", "document"):
        mine = [b for b in timed if b["kind"] == kind]
        first = _median([b["tok_s"] for b in mine[:window]])
        last = _median([b["tok_s"] for b in mine[-window:]])
        ratio = last / first if first and last is not None else None
        targets[f"{kind}_speed"] = {
            "first_tok_s": first,
            "last_tok_s": last,
            "first_burst_tok_s": mine[0]["tok_s"] if mine else None,  # single bursts, for the record
            "last_burst_tok_s": mine[-1]["tok_s"] if mine else None,
            "value": ratio,
            "bound": f">= {SPEED_MIN}",
            "ok": ratio is not None and ratio >= SPEED_MIN,
        }
    settled = _settled(timed, bursts, window)
    for key, field in (
        ("rss", "rss_bytes"),
        ("gpu_allocated", "gpu_allocated_bytes"),
        ("gpu_reserved", "gpu_reserved_bytes"),
    ):
        first = _median([b[field] for b in settled[: 2 * window]])
        last = _median([b[field] for b in settled[-2 * window :]])
        if not first:  # no CUDA memory on the CPU
            continue
        growth = last / first - 1
        start = _median([b[field] for b in timed[: 2 * window]])
        targets[f"{key}_growth"] = {
            "first_bytes": first,
            "last_bytes": last,
            "max_bytes": max(b[field] for b in timed if b[field] is not None),
            "from_burst": settled[0]["i"] if settled else None,
            "growth_since_warmup": last / start - 1 if start else None,  # not judged: fills included
            "per_100_bursts": _slope([(b["i"], b[field]) for b in settled]) * 100 / first,
            "value": growth,
            "bound": f"< {GROWTH_MAX}",
            "ok": growth < GROWTH_MAX,
        }
    split = {}  # not judged: which process, and which kind of memory, the growth is in
    for key in ("server", "children", "anon", "file"):
        first = _median([(b.get("memory") or {}).get(key) for b in settled[: 2 * window]])
        last = _median([(b.get("memory") or {}).get(key) for b in settled[-2 * window :]])
        if first:
            split[key] = {"first_bytes": first, "last_bytes": last, "growth": last / first - 1}
    end = result.get("end") or {}
    leaked = None
    if "kv_blocks_used" in end:
        leaked = end["kv_blocks_used"] - (result.get("kv_blocks_used_idle") or 0)
    targets["leaked_blocks"] = {"value": leaked, "bound": "== 0", "ok": leaked == 0}
    errors = sum(b["errors"] for b in bursts)
    targets["errors"] = {"value": errors, "bound": "== 0", "ok": errors == 0}
    total = result.get("kv_blocks_total") or 0
    evicted = sum(b["evicted_blocks"] for b in bursts)
    wrapped = next((b["i"] for b in bursts if b["evicted_blocks"] > 0), None)
    totals = {
        "first_eviction_burst": wrapped,  # bursts before it ran on a pool never wrapped
        "bursts": len(bursts),
        "requests": sum(b["requests"] for b in bursts),
        "generated_tokens": sum(b["generated_tokens"] for b in bursts),
        "evicted_blocks": evicted,
        "pool_turnovers": evicted / total if total else None,  # the cached contents replaced N times
        "scattered_allocations": sum(b["scattered_allocations"] for b in bursts),
        "run_evicted_blocks": sum(b["run_evicted_blocks"] for b in bursts),
        "preemptions": sum(b["preemptions"] for b in bursts),
        "free_fragmentation_max": max((b["free_fragmentation_max"] for b in bursts), default=0.0),
    }
    ok = all(t["ok"] for t in targets.values())
    return {"targets": targets, "memory_split": split, "totals": totals, "ok": ok}


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f} MiB"


SPLIT_NAMES = {
    "server": "the server process (HTTP)",
    "children": "its children (the engine process)",
    "anon": "anonymous (heaps, Python objects, pinned buffers), all processes",
    "file": "file-backed (libraries, mapped files), all processes",
}


def _memory_note(row: dict[str, Any] | None) -> str:
    """The resident memory's growth since the warm-up and its fitted slope, in a sentence."""
    if not row or row.get("growth_since_warmup") is None:
        return ""
    return (
        f"Resident memory from the warm-up on (the pool's fill included): {row['growth_since_warmup']:+.3f}; "
        f"fitted slope over the judged bursts: {row['per_100_bursts']:+.4f} of it per 100 bursts. "
    )


def _split_lines(split: dict[str, dict[str, float]]) -> list[str]:
    """The resident memory's growth by process and by kind (the same windows as rss_growth)."""
    if not split:
        return []
    lines = ["Resident memory by process and by kind (not judged: where rss_growth comes from):", ""]
    lines += ["| part | first | last | growth |", "| --- | ---: | ---: | ---: |"]
    for key, row in split.items():
        lines.append(
            f"| {SPLIT_NAMES[key]} | {_mib(row['first_bytes'])} | {_mib(row['last_bytes'])} "
            f"| {row['growth']:+.3f} |"
        )
    return [*lines, ""]


def report(result: dict[str, Any], out_dir: Path) -> None:
    """NAME.json, NAME.md and NAME.png into ``out_dir``."""
    name = result["settings"]["name"]
    result["summary"] = summary = summarize(result)
    write_json(out_dir / f"{name}.json", result, indent=1)
    s, run, t, tot = result["settings"], result["run"], summary["targets"], summary["totals"]
    lines = [
        f"# Soak: {tot['bursts']} bursts over one server ({result['model_name']}, {s['device']})",
        "",
        f"{run['device']}, commit {run['commit']}, {run['date']}; torch {run['torch']}. "
        f"Server up in {_fmt(result.get('server_start_s'), '.0f')} s; the bursts took "
        f"{_fmt(result.get('wall_s'), '.0f')} s. Command: `python -m benchmarks.soak run "
        f"--device {s['device']} --bursts {s['bursts']}` (other options at their defaults unless listed in "
        f"the JSON's settings).",
        "",
        f"Bursts alternate: {s['chats']} chats at once after one of {s['system_prompts']} system prompts "
        f"of {s['system_tokens']} tokens (taken in turn: cached, reused, evicted; user turns "
        f"{s['user_tokens'][0]}-{s['user_tokens'][1]} tokens, answers {s['output_tokens'][0]}-"
        f"{s['output_tokens'][1]}), and a new {s['doc_tokens']}-token document with {s['questions']} "
        f"questions at once ({s['gen']}-token answers). Pool: {_fmt(result.get('kv_blocks_total'), '.0f')} "
        f"blocks; its cached contents were replaced {_fmt(tot['pool_turnovers'], '.1f')} times "
        f"({tot['evicted_blocks']:,.0f} blocks evicted, {tot['run_evicted_blocks']:,.0f} of them to give a "
        f"long allocation one run). {tot['requests']:,} requests, {tot['generated_tokens']:,} tokens "
        "generated.",
        "",
        "## Targets",
        "",
        "| target | first | last | value | bound | verdict |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for key, row in t.items():
        if key.endswith("_speed"):
            first, last = (
                _fmt(row["first_tok_s"], ",.0f") + " tok/s",
                _fmt(row["last_tok_s"], ",.0f") + " tok/s",
            )
        elif key.endswith("_growth"):
            first, last = _mib(row["first_bytes"]), _mib(row["last_bytes"])
        else:
            first = last = ""
        verdict = "met" if row["ok"] else "**missed**"
        lines.append(f"| {key} | {first} | {last} | {_fmt(row['value'])} | {row['bound']} | {verdict} |")
    lines += [
        "",
        f"Speed: medians of the first and last {s['window']} bursts of a kind after {s['warmup']} warm-up "
        "bursts of each; memory: medians of the first and last "
        f"{2 * s['window']} bursts from burst {_fmt(t.get('rss_growth', {}).get('from_burst'))} (the "
        "first after the pool wrapped, when enough bursts follow it; else after warm-up). "
        f"{_memory_note(t.get('rss_growth'))}Scattered allocations (long allocations split in "
        f"several runs of block ids): {tot['scattered_allocations']:.0f}; worst free-space fragmentation "
        f"seen during a burst (share of free blocks outside the longest free run): "
        f"{tot['free_fragmentation_max']:.2f}; preemptions: {tot['preemptions']:.0f}. The pool first "
        f"evicted in burst {_fmt(tot['first_eviction_burst'])}: bursts before it ran on an unwrapped pool.",
        "",
        *_split_lines(summary.get("memory_split") or {}),
        "## Bursts (every tenth, and the last two)",
        "",
        "| # | kind | tok/s | s | peak blocks | max frag. | scattered | evicted | RSS | CUDA reserved "
        "| errors |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    bursts = result["bursts"]
    shown = [b for b in bursts if b["i"] % 10 == 0 or b["i"] >= len(bursts) - 2]
    for b in shown:
        lines.append(
            f"| {b['i']}{' (warm-up)' if b['warm'] else ''} | {b['kind']} | {b['tok_s']:,.0f} "
            f"| {b['time_s']:.2f} | {b['blocks_used_peak']:,.0f} | {b['free_fragmentation_max']:.2f} "
            f"| {b['scattered_allocations']:.0f} | {b['evicted_blocks']:,.0f} | {_mib(b['rss_bytes'])} "
            f"| {_mib(b['gpu_reserved_bytes'])} | {b['errors']} |"
        )
    write_text(out_dir, f"{name}.md", lines)
    plot(result, out_dir / f"{name}.png")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    bursts = result["bursts"]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax = axes[0]
    for kind, color in (("chat", "tab:blue"), ("document", "tab:orange")):
        mine = [b for b in bursts if b["kind"] == kind]
        ax.plot([b["i"] for b in mine], [b["tok_s"] for b in mine], ".-", color=color, label=f"{kind} bursts")
    wrapped = result.get("summary", {}).get("totals", {}).get("first_eviction_burst")
    if wrapped is not None:
        ax.axvline(wrapped, color="grey", ls="--", lw=1, label="first eviction (the pool wraps)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"Soak: {len(bursts)} bursts over one server ({result['run']['device']})")
    ax = axes[1]
    ax.plot([b["i"] for b in bursts], [(b["rss_bytes"] or 0) / 2**20 for b in bursts], label="server RSS")
    if any(b["gpu_reserved_bytes"] for b in bursts):
        ax.plot(
            [b["i"] for b in bursts],
            [(b["gpu_reserved_bytes"] or 0) / 2**20 for b in bursts],
            label="CUDA reserved",
        )
        ax.plot(
            [b["i"] for b in bursts],
            [(b["gpu_allocated_bytes"] or 0) / 2**20 for b in bursts],
            label="CUDA allocated",
        )
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot([b["i"] for b in bursts], [b["blocks_used_peak"] for b in bursts], label="peak blocks in use")
    ax.plot(
        [b["i"] for b in bursts], [b["blocks_used_after"] or 0 for b in bursts], label="blocks in use after"
    )
    ax.set_ylabel("KV blocks")
    ax.legend(fontsize=8)
    ax = axes[3]
    ax.plot(
        [b["i"] for b in bursts],
        [b["free_fragmentation_max"] for b in bursts],
        label="max free fragmentation",
    )
    ax2 = ax.twinx()
    cum, acc = [], 0.0
    for b in bursts:
        acc += b["scattered_allocations"]
        cum.append(acc)
    ax2.plot([b["i"] for b in bursts], cum, color="tab:red", label="scattered allocations (cumulative)")
    ax.set_ylabel("fragmentation")
    ax2.set_ylabel("scattered allocations")
    ax.set_xlabel("burst")
    fig.legend(loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["report", "summarize"]
