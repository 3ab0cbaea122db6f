"""Linear-attention hybrids on one GPU (issue 107): prefix caching that hits, and sharing, at a Qwen3.5
shape with dummy weights.

Parts (``--parts``), each on a fresh engine:
  chats    ``--chats`` conversations of ``--turns`` turns, each turn ``--user`` new tokens and a
           ``--reply``-token reply, the history growing: prefix-cache hit tokens of the hybrid against
           its full-attention twin (the same config, every layer full attention), on the same
           conversations (the replies are each model's own, of the same lengths)
  ttft     first token of a ``--prefix``-token prompt computed whole against the same prefix cached
           (its linear layers resumed from the snapshot at the prefix's end), ``--own`` tokens after it
  samples  ``--samples`` samples of one ``--prefix``-token prompt: decode tok/s with sharing on and off
           (``benchmarks.decode_run.measure``), beside the ratio the bytes allow: a step reads the
           weights, every sample's linear states (read and written) and the full layers' KV, which
           sharing reads once for the prefix instead of once per sample

    python -m benchmarks.hybrid run --model dummy:qwen3.5-27b --device cuda [--out docs/benchmarks]
    python -m benchmarks.hybrid run --smoke   # a tiny Qwen3.5 on the CPU, into /tmp/hybrid
    python -m benchmarks.hybrid report --json docs/benchmarks/hybrid.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, dummy_model, pyplot, run_info
from benchmarks.harness.models import model_config
from benchmarks.harness.output import run_or_report, write_results

NAME = "hybrid"

# a Qwen3.5 of four small layers (three linear, one full) for the CPU smoke run
TINY_QWEN3_5: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def full_twin(model: str, folder: Path) -> str:
    """The model's config with every layer full attention, as a dummy model name."""
    config = model_config(model)
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    return dummy_model(config, folder)


def _llm(args: argparse.Namespace, model: str, **engine: Any) -> Any:
    """A fresh engine, the memory of any engine before it given back first (callers drop theirs)."""
    from prefixserve import LLM

    gc.collect()
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    return LLM(
        model=model, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
        max_num_batched_tokens=args.max_batched_tokens, progress=False, **engine,
    )  # fmt: skip


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


def chats_part(args: argparse.Namespace) -> dict[str, Any]:
    from prefixserve import SamplingParams

    rng = random.Random(0)
    messages = [[_tokens(rng, args.user) for _ in range(args.turns)] for _ in range(args.chats)]
    params = SamplingParams(temperature=0.0, max_tokens=args.reply, min_tokens=args.reply, ignore_eos=True)
    twin = full_twin(args.model, Path(tempfile.mkdtemp(prefix="hybrid-twin-")))
    result: dict[str, Any] = {}
    for label, model in (("hybrid", args.model), ("full", twin)):
        llm = _llm(args, model, max_num_seqs=args.chats)
        histories: list[list[int]] = [[] for _ in range(args.chats)]
        hits, prompt_tokens, seconds = [], [], []
        for turn in range(args.turns):
            prompts = [h + m[turn] for h, m in zip(histories, messages, strict=True)]
            before = llm.metrics()["prefix_cache_hit_tokens_total"]
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            seconds.append(time.perf_counter() - t0)
            hits.append(int(llm.metrics()["prefix_cache_hit_tokens_total"] - before))
            prompt_tokens.append(sum(map(len, prompts)))
            histories = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
        result[label] = {
            "hit_tokens_per_turn": hits,
            "prompt_tokens_per_turn": prompt_tokens,
            "seconds_per_turn": seconds,
            "hit_tokens": sum(hits),
            "prompt_tokens": sum(prompt_tokens),
        }
        llm.shutdown()
        del llm, outs
        print(f"chats {label}: {sum(hits):,} of {sum(prompt_tokens):,} prompt tokens hit")
    result["hybrid_over_full"] = result["hybrid"]["hit_tokens"] / max(1, result["full"]["hit_tokens"])
    return result


def ttft_part(args: argparse.Namespace) -> dict[str, Any]:
    from prefixserve import SamplingParams

    rng = random.Random(1)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm = _llm(args, args.model, max_num_seqs=8)

    def first_token_s(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one)
        return time.perf_counter() - t0

    first_token_s(_tokens(rng, args.prefix + args.own))  # warm-up: kernels compiled, other tokens
    prefix = _tokens(rng, args.prefix)
    whole = first_token_s(prefix + _tokens(rng, args.own))
    before = llm.metrics()["prefix_cache_hit_tokens_total"]
    cached = [first_token_s(prefix + _tokens(rng, args.own)) for _ in range(args.repeats)]
    hits = (llm.metrics()["prefix_cache_hit_tokens_total"] - before) / args.repeats
    llm.shutdown()
    result = {
        "whole_s": whole,
        "cached_s": statistics.median(cached),
        "cached_runs_s": cached,
        "hit_tokens": hits,
    }
    result["speedup"] = whole / result["cached_s"]
    print(f"ttft: whole {whole:.3f} s, cached {result['cached_s']:.4f} s ({result['speedup']:.1f}x)")
    return result


