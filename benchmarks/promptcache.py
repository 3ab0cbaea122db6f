"""Prompt Cache: time to first token with reused modules, decode with shared modules, and the accuracy cost.

Three questions, one run:

* **TTFT vs prompt length.** A schema of ``--module-tokens``-token modules; each request imports a
  random subset worth L tokens plus a 32-token question. Modes, one engine: ``full`` (the same
  text as a plain prompt, a fresh cache salt each time: full prefill), ``prefix`` (the plain prompt
  with its modules in shuffled order, after other requests filled the prefix cache: it misses past
  the first module that differs), ``module_gpu`` (the PML prompt, modules in the GPU tier),
  ``module_host`` (every module moved to host memory first: the request copies them back) and
  ``module_disk`` (moved off the host too: read from the module store, checksum checked). TTFT =
  wall time of a one-token ``generate``, median of ``--trials`` requests with fresh subsets. Each row
  also gives each tier's rate: host GB/s = the modules' KV bytes / (host TTFT - GPU TTFT), disk read
  GB/s = the disk tier's own read rate (read, checked and handed to the device copy) during the disk
  TTFT; and, once per run, what the machine gives (``benchmarks/io_rates.py``): one large pinned
  host-to-device copy, the host tier's copy path over the same entries, a plain sequential O_DIRECT
  read of the store's files and ``fio`` of them where installed; the report shows the fractions.
* **Decode with 64 concurrent requests** importing modules in different subsets and orders, at each
  ``--decode-points`` IMPORTED/MODULES (3K, 5K and 7K module tokens a request by default):
  ``module`` (PML prompts: each module's blocks read once per step for all its holders; also with
  each ``--decode-recovery`` setting, link:64 being the engine's default) against ``plain`` (the same
  tokens as plain prompts, prefix caching off: every request reads its own KV) and ``ceiling`` (the
  plain prompts with attention off: the dense part of the step, what no attention can beat).
  Decode tok/s = requests x (G - 1) / (last finish - the last request's first token): the decode
  phase alone (a difference of two whole runs let the plain prompts' prefill noise swamp it), the
  median of ``--decode-trials`` runs after an untimed one.
* **Accuracy** (``--quality``; real weights only): top-1 agreement and mean KL(full || cached) of the
  next-token distribution, and greedy exact match of ``--quality-tokens`` tokens, between
  module-cached and full prefill, over schemas of facts where a prompt imports 2-4 modules.

    python -m benchmarks.promptcache run --device cpu --model default --quality     # this CPU
    python -m benchmarks.promptcache run                                           # H200, dummy 8B
    python -m benchmarks.promptcache run --device cuda --lengths 5120 --decode-points \
        --spill-docs 24 --spill-doc-tokens 2048 --merge           # the tiers and the spill on a GPU
    python -m benchmarks.promptcache report --json docs/benchmarks/promptcache.json

``--recovery`` runs only the accuracy-recovery sections (``benchmarks/recovery.py``: quality vs TTFT
on the default model's real weights, TTFT at ~5K module tokens on any model) and keeps the other
sections of the existing JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, gpu_idle_frac, pyplot, run_info, run_or_report, write_text
from benchmarks.io_rates import machine_rates
from benchmarks.promptcache_spill import run_spill, spill_lines
from benchmarks.promptcache_tiers import host_copy_gbs, kv_bytes_per_token
from benchmarks.promptcache_workload import bench_schema, prompts_for, ttft
from benchmarks.recovery import (
    add_recovery_args,
    last_logits,
    plot_recovery,
    recovery_lines,
    run_recovery_quality,
    run_recovery_ttft,
)
from prefixserve import LLM, SamplingParams


def run_ttft(llm: LLM, args: argparse.Namespace, question: str) -> list[dict[str, Any]]:
    tok = llm.get_tokenizer()
    per_token = kv_bytes_per_token(llm)
    most = max(args.lengths) // args.module_tokens
    schema, texts = bench_schema(tok, 2 * most, args.module_tokens, args.seed)
    llm.register_schema(schema)
    rng = random.Random(args.seed + 1)
    rows = []
    for length in args.lengths:
        count = length // args.module_tokens
        times: dict[str, list[float]] = {
            m: [] for m in ("full", "prefix", "module_gpu", "module_host", "module_disk")
        }
        disk_rates: list[float] = []
        host_copies: list[int] = []  # host-to-device copies a host-tier request issued
        host_rate = None
        for trial in range(args.trials + 1):  # the first round warms every path up, untimed
            pml, plain, shuffled = prompts_for(rng, texts, count, question)
            llm.generate(prompts_for(rng, texts, count, question)[2], SamplingParams(max_tokens=1))
            # make this subset's modules resident, with another question (no own-block cache hit)
            llm.generate(pml.replace(question, " Warm" + question), SamplingParams(max_tokens=1))
            got = {
                "full": ttft(llm, {"prompt": plain, "cache_salt": f"fresh-{length}-{trial}"}),
                "prefix": ttft(llm, shuffled),
                "module_gpu": ttft(llm, pml),
            }
            llm.engine.modules.move_out()
            if trial == args.trials:
                host_rate = host_copy_gbs(llm)
            copies = llm.engine.modules.kv.landing.copies
            got["module_host"] = ttft(llm, pml.replace(question, " Host" + question))
            host_copies.append(llm.engine.modules.kv.landing.copies - copies)
            disk = llm.engine.modules.disk
            if disk is not None:
                llm.engine.modules.move_out(drop_host=True)
                before = (disk.read_bytes, disk.read_seconds)
                got["module_disk"] = ttft(llm, pml.replace(question, " Disk" + question))
                read_bytes, read_s = disk.read_bytes - before[0], disk.read_seconds - before[1]
                if trial and read_bytes:
                    disk_rates.append(read_bytes / read_s / 1e9)
            if trial:
                for mode, t in got.items():
                    times[mode].append(t)
        row: dict[str, Any] = {"module_tokens": count * args.module_tokens}
        row["prompt_tokens"] = len(tok.encode(plain, add_special_tokens=False))
        for mode, ts in times.items():
            if ts:
                row[f"{mode}_s"] = statistics.median(ts)
        row["module_bytes"] = row["module_tokens"] * per_token
        if "module_host_s" in row:  # the time the host tier adds over the GPU tier, as a rate
            row["host_gbs"] = (
                row["module_bytes"] / max(1e-6, row["module_host_s"] - row["module_gpu_s"]) / 1e9
            )
        if host_rate is not None:
            row["host_copy_gbs"] = host_rate
        if host_copies:  # layers x K and V x runs of modules adjacent in host memory and in the pool
            row["host_copies"] = max(host_copies)
            row["layers"] = llm.engine.modules.kv.landing.layers
        if disk_rates:
            row["disk_read_gbs"] = statistics.median(disk_rates)
        rows.append(row)
        print(json.dumps(row))
    llm.unregister_schema("bench")
    return rows


def decode_modes(recoveries: list[str]) -> dict[str, tuple[bool, bool, str, str]]:
    """mode: (PML prompts, prefix caching, attention backend, module recovery). ``module`` is the paper's
    Prompt Cache (no recovery); ``module_<spec>`` the same prompts with that recovery (link:64 is the
    engine's default: each module's first 64 rows recomputed per request, private blocks)."""
    recoveries = ["none", *(r for r in recoveries if r != "none")]
    modes = {("module" if r == "none" else f"module_{r}"): (True, True, "auto", r) for r in recoveries}
    return modes | {"plain": (False, False, "auto", "none"), "ceiling": (False, False, "none", "none")}


def run_decode(args: argparse.Namespace, question: str) -> list[dict[str, Any]]:
    """Decode tok/s with ``--decode-requests`` concurrent requests sharing modules, at each
    ``--decode-points`` (imported/schema modules): module-shared vs plain vs the no-attention ceiling."""
    points = []
    for point in args.decode_points:
        imported, modules = (int(x) for x in point.split("/"))
        out: dict[str, Any] = {
            "requests": args.decode_requests,
            "gen": args.decode_gen,
            "imported": imported,
            "modules": modules,
        }
        for mode, (pml, caching, attention, recovery) in decode_modes(args.decode_recovery).items():
            kw = {"enable_prefix_caching": caching, "attention": attention, "module_recompute": recovery}
            llm = make_llm(args, **kw)
            tok = llm.get_tokenizer()
            schema, texts = bench_schema(tok, modules, args.module_tokens, args.seed + 7)
            llm.register_schema(schema)
            rng = random.Random(args.seed + 2)
            batch = [prompts_for(rng, texts, imported, question) for _ in range(args.decode_requests)]
            prompts = [b[0] for b in batch] if pml else [b[2] for b in batch]
            out["prompt_tokens"] = len(tok.encode(batch[0][2], add_special_tokens=False))
            # the first run, untimed, is the timed one's twin: every graph the decode needs (a new key
            # each time an own part grows a block) is captured and every kernel compiled there, as in
            # throughput.py; the decode phase of the second is timed from the last request's first token
            # to the last finish, so the prefill (seconds for plain prompts) is not in it at all
            params = SamplingParams(max_tokens=args.decode_gen, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, params)
            before = llm.metrics()
            rates = []  # a decode phase is under half a second: the median of a few runs
            for _ in range(args.decode_trials):
                outs = llm.generate(prompts, params)  # decode tokens / (first token to finish)
                start = max(o.metrics["first_token_time"] for o in outs)
                end = max(o.metrics["finish_time"] for o in outs)
                rates.append(args.decode_requests * (args.decode_gen - 1) / max(1e-9, end - start))
            out[f"{mode}_decode_tok_s"] = statistics.median(rates)
            out[f"{mode}_decode_tok_s_trials"] = rates
            after = llm.metrics()
            segments = after["shared_segments_total"] - before["shared_segments_total"]
            out[f"{mode}_segments_per_step"] = segments / max(1, after["steps_total"] - before["steps_total"])
            out[f"{mode}_preemptions"] = after["preemptions_total"] - before["preemptions_total"]
            if "decode_gpu_idle_seconds_total" in after:  # the GPU's idle share between decode steps
                out[f"{mode}_host_overhead"] = gpu_idle_frac(before, after)
            print(mode, json.dumps(out))
            del llm
            gc.collect()  # the engine's cycles hold the KV cache until collected
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        out["module_over_plain"] = out["module_decode_tok_s"] / out["plain_decode_tok_s"]
        out["ceiling_over_plain"] = out["ceiling_decode_tok_s"] / out["plain_decode_tok_s"]
        points.append(out)
    return points


FACTS = [
    (
        "The {a} house on {b} Street belongs to {c}, who works as a {d}.",
        {
            "a": ["red", "blue", "green", "white"],
            "b": ["Oak", "Pine", "Elm", "Maple"],
            "c": ["Anna", "Boris", "Clara", "David"],
            "d": ["baker", "pilot", "doctor", "teacher"],
        },
    ),
]
QUALITY_SCHEMAS = 3
QUALITY_MODULES = 5


def quality_data(seed: int) -> list[tuple[str, list[str], list[str]]]:
    """Schemas of short factual modules: (schema PML, module texts, questions)."""
    rng = random.Random(seed)
    out = []
    template, slots = FACTS[0]
    for s in range(QUALITY_SCHEMAS):
        texts, questions = [], []
        for _ in range(QUALITY_MODULES):
            pick = {k: rng.choice(v) for k, v in slots.items()}
            texts.append(" " + template.format(**pick))
            questions.append(f" Question: who lives in the {pick['a']} house on {pick['b']} Street? Answer:")
        body = "".join(f'<module name="f{i}">{t}</module>' for i, t in enumerate(texts))
        out.append((f'<schema name="facts{s}">Notes about a town.{body}</schema>', texts, questions))
    return out


def run_quality(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    """Next-token agreement and KL between module-cached and full prefill, and greedy exact match."""
    rng = random.Random(args.seed + 3)
    agree, kls, exact, n = 0, [], 0, 0
    greedy = SamplingParams(max_tokens=args.quality_tokens, temperature=0.0)
    with last_logits(llm) as captured:
        for schema, texts, questions in quality_data(args.seed):
            name = llm.register_schema(schema)
            for _ in range(args.quality_prompts):
                picked = sorted(rng.sample(range(len(texts)), rng.randint(2, 4)))
                q = questions[rng.choice(picked)]
                pml = f'<prompt schema="{name}">' + "".join(f"<f{i}/>" for i in picked) + q + "</prompt>"
                full = "Notes about a town." + "".join(texts[i] for i in picked) + q
                captured.clear()
                cached_out = llm.generate(pml, greedy)[0].outputs[0].token_ids
                cached = torch.log_softmax(captured[0], -1)
                captured.clear()
                full_req = {"prompt": full, "cache_salt": f"q{n}"}  # a fresh salt: full prefill
                full_out = llm.generate(full_req, greedy)[0].outputs[0].token_ids
                ref = torch.log_softmax(captured[0], -1)
                agree += int(cached.argmax() == ref.argmax())
                kls.append(float((ref.exp() * (ref - cached)).sum()))
                exact += int(cached_out == full_out)
                n += 1
            llm.unregister_schema(name)
    return {
        "prompts": n,
        "top1_agreement": agree / n,
        "mean_kl": sum(kls) / n,
        "greedy_exact_match": exact / n,
        "greedy_tokens": args.quality_tokens,
    }


def make_llm(args: argparse.Namespace, **kw: Any) -> LLM:
    # Prompt Cache as the paper has it unless a section asks otherwise (recovery sets it per request)
    extra: dict[str, Any] = {"max_num_batched_tokens": args.max_num_batched_tokens}
    extra["module_recompute"] = "none"
    if args.num_kv_blocks:
        extra["num_kv_blocks"] = args.num_kv_blocks
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.device == "cuda":
        extra["kv_memory_fraction"] = 0.6
    extra.update(kw)
    model = None if args.model == "default" else args.model
    return LLM(model, device=args.device, progress=False, **extra)


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kv_cache_dtype != "auto" and args.name in ("promptcache", "promptcache_cpu"):
        args.name += f"_{args.kv_cache_dtype}"  # beside the model-dtype cache's results, not over them
    question = " " + " ".join(["Which", "word", "came", "first", "in", "the", "notes", "above?"] * 4)
    result: dict[str, Any] = {"run": run_info(), "settings": vars(args) | {"out": None}}
    if args.recovery:  # the recovery sections alone; the others come from the existing JSON
        args.merge = True
        result["ttft"] = []
        llm = make_llm(args)
        q_ids = llm.get_tokenizer().encode(question, add_special_tokens=False)
        result["settings"]["question_tokens"] = len(q_ids)
        auto = args.recovery_quality == "auto" and args.model == "default"
        quality = args.recovery_quality == "yes" or auto
        if quality:
            result["recovery_quality"] = run_recovery_quality(llm, args.seed)
        if args.chat_quality is not None:
            modes = tuple(args.chat_quality) or ("none", "link:16", "link:64", "blend:0.3")
            shapes = {
                shape: run_recovery_quality(llm, args.seed, chat=shape == "chat", modes=modes)
                for shape in ("bare", "chat")
            }
            result["chat_quality"] = {**shapes, "commit": result["run"]["commit"]}
        if args.recovery_lengths:
            result["recovery_ttft"] = run_recovery_ttft(llm, args, question)
        del llm
    else:
        with tempfile.TemporaryDirectory(dir=args.store_dir) as store:
            llm = make_llm(args, module_store=store)
            q_ids = llm.get_tokenizer().encode(question, add_special_tokens=False)
            result["settings"]["question_tokens"] = len(q_ids)
            result["ttft"] = run_ttft(llm, args, question) if args.lengths else []
            if result["ttft"]:  # the machine's own rates, on the store's very files
                result["machine"] = machine_rates(sorted(Path(store).glob("*.kv")))
                print(json.dumps(result["machine"]))
            if args.quality:
                result["quality"] = run_quality(llm, args)
            del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.decode_requests and not args.recovery:
        result["decode"] = run_decode(args, question)
    if args.spill_docs and not args.recovery:
        result["spill"] = run_spill(args, make_llm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = out / f"{args.name}.json"
    if args.merge and old.exists():  # keep the earlier run's sections this run did not measure
        earlier = json.loads(old.read_text())
        sections = (
            "ttft",
            "machine",
            "quality",
            "decode",
            "spill",
            "recovery_quality",
            "chat_quality",
            "recovery_ttft",
        )
        for section in sections:
            if not result.get(section) and earlier.get(section):
                result[section] = earlier[section]
                measured = earlier.get("merged_from", {}).get(section, earlier["run"]["commit"])
                result.setdefault("merged_from", {})[section] = measured
                if section == "decode" and isinstance(result[section], dict):  # the older one-point form
                    es = earlier["settings"]
                    point = {"imported": es.get("decode_import"), "modules": es.get("decode_modules")}
                    result[section] = [result[section] | point]
                if section == "ttft":  # the settings the TTFT rows were measured with
                    for key in ("trials", "module_tokens", "lengths", "question_tokens"):
                        result["settings"][key] = earlier["settings"][key]
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    report(result, out, args.name)


def report(result: dict[str, Any], out: Path, name: str | None = None) -> None:
    name = name or result["settings"].get("name", "promptcache")
    r, s = result["run"], result["settings"]
    lines = [
        "# Prompt Cache: reused modules against full prefill and prefix caching",
        "",
        f"{r['device']}; torch {r['torch']}; commit {r['commit']}; {r['date']}; model {s['model']}; "
        f"KV cache {s.get('kv_cache_dtype', 'auto')}; modules of {s['module_tokens']} tokens, a "
        f"{s['question_tokens']}-token question; median of "
        f"{s['trials']} requests after one untimed round. Written by `benchmarks/promptcache.py`.",
        "",
    ]
    if result["ttft"]:
        lines += [
            "| module tokens | full prefill s | prefix caching s | modules on GPU s | on host s | on disk s "
            "| full / GPU | full / host | full / disk | prefix / GPU | host GB/s | disk read GB/s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    for row in result["ttft"]:
        full, gpu = row["full_s"], row["module_gpu_s"]
        host, disk = row.get("module_host_s"), row.get("module_disk_s")

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.4f}"

        def ratio(a: float, b: float | None) -> str:
            return "-" if b is None else f"{a / b:.1f}x"

        def rate(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        lines.append(
            f"| {row['module_tokens']} | {f(full)} | {f(row['prefix_s'])} | {f(gpu)} | {f(host)} "
            f"| {f(disk)} | {ratio(full, gpu)} | {ratio(full, host)} | {ratio(full, disk)} "
            f"| {ratio(row['prefix_s'], gpu)} | {rate(row.get('host_gbs'))} "
            f"| {rate(row.get('disk_read_gbs'))} |"
        )
    if result["ttft"]:
        lines += ["", *machine_lines(result), *fp8_target_lines(result)]
    if result.get("decode"):
        lines += decode_lines(result)
    if "quality" in result:
        qd = result["quality"]
        lines += [
            "",
            f"Accuracy of independent module encoding (the approximation), {qd['prompts']} prompts importing "
            "2-4 fact modules, against full prefill of the same text:",
            "",
            "| top-1 next-token agreement | mean KL(full, cached) nats | greedy exact match |",
            "| ---: | ---: | ---: |",
            f"| {qd['top1_agreement']:.1%} | {qd['mean_kl']:.4f} | {qd['greedy_exact_match']:.1%} "
            f"({qd['greedy_tokens']} tokens) |",
        ]
    if "spill" in result:
        lines += spill_lines(result["spill"])
    lines += recovery_lines(result)
    for section, commit in result.get("merged_from", {}).items():
        lines += ["", f"(The {section} section is from an earlier run, commit {commit}.)"]
    write_text(out, f"{name}.md", lines)
    plt = pyplot()
    plot_recovery(result, out, name, plt)
    if plt is None or not result["ttft"]:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [row["module_tokens"] for row in result["ttft"]]
    for mode, label in (
        ("full", "full prefill"),
        ("prefix", "prefix caching (shuffled)"),
        ("module_gpu", "modules on GPU"),
        ("module_host", "modules on host"),
        ("module_disk", "modules on disk"),
    ):
        ys = [row.get(f"{mode}_s") for row in result["ttft"]]
        if all(y is not None for y in ys):
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("module tokens in the prompt")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title(f"Prompt Cache TTFT ({r['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)


# issue 103: over an FP8 KV cache (half the bytes to copy) the host tier's first token at about 5K
# module tokens is at least this many times faster than full prefill
FP8_HOST_TARGET, FP8_HOST_TOKENS = 14.0, 5120


def fp8_target_lines(result: dict[str, Any]) -> list[str]:
    """The FP8 host-tier target's verdict, over an FP8 cache only (the row nearest ~5K tokens)."""
    if result["settings"].get("kv_cache_dtype", "auto") == "auto":
        return []
    rows = [r for r in result["ttft"] if r.get("module_host_s")]
    if not rows:
        return []
    row = min(rows, key=lambda r: abs(r["module_tokens"] - FP8_HOST_TOKENS))
    speedup = row["full_s"] / row["module_host_s"]
    verdict = "met" if speedup >= FP8_HOST_TARGET else "not met"
    return [
        "",
        f"Target (issue 103): modules on host at {row['module_tokens']} tokens, first token >= "
        f"{FP8_HOST_TARGET:g}x full prefill: {verdict} ({speedup:.1f}x).",
    ]


