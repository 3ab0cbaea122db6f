"""The report: issues the load exposed, Markdown tables and the plot, from a result (no device needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

NAME = "serving_gpu"
SECTIONS = ("rate", "offline_vs_server", "hydragen")


def find_issues(result: dict[str, Any]) -> list[str]:
    issues = []
    logprobs = (result.get("settings") or {}).get("logprobs", False)
    for section in ("rate", "hydragen"):
        sec = result.get(section) or {}
        for name, info in (sec.get("servers") or {}).items():
            if info.get("exit_code") not in (0, None):
                issues.append(f"{section}: server {name} exited {info.get('exit_code')} on SIGTERM")
            idle = (info.get("idle_metrics") or {}).get("kv_blocks_used")
            pinned = info.get("kv_blocks_used_idle") or 0
            if idle is not None and idle > pinned:
                issues.append(
                    f"{section}: server {name} held {idle:.0f} KV blocks when idle ({pinned:.0f} pinned)"
                )
            for line in info.get("log_problems") or []:
                issues.append(f"{section}: server {name} log: {line}")
    rate = result.get("rate") or {}
    for p in rate.get("points", []):
        where = f"rate {p['config']} {p['system_tokens']} tok {p['rate_req_s']:g} req/s"
        if p.get("errors"):
            issues.append(f"{where}: {p['errors']} failed requests ({p.get('error_sample')})")
        if p.get("server", {}).get("http_5xx"):
            issues.append(f"{where}: {p['server']['http_5xx']:.0f} answers 5xx")
        if p.get("client_lag_max_s", 0) > 0.25:
            issues.append(f"{where}: the load generator sent a request {p['client_lag_max_s']:.2f} s late")
        if p.get("ok") and p.get("streamed_token_fraction", 1) < 0.99 and logprobs:
            issues.append(
                f"{where}: streamed chunks carried {p['streamed_token_fraction']:.0%} of the tokens"
            )
    hyd = result.get("hydragen") or {}
    for mode, runs in (hyd.get("modes") or {}).items():
        for part in ("document", "samples"):
            s = runs.get(part) or {}
            if s.get("errors"):
                issues.append(
                    f"hydragen {mode} {part}: {s['errors']} failed requests ({s.get('error_sample')})"
                )
    return issues


# ---- report -------------------------------------------------------------------------------------
def idle_share(server: dict[str, Any]) -> str:
    """The GPU's idle share of the point's steps (waiting on the host), from the server's counters."""
    busy, idle = server.get("gpu_busy_s"), server.get("gpu_idle_s")
    if not busy and not idle:
        return "-"
    return f"{idle / (busy + idle):.0%}"


def fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{NAME}.md").write_text(markdown(result))
    plotted = plot(result, out / f"{NAME}.png")
    print(f"wrote {out / NAME}.json, .md{', .png' if plotted else ''}", flush=True)


def markdown(result: dict[str, Any]) -> str:
    r, s = result["run"], result["settings"]
    lines = [
        "# Serving on the GPU: long system prompts (RelayAttention) and shared context (Hydragen)",
        "",
        f"{r['device']}; torch {r['torch']}; Python {r['python']}; commit {r['commit']}; {r['date']}; "
        f"model `{s['model']}` ({result.get('model_name', '')}); openai client {r.get('openai', '?')}. "
        "Written by `benchmarks/serving.py --device cuda`.",
        "",
        "The server is `python -m prefixserve serve` in its own process, started per configuration with "
        f"`--max-num-batched-tokens {s['max_num_batched_tokens']} --num-kv-blocks {s['num_kv_blocks']}` "
        "(blocks of 16 tokens); the load comes over loopback HTTP from "
        f"{s['clients']} processes running the official `openai` client (`AsyncOpenAI`, no retries), each "
        "point's arrival times dealt between them. On a GPU `serve` runs the engine in a child process "
        "of its own (`--engine-process auto`) since commit 2cc0217; sections measured at earlier commits "
        "ran it on a thread of the server's process.",
        "",
    ]
    if result.get("merged_from"):
        lines += [
            "Sections merged from earlier runs: "
            + ", ".join(f"{k} ({v})" for k, v in result["merged_from"].items())
            + ".",
            "",
        ]
    rate = result.get("rate")
    if rate:
        lines += rate_markdown(rate, s)
    cmp_ = result.get("offline_vs_server")
    if cmp_:
        lines += comparison_markdown(cmp_, s)
    hyd = result.get("hydragen")
    if hyd:
        lines += hydragen_markdown(hyd, s)
    issues = result.get("issues") or []
    lines += ["## What the load exposed", ""]
    lines += (
        [f"- {i}" for i in issues]
        if issues
        else [
            "- Nothing: no 5xx, no failed or late request, no KV "
            "block held after the load, every server exited 0."
        ]
    )
    lines += ["", f"Whole run: {result.get('wall_s', 0):.0f} s. Reproduce: `{s.get('command', '')}`."]
    return "\n".join(lines) + "\n"