def bytes_bound(args: argparse.Namespace) -> dict[str, float]:
    """The sharing on / off ratio the bytes allow at the samples part's shape: weights (less the
    embedding, of which a step reads B rows), each sample's linear states read and written, the full
    layers' KV of the prefix (once shared, per sample not) and of each sample's own tokens."""
    import torch

    from prefixserve.kv.state_slots import bytes_per_slot
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.llama import LlamaForCausalLM
    from prefixserve.model.loader import resolve_model

    config = ModelConfig.from_json(resolve_model(args.model).path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, None)
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * 2
    states = 2 * args.samples * bytes_per_slot(config, torch.bfloat16)
    full = config.num_hidden_layers - len(config.linear_layers)
    kv_token = 2 * config.num_key_value_heads * config.head_dim * 2 * full
    own = args.own + args.gen / 2  # the samples' own tokens, on average over the run
    off = args.samples * (args.prefix + own) * kv_token
    on = (args.prefix + args.samples * own) * kv_token
    return {
        "weights_gb": weights / 1e9,
        "states_gb": states / 1e9,
        "kv_off_gb": off / 1e9,
        "kv_on_gb": on / 1e9,
        "on_over_off": (weights + states + off) / (weights + states + on),
    }


def samples_part(args: argparse.Namespace) -> dict[str, Any]:
    from array import array

    from benchmarks.decode_run import MODES, measure

    gc.collect()  # the parts before: their engines' memory given back
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    rng = random.Random(2)
    prompts = tuple(
        [{"prompt_token_ids": array("q", _tokens(rng, args.prefix + args.own))}] for _ in range(2)
    )
    result: dict[str, Any] = {}
    for mode in ("auto", "sharing_off"):
        attention = (
            MODES[mode] if args.device == "cuda" else {"auto": "auto", "sharing_off": "reference"}[mode]
        )
        got = measure(
            args.model, args.device, attention, prompts, args.gen, n=args.samples,
            max_batched=args.max_batched_tokens,
        )  # fmt: skip
        result[mode] = {k: v for k, v in got.items() if k != "decode_window"}
        print(f"samples {mode}: {got['tok_s']:,.0f} tok/s")
    result["on_over_off"] = result["auto"]["tok_s"] / result["sharing_off"]["tok_s"]
    result["bound"] = bytes_bound(args)
    return result


PARTS = {"chats": chats_part, "ttft": ttft_part, "samples": samples_part}
SMOKE = dict(chats=3, turns=3, user=24, reply=70, prefix=256, own=8, samples=4, gen=8, repeats=2)
SMOKE |= dict(max_batched_tokens=128)


