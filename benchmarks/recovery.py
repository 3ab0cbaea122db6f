"""Prompt Cache accuracy recovery (``module_recompute``): quality against full prefill, and its TTFT.

Run through ``benchmarks/promptcache.py --recovery`` (its results land in promptcache*.json/.md):

* **Quality** (real weights): ``benchmarks/data/recovery_towns.json``: towns described in four
  documents; each question needs two of them (who lives in which house, and that house's street or
  animal). Each town is laid out by two schemas with the documents in different orders, and each
  prompt imports the two documents it needs plus a distractor. For every mode: exact-match accuracy
  of the greedy answer, and top-1 agreement and mean KL(full || mode) of the next-token distribution
  against **full prefill of the very same tokens at the same positions** (what recomputing every
  row gives exactly), and the mean TTFT.
* **TTFT at ~5K module tokens** (``--recovery-lengths``, any model): modules of random words, a
  fresh subset per trial; every mode on the same prompt, its modules resident.

Modes: ``full`` (full prefill), ``none`` (Prompt Cache alone), ``link:K``, ``blend:R``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.promptcache_workload import bench_schema, prompts_for, ttft
from prefixserve import LLM, SamplingParams

DATA = Path(__file__).resolve().parent / "data" / "recovery_towns.json"
CHAT_SYSTEM = "Answer the question from the notes about the town."
MODES = ("none", "link:1", "link:4", "link:16", "link:32", "link:64", "blend:0.15", "blend:0.3", "blend:0.5")


def town_prompts(seed: int, chat: bool = False) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(schema PML, ...) per schema, and for each prompt (schema name, PML prompt, gold answer).

    ``chat``: the same facts shaped for a chat model, as the paper's schemas are: a system turn, the
    documents in a user turn, the question as a user turn and the answer's first words as an
    unfinished assistant turn the model continues."""
    data = json.loads(DATA.read_text())
    rng = random.Random(seed)
    schemas, prompts = [], []
    for world in data["worlds"]:
        docs = list(world["modules"])
        orders = [docs[:]]
        while len(orders) < 2:  # a second order where the residents document moves
            order = docs[:]
            rng.shuffle(order)
            if order.index("residents") != orders[0].index("residents"):
                orders.append(order)
        for tag, order in zip("ab", orders, strict=True):
            name = f"{world['name']}{tag}"
            body = "".join(f'<module name="{m}">{world["modules"][m]}</module>' for m in order)
            if chat:
                body = f"<system>{CHAT_SYSTEM}</system><user>{world['intro']}{body}</user>"
            else:
                body = world["intro"] + body
            schemas.append(f'<schema name="{name}">{body}</schema>')
            for q in world["questions"]:
                others = [m for m in docs if m not in q["needs"]]
                imports = [*q["needs"], rng.choice(others)]
                rng.shuffle(imports)  # import order is free text order; positions come from the schema
                body = "".join(f"<{m}/>" for m in imports) + (_chat_ask(q["ask"]) if chat else q["ask"])
                pml = f'<prompt schema="{name}">{body}</prompt>'
                prompts.append((name, pml, q["answer"]))
    return schemas, prompts


def _chat_ask(ask: str) -> str:
    """' Question: Q? Answer: A' -> the question as a user turn, A as the assistant's unfinished turn."""
    question, _, answer = ask.partition("Answer:")
    return f"<user>{question.replace('Question:', '').strip()}</user><assistant>{answer.strip()}</assistant>"


def _answer_matches(text: str, gold: str) -> bool:
    words = text.strip().split()
    return bool(words) and words[0].strip(".,;:!?").lower() == gold.lower()