def rate_markdown(rate: dict[str, Any], s: dict[str, Any]) -> list[str]:
    sizes = rate["system_prompt_tokens"]
    lines = [
        "## Long system prompt, Poisson arrivals (RelayAttention §4.3)",
        "",
        f"System prompts of {', '.join(str(v) for v in sizes.values())} tokens (as the chat template renders "
        f"them); user turns of {s['user_tokens'][0]}-{s['user_tokens'][1]} tokens and outputs of "
        f"{s['output_tokens'][0]}-{s['output_tokens'][1]} tokens (uniform, `ignore_eos`, greedy); streamed "
        f"chat completions. Each rate runs about {s['window']:g} s of Poisson arrivals ({s['min_requests']}-"
        f"{s['max_requests']} requests), the same requests and arrival times for every configuration; rates "
        "climb (x1.5, x1.33) from half a warm-up burst's request rate until the server stops keeping up: "
        f"the mean normalised latency passes {s['slo']} s/token, or the queue grows (the last quarter's "
        f"mean TTFT exceeds the first quarter's by more than {s.get('backlog', float('inf')):g} s; a "
        "finite window hides an overload from the mean latency, not from this).",
        "",
        "Sharing on: `--attention auto`, prefix cache on, both system prompts pinned (`--system-prompt`). "
        "Sharing off: `--attention triton_paged` (the plain paged kernel), `--no-prefix-caching`: each "
        "request computes its system prompt and attends it alone."
        + (
            " Pinned: the plain kernel with the prompts pinned (stored once, read per sequence)."
            if "pinned" in s.get("configs", [])
            else ""
        ),
        "",
        "Normalised latency = end-to-end seconds / generated tokens, per request; TTFT = send to first "
        "token; ITL = gaps between streamed chunks, split over the tokens a chunk carries "
        + (
            "(counted from each chunk's logprobs, `top_logprobs=0`)"
            if s.get("logprobs")
            else "(one per chunk)"
        )
        + "; TPOT = (end-to-end - TTFT) / (tokens - 1).",
        "",
        "| system prompt | sharing | rate (req/s) | requests | served (req/s) | tok/s | norm. latency mean "
        "| p99 (s/tok) | TTFT mean | p99 (s) | queue growth (s) | ITL mean | p99 (ms) | TPOT mean (ms) "
        "| cached prompt | KV read saving | GPU idle | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(rate["points"], key=lambda p: (p["system_tokens"], p["config"], p["rate_req_s"])):
        if not p.get("ok"):
            lines.append(
                f"| {p['system_tokens']} | {p['config']} | {p['rate_req_s']:g} | {p['requests']} | "
                f"- | - | - | - | - | - | - | - | - | - | - | - | - | {p.get('errors')} |"
            )
            continue
        lines.append(
            f"| {p['system_tokens']} | {p['config']}{' (timed out)' if p.get('timed_out') else ''} "
            f"| {p['rate_req_s']:g} | {p['requests']} "
            f"| {p['throughput_req_s']:.2f} | {p['throughput_tok_s']:.0f} "
            f"| {fmt(p['norm_latency_mean'], '.4f')} "
            f"| {fmt(p['norm_latency_p99'], '.4f')} | {fmt(p['ttft_mean_s'])} | {fmt(p['ttft_p99_s'])} "
            f"| {fmt(p.get('backlog_growth_s'), '.2f')} "
            f"| {fmt(1e3 * p['itl_mean_s'], '.1f')} | {fmt(1e3 * p['itl_p99_s'], '.1f')} "
            f"| {fmt(1e3 * p['tpot_mean_s'], '.1f')} | {p['cached_prompt_fraction']:.0%} "
            f"| {p['server']['kv_read_saving_x']:.1f}x | {idle_share(p['server'])} | {p['errors']} |"
        )
    lines += [
        "",
        f"Highest request rate the server keeps up with (mean normalised latency <= {s['slo']} s/token and "
        "no queue growth; interpolated on the latency between the last rate kept up with and the first not "
        "when the latency crossed; 'measured' is the last rate kept up with):",
        "",
    ]
    configs = list(rate["sustainable"])
    head = "| system prompt | " + " | ".join(f"{c} (req/s)" for c in configs) + " | on / off |"
    lines += [head, "|---:|" + "---:|" * (len(configs) + 1)]
    for size in sizes.values():
        cells, val = [], {}
        for c in configs:
            sus = rate["sustainable"][c].get(str(size), {})
            v = sus.get("interpolated") or sus.get("measured")
            val[c] = (v, sus.get("interpolated") is not None)
            cells.append(
                f"{fmt(sus.get('interpolated'), '.2f')} (measured {fmt(sus.get('measured'), 'g')}; "
                f"{sus.get('bound', '-')})"
            )
        ratio = "-"
        if "on" in val and "off" in val and val["on"][0] and val["off"][0] and val["off"][1]:
            ratio = f"{val['on'][0] / val['off'][0]:.2f}x" + ("" if val["on"][1] else " (at least)")
        lines.append(f"| {size} | " + " | ".join(cells) + f" | {ratio} |")
    big = str(max(sizes.values()))
    on = rate["sustainable"].get("on", {}).get(big, {})
    off = rate["sustainable"].get("off", {}).get(big, {})
    v_on, v_off = on.get("interpolated") or on.get("measured"), off.get("interpolated")
    if v_on and v_off:
        x = v_on / v_off
        verdict = (
            "met" if x >= 2.2 else ("NOT met" if on.get("interpolated") else "not settled (on never crossed)")
        )
        at_least = "" if on.get("interpolated") else " at least"
        lines += [
            "",
            f"Target >= 2.2x the sharing-off rate at the {big}-token prompt:{at_least} **{x:.2f}x**, "
            f"{verdict}.",
        ]
    if rate.get("skipped"):
        lines += [
            "",
            "Skipped for lack of time: "
            + ", ".join(
                f"{k['config']} {k['system_tokens']} tok {k['rate_req_s']:g} req/s" for k in rate["skipped"]
            )
            + ".",
        ]
    lines += [
        "",
        "Warm-up bursts (all at once, untimed for the sweep; they set where each sweep starts):",
        "",
        "| system prompt | sharing | requests | req/s | tok/s | TTFT mean (s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for w in rate.get("warm", []):
        lines.append(
            f"| {w['system_tokens']} | {w['config']} | {w['requests']} "
            f"| {fmt(w.get('throughput_req_s'), '.2f')} | {fmt(w.get('throughput_tok_s'), '.0f')} "
            f"| {fmt(w.get('ttft_mean_s'))} |"
        )
    lines += [
        "",
        "Servers: "
        + "; ".join(
            f"{k}: up in {fmt(v.get('start_s'), '.1f')} s, {v.get('kv_blocks_total')} KV blocks, "
            f"exit {v.get('exit_code')}"
            for k, v in rate["servers"].items()
        )
        + ".",
        "",
    ]
    return lines


def comparison_markdown(c: dict[str, Any], s: dict[str, Any]) -> list[str]:
    st = c["settings"]
    lines = [
        "## Offline API vs server, same bursts and engine settings",
        "",
        "Generated tokens/s of the same requests through `LLM.chat` / `LLM.generate` in one process and "
        f"through the `on` server (`--attention auto`, prefix cache, `--max-num-seqs "
        f"{s['hydragen_max_num_seqs']}`): `chat` = {st['burst_requests']} chats after a "
        f"{st['system_tokens']}-token system prompt sent at once (streamed), `document` = the document's "
        f"{st['questions']} questions sent at once; each after one untimed burst of the same shape, "
        f"{st['repeats']} timed repeats with other tokens.",
        "",
    ]
    if "offline" not in c or "server" not in c:
        return [*lines, "(not measured)", ""]
    lines += [
        "| burst | offline (tok/s) | server (tok/s) | server / offline (best) | (means) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ratio in c.get("ratios", {}).items():
        off = ", ".join(f"{x:.0f}" for x in c["offline"]["runs"][name])
        srv = ", ".join(f"{x:.0f}" for x in c["server"][name])
        lines.append(f"| {name} | {off} | {srv} | **{ratio['best']:.1%}** | {ratio['mean']:.1%} |")
    worst = min((v["best"] for v in c.get("ratios", {}).values()), default=float("nan"))
    lines += [
        "",
        f"Target: the server within 10% of the offline API: {'met' if worst >= 0.9 else 'NOT met'} "
        f"(worst burst {worst:.1%}).",
        "",
    ]
    return lines


def hydragen_markdown(h: dict[str, Any], s: dict[str, Any]) -> list[str]:
    st = h["settings"]
    lines = [
        "## Shared document and many samples (Hydragen)",
        "",
        f"`document`: one {st['doc_tokens']}-token document and {st['questions']} questions about it "
        f"(completions, one request each, all sent at once). `samples`: {st['problems']} problems after one "
        f"{st['fewshot_tokens']}-token few-shot prefix, `n={st['samples']}` samples each (temperature 1). "
        f"{st['gen']} tokens per answer (`ignore_eos`), answers not streamed. One server per mode, "
        f"`--max-num-seqs {s['hydragen_max_num_seqs']}`, prefix cache on in every mode (the document's KV is "
        "stored once): on = `--attention auto`, off = `--attention triton_paged` (each sequence reads the "
        "document itself, as vLLM with prefix caching does), ceiling = `--attention none` (attention "
        "skipped: the dense path alone). Each timed run follows an untimed run of the same shape with other "
        "tokens. "
        "Sharing off without the prefix cache is not run: 256 copies of the document's KV would need "
        f"{st['questions'] * st['doc_tokens'] * 128 / 1e6:.0f} GB for an 8B model.",
        "",
        "| workload | mode | time to all answers (s) | generated tok/s | vs off | of ceiling | prompt tokens "
        "computed | KV read saving | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    modes = h.get("modes", {})
    for part in ("document", "samples"):
        off = (modes.get("off") or {}).get(part, {}).get("tok_s")
        ceil = (modes.get("ceiling") or {}).get(part, {}).get("tok_s")
        for mode in ("on", "off", "ceiling"):
            x = (modes.get(mode) or {}).get(part)
            if not x or not x.get("ok"):
                continue
            saving = "-" if mode == "ceiling" else f"{x['server']['kv_read_saving_x']:.1f}x"
            lines.append(
                f"| {part} | {mode} | {x['time_to_all_s']:.2f} | {x['tok_s']:.0f} "
                f"| {fmt(x['tok_s'] / off if off else None, '.2f')}x "
                f"| {fmt(x['tok_s'] / ceil if ceil else None, '.0%')} "
                f"| {x['server']['prompt_tokens_computed']:.0f} | {saving} | {x['errors']} |"
            )
    lines += [
        "",
        "Servers: "
        + "; ".join(
            f"{k}: up in {fmt(v.get('start_s'), '.1f')} s, exit {v.get('exit_code')}"
            for k, v in h.get("servers", {}).items()
        )
        + ".",
        "",
    ]
    return lines


def plot(result: dict[str, Any], path: Path) -> bool:
    rate = result.get("rate")
    if not rate or not rate.get("points"):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({p["system_tokens"] for p in rate["points"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4.2), squeeze=False)
    styles = {
        "on": ("o-", "C0", "sharing on"),
        "off": ("s--", "C3", "sharing off"),
        "pinned": ("^-.", "C2", "pinned, plain kernel"),
    }
    slo = result["settings"]["slo"]
    for ax, size in zip(axes[0], sizes, strict=True):
        for config, (style, color, label) in styles.items():
            pts = sorted(
                (
                    p
                    for p in rate["points"]
                    if p["system_tokens"] == size and p["config"] == config and p.get("ok")
                ),
                key=lambda p: p["rate_req_s"],
            )
            if not pts:
                continue
            xs = [p["rate_req_s"] for p in pts]
            ax.plot(xs, [p["norm_latency_mean"] for p in pts], style, color=color, label=f"{label} (mean)")
            ax.plot(
                xs,
                [p["norm_latency_p99"] for p in pts],
                style[0] + ":",
                color=color,
                alpha=0.45,
                label=f"{label} (p99)",
            )
        ax.axhline(slo, color="grey", lw=0.8, ls=":")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="request rate (req/s)",
            ylabel="normalised latency (s/token)",
            title=f"{size}-token system prompt",
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"prefixserve server, {result['settings']['model']} on {result['run']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