def run(args: argparse.Namespace) -> None:
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.device, args.out = "cpu", str(Path(tempfile.gettempdir()) / NAME)
        args.model = dummy_model(TINY_QWEN3_5, Path(tempfile.mkdtemp(prefix="hybrid-")))
    settings = {k: v for k, v in vars(args).items() if k not in ("mode", "add_to")}
    result: dict[str, Any] = {**run_info(("fla-core",)), "settings": settings}
    if args.add_to:  # an earlier run's parts kept, each with the run it came from
        result = json.loads(Path(args.add_to).read_text())
        for part in PARTS:  # parts of a run from before parts named their run
            if part in result and "run" not in result[part]:
                result[part]["run"] = {"commit": result["commit"], "date": result["date"]}
                result[part]["settings"] = result["settings"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        result[part] = {**PARTS[part](args), "run": run_info(("fla-core",)), "settings": settings}
        report(result, out)  # each part's results written as it ends


def report(result: dict[str, Any], out: Path) -> None:
    s = result["settings"]
    lines = [
        "# Linear-attention hybrids: prefix caching and sharing",
        "",
        f"{result['device']}; torch {result['torch']}; commit {result['commit']}; {result['date']}; model "
        f"{s['model']} (dummy weights, bf16 on a GPU). Written by `benchmarks/hybrid.py` "
        f"(`{'run --smoke' if s.get('smoke') else 'run'}`).",
    ]
    if result.get("chats"):
        r = result["chats"]
        s = {**result["settings"], **r.get("settings", {})}
        lines += [
            "",
            f"## Multi-turn chats: {s['chats']} conversations x {s['turns']} turns ({s['user']} new tokens "
            f"and a {s['reply']}-token reply a turn)",
            "",
            "| model | prompt tokens | prefix-cache hit tokens | hit share |",
            "| --- | ---: | ---: | ---: |",
            *[
                f"| {label} | {r[m]['prompt_tokens']:,} | {r[m]['hit_tokens']:,} "
                f"| {r[m]['hit_tokens'] / max(1, r[m]['prompt_tokens']):.1%} |"
                for m, label in (("hybrid", "hybrid"), ("full", "its full-attention twin"))
            ],
            "",
            f"hybrid / full-attention hit tokens: **{r['hybrid_over_full']:.3f}** (target within 5%).",
        ]
    if result.get("ttft"):
        r = result["ttft"]
        s = {**result["settings"], **r.get("settings", {})}
        lines += [
            "",
            f"## First token with a cached {s['prefix']:,}-token prefix ({s['own']} tokens after it)",
            "",
            "| prompt | first token s | prefix-cache hit tokens |",
            "| --- | ---: | ---: |",
            f"| computed whole | {r['whole_s']:.3f} | 0 |",
            f"| prefix cached (median of {len(r['cached_runs_s'])}) | {r['cached_s']:.4f} "
            f"| {r['hit_tokens']:,.0f} |",
            "",
            f"cached / whole: **{r['speedup']:.1f}x** faster (target >= 10x).",
        ]
    if result.get("samples"):
        r = result["samples"]
        s = {**result["settings"], **r.get("settings", {})}
        b = r["bound"]
        lines += [
            "",
            f"## {s['samples']} samples of one {s['prefix']:,}-token prompt, {s['gen']} tokens each",
            "",
            "| sharing | decode tok/s | KV read saving | host ms a step | GPU idle | preemptions |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
            *[
                f"| {label} | {r[m]['tok_s']:,.0f} | {r[m]['kv_read_saving_x']:.1f}x "
                f"| {r[m]['host_ms_per_step']:.1f} | {r[m]['host_overhead_frac']:.0%} "
                f"| {r[m]['preemptions']} |"
                for m, label in (("auto", "on"), ("sharing_off", "off"))
            ],
            "",
            f"on / off: **{r['on_over_off']:.2f}x** (target >= 3x). The bytes a step reads allow at most "
            f"{b['on_over_off']:.2f}x: weights {b['weights_gb']:.1f} GB, the samples' linear states "
            f"{b['states_gb']:.1f} GB (read and written), the full layers' KV {b['kv_off_gb']:.1f} GB "
            f"off and {b['kv_on_gb']:.1f} GB on.",
        ]
    runs = [
        f"{p}: {result[p]['run']['commit']}, {result[p]['run']['date']}"
        for p in PARTS
        if "run" in result.get(p, {})
    ]
    if runs:
        lines += ["", "Parts run at: " + "; ".join(runs) + "."]
    write_results(NAME, result, "\n".join(lines) + "\n", out)
    plt = pyplot()
    if plt is None or not result.get("chats"):
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    r = result["chats"]
    turns = range(1, len(r["hybrid"]["hit_tokens_per_turn"]) + 1)
    for m, label in (("hybrid", "hybrid"), ("full", "full-attention twin")):
        ax.plot(list(turns), r[m]["hit_tokens_per_turn"], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix-cache hit tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=110)
    plt.close(fig)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--model", default="dummy:qwen3.5-27b")
    r.add_argument("--device", default="cuda")
    r.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    r.add_argument("--smoke", action="store_true", help="a tiny Qwen3.5 on the CPU, into a temp dir")
    r.add_argument("--chats", type=int, default=16)
    r.add_argument("--turns", type=int, default=10)
    r.add_argument("--user", type=int, default=128, help="chats: new tokens a turn")
    r.add_argument("--reply", type=int, default=96, help="chats: reply tokens a turn")
    r.add_argument("--prefix", type=int, default=16384)
    r.add_argument("--own", type=int, default=32, help="ttft, samples: tokens after the prefix")
    r.add_argument("--repeats", type=int, default=3, help="ttft: cached first tokens timed")
    r.add_argument("--samples", type=int, default=64)
    r.add_argument("--gen", type=int, default=64, help="samples: tokens each sample decodes")
    r.add_argument("--max-batched-tokens", type=int, default=8192)
    r.add_argument("--add-to", help="an earlier run's JSON: its parts kept beside the ones run now")


if __name__ == "__main__":
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)