def machine_lines(result: dict[str, Any]) -> list[str]:
    """The tiers' rates against what the machine gives, measured in the same run."""
    m, rows = result.get("machine") or {}, result["ttft"]
    if not m:
        return ["(No machine rates in this run: they came with issue 54.)"]
    last = rows[-1]

    def frac(x: float | None, of: float | None) -> str:
        return "-" if x is None or not of else f"{x:.1f} GB/s ({x / of:.0%} of it)"

    def gbs(x: float | None) -> str:
        return "not measured" if x is None else f"{x:.1f} GB/s"

    read = "O_DIRECT" if m.get("sequential_read_direct") else "buffered (O_DIRECT refused)"
    h2d, seq, fio = m.get("pinned_h2d_gbs"), m.get("sequential_read_gbs"), m.get("fio_read_gbs")
    disk, tokens = last.get("disk_read_gbs"), last["module_tokens"]
    lines = [
        "Host GB/s is the modules' KV bytes over the time the host tier adds to the GPU tier's TTFT"
        " (the copy lands layer by layer under the prefill, so it may pass the copy path's rate);"
        " disk read GB/s is the disk tier's own rate (read, checked, handed to the device copy).",
        "",
        f"- one pinned host-to-device copy of 1 GiB: {gbs(h2d)}; the host tier's copy path over its"
        f" entries: {frac(last.get('host_copy_gbs'), h2d)}",
        f"- a plain sequential read ({read}, 8 MiB reads, one thread) of the store's"
        f" {m['files_bytes'] / 1e9:.2f} GB of files: {gbs(seq)}; the disk tier at {tokens} module"
        f" tokens: {frac(disk, seq)}",
        f"- fio (libaio, O_DIRECT, depth 8, 8 MiB reads) of the same files: {gbs(fio)}",
    ]
    if fio:
        lines[-1] += f"; the disk tier: {frac(disk, fio)}"
    copies = []
    for row in rows:
        if row.get("layers"):
            runs = row["host_copies"] // (2 * row["layers"])
            copies.append(f"{row['host_copies']} at {row['module_tokens']} ({runs} per layer, K or V)")
    if copies:
        lines.append(
            f"- host-to-device copies of a host-tier request (most over its trials): {', '.join(copies)}"
        )
    return lines


