"""End to end on this CPU, default model: prefixserve vs HF transformers, and attention backends.

Question 1 (engine foundation): 32 requests share a 1,000-token system prompt, each adds a 64-token
question and generates 64 tokens. prefixserve (prefix cache + continuous batching) against HF
transformers' batched, left-padded `generate`: end-to-end tokens/s and time to first token.

Question 2 (shared-segment attention): decode tokens/s for B=32 requests sharing a 2,000-token system
prompt, with attention = reference (per sequence), cascade and auto.

    python benchmarks/e2e_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.harness import run_info, write_results
from prefixserve import LLM, SamplingParams


def make_prompts(tok, n: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    pool = [t for t in range(100, 30000) if t not in special]
    prefix = rng.choices(pool, k=prefix_len)
    return [prefix + rng.choices(pool, k=suffix_len) for _ in range(n)]


def bench_prefixserve(prompts: list[list[int]], gen: int, attention: str) -> dict:
    llm = LLM(dtype="float32", device="cpu", attention=attention, num_kv_blocks=4096, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:32]}, SamplingParams(max_tokens=2))  # warm up
    before = llm.metrics()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    m = llm.metrics()
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    decode_span = max(o.metrics["finish_time"] for o in outs) - max(
        o.metrics["first_token_time"] for o in outs
    )
    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    read = m["attention_kv_tokens_read_total"] - before["attention_kv_tokens_read_total"]
    logical = m["attention_kv_tokens_logical_total"] - before["attention_kv_tokens_logical_total"]
    return {
        "elapsed_s": elapsed,
        "tokens_per_s": n_gen / elapsed,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_max_s": max(ttft),
        "decode_tokens_per_s": len(outs) * (gen - 1) / max(decode_span, 1e-9),
        "kv_read_saving_x": logical / max(read, 1),
        "cascade_steps": m["cascade_steps_total"] - before["cascade_steps_total"],
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def bench_hf(prompts: list[list[int]], gen: int) -> dict:
    from transformers import AutoModelForCausalLM

    from prefixserve.model.loader import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=2)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=gen, min_new_tokens=gen, do_sample=False, pad_token_id=2
        )
        elapsed = time.perf_counter() - t0
    n_gen = (out.shape[1] - width) * len(prompts)
    return {
        "elapsed_s": elapsed,
        "tokens_per_s": n_gen / elapsed,
        "ttft_mean_s": ttft,
        "ttft_max_s": ttft,
        "tokens": [row[width:].tolist() for row in out],
    }


def _row(name: str, r: dict) -> str:
    cells = [
        f"{r['tokens_per_s']:.1f}",
        f"{r['ttft_mean_s']:.2f}",
        f"{r['ttft_max_s']:.2f}",
        f"{r['elapsed_s']:.1f}",
    ]
    return "| " + " | ".join([name, *cells]) + " |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    n, prefix, suffix, gen = (8, 256, 16, 8) if args.quick else (32, 1000, 64, 64)
    probe = LLM(dtype="float32", device="cpu", num_kv_blocks=16, progress=False)
    prompts = make_prompts(probe.get_tokenizer(), n, prefix, suffix)
    del probe

    ours = bench_prefixserve(prompts, gen, "auto")
    hf = bench_hf(prompts, gen)
    same = sum(a == b for a, b in zip(ours["tokens"], hf["tokens"], strict=True))

    b2, p2, g2 = (8, 512, 8) if args.quick else (32, 2000, 32)
    prompts2 = make_prompts(LLM(num_kv_blocks=16, progress=False).get_tokenizer(), b2, p2, 32, seed=1)
    backends = {a: bench_prefixserve(prompts2, g2, a) for a in ("reference", "cascade", "auto")}
    equal = all(backends[a]["tokens"] == backends["reference"]["tokens"] for a in backends)

    strip = lambda d: {k: v for k, v in d.items() if k != "tokens"}  # noqa: E731
    payload = {
        **run_info(),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32)",
        "vs_hf": {
            "requests": n,
            "prefix": prefix,
            "suffix": suffix,
            "generated": gen,
            "prefixserve": strip(ours),
            "hf_transformers": strip(hf),
            "identical_outputs": same,
        },
        "backends": {
            "requests": b2,
            "prefix": p2,
            "generated": g2,
            "greedy_outputs_equal": equal,
            **{a: strip(r) for a, r in backends.items()},
        },
    }
    md = [
        "# End to end on CPU (default model, fp32)",
        "",
        f"{payload['device']}, {payload['cpu_count']} cores; torch {payload['torch']}; "
        f"commit {payload['commit']}; {payload['date']}. Written by `benchmarks/e2e_cpu.py`.",
        "",
        f"## prefixserve vs HF transformers: {n} requests, {prefix}-token shared prefix "
        f"+ {suffix} own, {gen} generated",
        "",
        "| engine | tokens/s | mean TTFT (s) | max TTFT (s) | wall (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
        _row("prefixserve (auto)", ours),
        _row("HF generate (batched, padded)", hf),
        "",
        f"Throughput ratio {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x; mean TTFT ratio "
        f"{hf['ttft_mean_s'] / ours['ttft_mean_s']:.2f}x (HF's TTFT is its batched prefill). "
        f"Identical greedy outputs: {same}/{n} (HF pads, so tiny fp32 differences can flip late tokens).",
        "",
        f"## Attention backends: B={b2}, {p2}-token shared system prompt, {g2} generated",
        "",
        "| attention | decode tokens/s | tokens/s end to end | KV read saving | cascade steps |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for a, r in backends.items():
        cells = [a, f"{r['decode_tokens_per_s']:.1f}", f"{r['tokens_per_s']:.1f}"]
        md.append(
            "| " + " | ".join([*cells, f"{r['kv_read_saving_x']:.1f}x", str(r["cascade_steps"])]) + " |"
        )
    md += ["", f"Greedy outputs equal across backends: {equal}.", ""]
    write_results("e2e_cpu", payload, "\n".join(md))


if __name__ == "__main__":
    main()