@contextlib.contextmanager
def last_logits(llm: LLM) -> Iterator[list[torch.Tensor]]:
    """While open, every logits computation appends its last row (fp32, CPU) to the yielded list."""
    captured: list[torch.Tensor] = []
    model = llm.engine.model
    original = model.compute_logits

    def capture(hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = original(hidden)  # fp32 always: the KL is taken over these, an argmax takes either
        captured.append(logits[-1].float().cpu())
        return logits

    model.compute_logits = capture
    try:
        yield captured
    finally:
        model.compute_logits = original


def run_recovery_quality(
    llm: LLM, seed: int, answer_tokens: int = 3, chat: bool = False, modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    """Accuracy, agreement and KL against full prefill, and TTFT, per mode (see the docstring)."""
    schemas, prompts = town_prompts(seed, chat)
    for schema in schemas:
        llm.register_schema(schema)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    answer = SamplingParams(max_tokens=answer_tokens, temperature=0.0)
    stats: dict[str, dict[str, Any]] = {
        m: {
            "kl": [],
            "agree": 0,
            "exact": 0,
            "same": 0,
            "ttft": [],
            "recomputed": [],
            "private": [],
            "module_rows": [],
        }
        for m in ("full", *modes)
    }
    try:
        with last_logits(llm) as captured:
            _score_prompts(llm, prompts, stats, captured, one, answer, modes)
    finally:
        for schema in schemas:
            llm.unregister_schema(schema.split('"')[1])
    return _summary(stats, len(prompts), answer_tokens, chat)


def _score_prompts(
    llm: LLM, prompts: list, stats: dict, captured: list, one: Any, answer: Any, modes: tuple[str, ...]
) -> None:
    """Every prompt in every mode: its answer, first-token time and next-token distribution."""
    for n, (_, pml, gold) in enumerate(prompts):
        ids, pos = llm.engine.modules.layout_of(pml)
        # the modules resident (and warm) before anything is timed; another question, so no mode
        # finds this prompt's own blocks in the prefix cache
        llm.generate(pml.replace("Question:", "Warm-up question:"), one)
        outs: dict[str, Any] = {}
        logps: dict[str, torch.Tensor] = {}
        for mode in ("full", *modes):
            req: dict[str, Any] = (  # full: a fresh salt, nothing reused; each mode's own blocks
                # are keyed by its setting, so no mode reuses another's
                {"prompt_token_ids": ids, "positions": pos, "cache_salt": f"full-{n}"}
                if mode == "full"
                else {"prompt": pml, "module_recompute": mode}
            )
            captured.clear()
            t0 = time.monotonic()
            first = outs[mode] = llm.generate(req, answer)[0]
            stats[mode]["ttft"].append(first.metrics["first_token_time"] - t0)  # admission included
            logps[mode] = torch.log_softmax(captured[0], -1)
            stats[mode]["recomputed"].append(first.num_recomputed_tokens)
            stats[mode]["private"].append(first.module_rows_private)
            stats[mode]["module_rows"].append(first.module_rows_private + first.module_rows_shared)
        ref = logps["full"]
        if n % 8 == 0:
            print(f"recovery quality: prompt {n + 1} of {len(prompts)}", flush=True)
        for mode in ("full", *modes):
            s = stats[mode]
            s["kl"].append(float((ref.exp() * (ref - logps[mode])).sum()))
            s["agree"] += int(logps[mode].argmax() == ref.argmax())
            s["exact"] += int(_answer_matches(outs[mode].outputs[0].text, gold))
            s["same"] += int(outs[mode].outputs[0].token_ids == outs["full"].outputs[0].token_ids)


def _summary(stats: dict[str, dict[str, Any]], count: int, answer_tokens: int, chat: bool) -> dict[str, Any]:
    rows = []
    for mode, s in stats.items():
        rows.append(
            {
                "mode": mode,
                "accuracy": s["exact"] / count,
                "top1_agreement": s["agree"] / count,
                "greedy_match": s["same"] / count,
                "mean_kl": sum(s["kl"]) / count,
                "ttft_s": statistics.mean(s["ttft"]),
                "recomputed_tokens": statistics.mean(s["recomputed"]),
                "private_fraction": sum(s["private"]) / max(1, sum(s["module_rows"])),
            }
        )
    gap = next(r["mean_kl"] for r in rows if r["mode"] == "none")
    for row in rows:
        row["kl_gap_closed"] = 1.0 - row["mean_kl"] / gap if gap > 0 else None
    return {"prompts": count, "answer_tokens": answer_tokens, "chat": chat, "rows": rows}


def run_recovery_ttft(llm: LLM, args: argparse.Namespace, question: str) -> list[dict[str, Any]]:
    """TTFT per mode at each of ``--recovery-lengths`` module tokens: median of ``--trials``."""
    tok = llm.get_tokenizer()
    most = max(args.recovery_lengths) // args.module_tokens
    schema, texts = bench_schema(tok, 2 * most, args.module_tokens, args.seed + 11)
    llm.register_schema(schema)
    rng = random.Random(args.seed + 12)
    rows = []
    for length in args.recovery_lengths:
        count = length // args.module_tokens
        times: dict[str, list[float]] = {m: [] for m in ("full", *MODES)}
        for trial in range(args.trials + 1):  # the first round warms every path up, untimed
            pml = prompts_for(rng, texts, count, question)[0]
            llm.generate(pml.replace(question, " Warm" + question), SamplingParams(max_tokens=1))
            ids, pos = llm.engine.modules.layout_of(pml)
            salt = f"{length}-{trial}"
            got = {"full": ttft(llm, {"prompt_token_ids": ids, "positions": pos, "cache_salt": salt})}
            for mode in MODES:
                req = {"prompt": pml, "module_recompute": mode}  # own blocks keyed by the setting
                got[mode] = ttft(llm, req)
            if trial:
                for mode, t in got.items():
                    times[mode].append(t)
        row: dict[str, Any] = {"module_tokens": count * args.module_tokens}
        for mode, ts in times.items():
            row[f"{mode}_s"] = statistics.median(ts)
        rows.append(row)
        print(json.dumps(row))
    llm.unregister_schema("bench")
    return rows


def add_recovery_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--recovery", action="store_true", help="accuracy recovery only: quality (real weights) and TTFT"
    )
    ap.add_argument(
        "--recovery-lengths",
        type=int,
        nargs="*",
        default=[5120],
        help="module tokens for the recovery TTFT rows (none: no TTFT rows)",
    )
    ap.add_argument(
        "--chat-quality",
        nargs="*",
        default=None,
        metavar="MODE",
        help="the quality section in chat shape beside bare text, in one run, for these modes "
        "(none given: none link:16 link:64 blend:0.3)",
    )
    ap.add_argument(
        "--recovery-quality",
        choices=("auto", "yes", "no"),
        default="auto",
        help="the quality section (auto: with the default model's real weights only)",
    )


def recovery_lines(result: dict[str, Any]) -> list[str]:
    """The report's recovery section: quality vs TTFT, and TTFT at ~5K module tokens."""
    lines: list[str] = []
    rq = result.get("recovery_quality")
    if rq:
        lines += [
            "",
            "## Accuracy recovery (`module_recompute`): quality against TTFT",
            "",
            f"{rq['prompts']} prompts from `benchmarks/data/recovery_towns.json` (each needs facts from two "
            "modules, whose order differs across schemas, plus a distractor module). KL and agreement are "
            "against full prefill of the very same tokens at the same positions; accuracy is the greedy "
            "answer's first word against the data's answer; TTFT is the mean wall time from the call to "
            "the first token, modules resident. `gap closed` = 1 - KL(mode) / KL(none).",
            "",
            "| mode | accuracy | top-1 agreement | mean KL nats | gap closed | TTFT s | rows recomputed "
            "| module rows private |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in rq["rows"]:
            closed = "-" if row["kl_gap_closed"] is None else f"{row['kl_gap_closed']:.1%}"
            lines.append(
                f"| {row['mode']} | {row['accuracy']:.1%} | {row['top1_agreement']:.1%} "
                f"| {row['mean_kl']:.4f} | {closed} | {row['ttft_s']:.4f} | {row['recomputed_tokens']:.1f} "
                f"| {row['private_fraction']:.1%} |"
            )
    cq = result.get("chat_quality")
    if cq:
        lines += _shape_lines(cq["bare"], cq["chat"], cq.get("commit", "?"))
    rt = result.get("recovery_ttft")
    if rt:
        lines += [
            "",
            "TTFT with recovery, modules resident on the device, median of the trials "
            "(full / mode in brackets):",
            "",
            "| module tokens | " + " | ".join(("full", *MODES)) + " |",
            "| ---: |" + " ---: |" * (len(MODES) + 1),
        ]
        for row in rt:
            full = row["full_s"]
            cells = [f"{full:.4f}"] + [f"{row[f'{m}_s']:.4f} ({full / row[f'{m}_s']:.1f}x)" for m in MODES]
            lines.append(f"| {row['module_tokens']} | " + " | ".join(cells) + " |")
    return lines


def _shape_lines(bare: dict[str, Any] | None, chat: dict[str, Any] | None, commit: str) -> list[str]:
    """Bare-text prompts beside chat-shaped ones (turns through the chat template), mode by mode."""
    if not bare or not chat:
        return []
    lines = [
        "",
        "### Chat-shaped prompts beside bare text",
        "",
        f"The same facts and questions, {chat['prompts']} prompts, both shapes measured in one run "
        f"(commit {commit}). Chat: a system "
        "turn, the documents in a user turn (the schema), the question as the prompt's user turn and the "
        "answer's first words as an unfinished assistant turn; bare: the text as above. Greedy match: "
        f"the {chat['answer_tokens']} greedy tokens equal full prefill's.",
        "",
        "| mode | bare accuracy | chat accuracy | bare top-1 | chat top-1 | bare KL | chat KL "
        "| bare greedy match | chat greedy match |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_mode = {row["mode"]: row for row in bare["rows"]}
    for c in chat["rows"]:
        b = by_mode.get(c["mode"])
        if b is None or "greedy_match" not in b:
            continue
        lines.append(
            f"| {c['mode']} | {b['accuracy']:.1%} | {c['accuracy']:.1%} | {b['top1_agreement']:.1%} "
            f"| {c['top1_agreement']:.1%} | {b['mean_kl']:.4f} | {c['mean_kl']:.4f} "
            f"| {b['greedy_match']:.1%} "
            f"| {c['greedy_match']:.1%} |"
        )
    return lines


def plot_recovery(result: dict[str, Any], out: Path, name: str, plt: Any) -> None:
    """Quality (KL to full prefill) against TTFT, one point per mode."""
    rq = result.get("recovery_quality")
    if not rq or plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rq["rows"]:
        ax.scatter(row["ttft_s"] * 1e3, row["mean_kl"] + 1e-6, label=row["mode"])
        ax.annotate(row["mode"], (row["ttft_s"] * 1e3, row["mean_kl"] + 1e-6), fontsize=8)
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_ylabel("mean KL(full || mode), nats")
    ax.set_yscale("log")
    ax.set_title(f"Accuracy recovery: quality vs TTFT ({result['run']['device']})")
    fig.tight_layout()
    fig.savefig(out / f"{name}_recovery.png", dpi=120)