def decode_lines(result: dict[str, Any]) -> list[str]:
    """The decode table: one row per point; an older JSON's single point (a dict) reads as one row."""
    s, points = result["settings"], result["decode"]
    if isinstance(points, dict):
        points = [points | {"imported": s.get("decode_import", "?"), "modules": s.get("decode_modules", "?")}]
    d = points[0]
    lines = [
        "",
        f"Decode, {d['requests']} concurrent requests, each importing a different subset of the schema's "
        f"modules in its own order, {d['gen']} tokens each. Ceiling: the plain prompts with attention "
        "switched off (the dense part of the step alone), the most any attention can give:",
        "",
        "| modules imported / in the schema | prompt tokens | modules shared (PML) tok/s "
        "| plain prompts, no sharing tok/s | ceiling tok/s | shared / plain | ceiling / plain "
        "| shared / ceiling | segments a step | host overhead (shared) "
        "| with link:64 recovery (the default) tok/s | its / plain |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in points:
        shared, plain = d["module_decode_tok_s"], d["plain_decode_tok_s"]
        ceiling = d.get("ceiling_decode_tok_s")
        vs_ceiling = (
            ("-", "-", "-")
            if ceiling is None
            else (f"{ceiling:.0f}", f"{ceiling / plain:.2f}x", f"{shared / ceiling:.0%}")
        )
        lines.append(
            f"| {d['imported']} / {d['modules']} | {d.get('prompt_tokens', '-')} "
            f"| {shared:.0f} | {plain:.0f} "
            f"| {vs_ceiling[0]} | {shared / plain:.2f}x | {vs_ceiling[1]} | {vs_ceiling[2]} "
            f"| {d['module_segments_per_step']:.1f} "
        )
        host = d.get("module_host_overhead")
        lines[-1] += "| - " if host is None else f"| {host:.0%} "
        link = d.get("module_link:64_decode_tok_s")
        lines[-1] += "| - | - |" if link is None else f"| {link:.0f} | {link / plain:.2f}x |"
    return lines


def add_run_args(ap: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    ap.add_argument("--model", default="dummy:llama-3.1-8b" if gpu else "default")
    ap.add_argument("--device", default="cuda" if gpu else "cpu")
    ap.add_argument("--name", default="promptcache" if gpu else "promptcache_cpu")
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=[1024, 2048, 4096, 5120, 8192],
        help="module tokens a prompt imports (none: no TTFT run)",
    )
    ap.add_argument("--module-tokens", type=int, default=512)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8"),
        help="fp8: every mode over an e4m3 KV cache (results named *_fp8)",
    )
    ap.add_argument("--decode-requests", type=int, default=64)
    ap.add_argument(
        "--decode-points",
        nargs="*",
        default=["6/8", "10/12", "14/16"],
        help="decode runs IMPORTED/MODULES: a request imports IMPORTED of the schema's MODULES",
    )
    ap.add_argument("--decode-gen", type=int, default=65)
    ap.add_argument("--decode-trials", type=int, default=3, help="timed decode runs a mode (median)")
    ap.add_argument(
        "--decode-recovery",
        nargs="*",
        default=["link:64"],
        help="recoveries the decode also runs PML prompts with, besides none (the paper's)",
    )
    ap.add_argument("--spill-docs", type=int, default=0, help="documents for the prefix spill run (0: none)")
    ap.add_argument("--spill-doc-tokens", type=int, default=512)
    ap.add_argument(
        "--store-dir",
        default=None,
        help="where the module store's temporary directory goes (the drive the disk tier reads)",
    )
    ap.add_argument("--merge", action="store_true", help="keep sections of the existing JSON not re-run")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--quality-prompts", type=int, default=10)
    ap.add_argument("--quality-tokens", type=int, default=8)
    add_recovery_args(ap)


if __name__ == "__main__":
    run_or_report(__doc__, "promptcache", RESULTS, add_run_args, run, report)
