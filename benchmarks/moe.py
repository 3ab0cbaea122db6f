"""Mixture of experts on one GPU (issue 102): the fused MoE kernels, the decode step against its
roofline, and sharing on / off, at the shipped MoE shapes with dummy weights (bf16).

Parts (``--parts``), in one process:
  kernels   one MoE layer of the model (router, experts, weighted sum) at each B, graphed, median
            replay: the fused path (``model/kernels/fused_moe.py``) against ``torch._grouped_mm``
            (sort by expert, gather, two grouped GEMMs, activation, weighted index_add: the baseline
            the issue names), outputs checked equal first; the bytes of the experts this routing
            touches over the time, against the copy rate
  decode    the engine's decode step with attention="none" (the ceiling: everything but attention)
            at each B, under CUDA graphs, against the step's roofline: the larger of (bytes it must
            read: every non-expert weight, lm_head and each layer's experts that B uniformly routed
            tokens touch in expectation, E (1 - (1 - k/E)^B), over the copy rate) and (its FLOPs over
            the GEMM rate); both rates measured in this run
  sharing   decode with a P-token shared prefix, sharing on and off (``benchmarks.decode_run``)
  serve     ``prefixserve serve`` of each --serve-models model (a subprocess, as a user starts it):
            a burst of --serve-batch concurrent completions (token-id prompts of --prompt-len, --gen
            tokens each), after one untimed burst; generated tokens over the burst's wall time

    PYTHONPATH=. python -m benchmarks.moe run [--model qwen3-30b-a3b] [--parts kernels decode sharing]
        [--batches 1 64 256 1024] [--share-batches 256] [--prefix 16384] [--out docs/benchmarks]
    python -m benchmarks.moe report --json docs/benchmarks/moe.json
"""

from __future__ import annotations

import argparse
import gc
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import RESULTS, pyplot, run_info
from benchmarks.harness.output import run_or_report, write_json, write_text

NAME = "moe"


def grouped_mm_moe(
    x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The baseline: the assignments sorted by expert, gathered, two ``torch._grouped_mm`` calls
    around the SiLU-and-mul, weighted and index-added back (no host sync: graph-safe)."""
    hidden, inter = x.shape[1], w_down.shape[1]
    experts = w_down.shape[0] // hidden
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // ids.shape[1]
    up = torch._grouped_mm(x[token], w_up.view(experts, 2 * inter, hidden).transpose(1, 2), offs=offs)
    act = F.silu(up[:, :inter]) * up[:, inter:]
    down = torch._grouped_mm(act, w_down.view(experts, hidden, inter).transpose(1, 2), offs=offs)
    down = down * weights.reshape(-1)[order, None].to(down.dtype)
    return torch.zeros_like(x).index_add_(0, token, down)


def layer_row(
    x: torch.Tensor,
    router: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    cfg: Any,
    copy_tbps: float,
) -> dict[str, Any]:
    """One MoE layer at x's rows: the fused path (with and without its routing) and the baseline."""
    from benchmarks.harness.timing import bench_ms, graphed
    from prefixserve.model.kernels import fused_moe

    logits = x @ router.T
    k, rule, norm = cfg.num_experts_per_tok, cfg.router_rule, cfg.norm_topk_prob
    weights, ids = fused_moe.route(logits, k, rule, norm)
    touched = int(torch.unique(ids).numel())
    fused_out = fused_moe.experts_forward(x, w_up, w_down, weights, ids)
    base_out = grouped_mm_moe(x, w_up, w_down, weights, ids)
    err = float((fused_out.float() - base_out.float()).abs().max() / base_out.float().abs().max())
    row: dict[str, Any] = {"B": x.shape[0], "experts_touched": touched, "max_rel_err_vs_grouped_mm": err}
    row["fused_ms"] = bench_ms(graphed(lambda: fused_moe.experts_forward(x, w_up, w_down, weights, ids)), 200)
    routed = lambda: fused_moe.experts_forward(x, w_up, w_down, *fused_moe.route(logits, k, rule, norm))  # noqa: E731
    row["fused_with_routing_ms"] = bench_ms(graphed(routed), 200)
    try:
        base_ms = bench_ms(graphed(lambda: grouped_mm_moe(x, w_up, w_down, weights, ids)), 200)
        row |= {"grouped_mm_ms": base_ms, "fused_over_grouped_mm": base_ms / row["fused_ms"]}
    except Exception as exc:  # an image whose torch has no _grouped_mm for this dtype/arch
        row["grouped_mm_error"] = repr(exc)[:200]
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * x.element_size()
    row["fused_TBps"] = touched * expert_bytes / (row["fused_ms"] * 1e-3) / 1e12
    row["fused_of_copy_rate"] = row["fused_TBps"] / copy_tbps
    return row


def layer_weights(cfg: Any) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MoE layer's random bf16 weights on the GPU (seeded): (the generator, w_up, w_down, router)."""
    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w_up = torch.randn(experts * 2 * inter, hidden, device=dev, dtype=dtype, generator=gen) * hidden**-0.5
    w_down = torch.randn(experts * hidden, inter, device=dev, dtype=dtype, generator=gen) * inter**-0.5
    router = torch.randn(experts, hidden, device=dev, dtype=dtype, generator=gen) * hidden**-0.5
    return gen, w_up, w_down, router


def kernels_part(model: str, batches: list[int], copy_tbps: float) -> list[dict[str, Any]]:
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.loader import resolve_model

    cfg = ModelConfig.from_json(resolve_model(model).path)
    gen, w_up, w_down, router = layer_weights(cfg)
    rows = []
    for b in batches:
        x = torch.randn(b, cfg.hidden_size, device=w_up.device, dtype=w_up.dtype, generator=gen)
        rows.append(layer_row(x, router, w_up, w_down, cfg, copy_tbps))
        print(rows[-1], flush=True)
    return rows


def roofline_ms(cfg: Any, b: int, copy_tbps: float, gemm_tflops: float) -> dict[str, float]:
    """The decode step's bytes and FLOPs without attention's KV reads (the ceiling's step)."""
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn_params = hidden * (q + 2 * kv) + q * hidden
    expert_params = 3 * hidden * cfg.moe_intermediate_size
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** b)
    moe_layers = sum(cfg.layer_spec(i).moe for i in range(layers))
    dense_params = 3 * hidden * cfg.intermediate_size * (layers - moe_layers)
    lm = cfg.vocab_size * hidden
    weight_bytes = 2 * (
        layers * attn_params + moe_layers * (touched * expert_params + e * hidden) + dense_params + lm
    )
    flops = 2 * b * (layers * attn_params + moe_layers * k * expert_params + dense_params + lm)
    bytes_ms = weight_bytes / (copy_tbps * 1e12) * 1e3
    flops_ms = flops / (gemm_tflops * 1e12) * 1e3
    return {
        "weight_GB": weight_bytes / 1e9,
        "bytes_ms": bytes_ms,
        "flops_ms": flops_ms,
        "roofline_ms": max(bytes_ms, flops_ms),
    }


def decode_part(
    model: str, batches: list[int], prompt_len: int, gen: int, copy_tbps: float, gemm_tflops: float
) -> list[dict[str, Any]]:
    from benchmarks.dense import engine_decode
    from prefixserve import LLM
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.loader import resolve_model

    cfg = ModelConfig.from_json(resolve_model(model).path)
    llm = LLM(
        model=model, dtype="bfloat16", device="cuda", attention="none", max_num_seqs=max(batches),
        max_num_batched_tokens=max(batches) * prompt_len, progress=False,
    )  # fmt: skip
    rows = []
    for b in batches:
        got = engine_decode(llm, b, prompt_len, gen)
        roof = roofline_ms(cfg, b, copy_tbps, gemm_tflops)
        row = {
            "B": b,
            "step_ms": got["ms"],
            "gpu_ms": got["gpu_ms"],
            "gpu_idle_ms": got["gpu_idle_ms"],
            **roof,
        }
        row["of_roofline"] = roof["roofline_ms"] / got["ms"]
        # the step's period on the GPU's clock (busy, plus any wait for the host between steps): the
        # wall window also holds the run's end, where all B requests finish at once
        row["of_roofline_gpu"] = roof["roofline_ms"] / (got["gpu_ms"] + got["gpu_idle_ms"])
        rows.append(row)
        print(row, flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def sharing_part(model: str, batches: list[int], prefix: int, own: int, gen: int) -> list[dict[str, Any]]:
    from benchmarks.decode_run import MODES, measure, shared_prompts

    rows = []
    for b in batches:
        prompts = (shared_prompts(b, prefix, own, seed=0), shared_prompts(b, prefix, own, seed=1))
        row: dict[str, Any] = {"B": b, "P": prefix}
        for mode in ("auto", "sharing_off"):
            got = measure(model, "cuda", MODES[mode], prompts, gen)
            row[f"{mode}_tok_s"] = got["tok_s"]
            row[f"{mode}_preemptions"] = got["preemptions"]
            gc.collect()
            torch.cuda.empty_cache()
        row["on_over_off"] = row["auto_tok_s"] / row["sharing_off_tok_s"]
        rows.append(row)
        print(row, flush=True)
    return rows


def serve_part(models: list[str], batch: int, prompt_len: int, gen: int, out: Path) -> list[dict[str, Any]]:
    """Each family served by ``prefixserve serve``: start seconds and a burst's tokens/s."""
    from benchmarks.harness.burst import served_burst

    rows = []
    for name in models:
        row = served_burst(f"dummy:{name}", batch, prompt_len, gen, out / f"serve_{name}.log")
        rows.append({**row, "model": name})
    return rows


def run(args: argparse.Namespace) -> None:
    from benchmarks.harness.timing import measure_ceilings

    random.seed(0)
    copy_tbps, gemm_tflops = measure_ceilings(torch.device("cuda"))
    model = f"dummy:{args.model}"
    result: dict[str, Any] = {
        **run_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "out")},
        "copy_TBps": copy_tbps,
        "gemm_TFLOPs": gemm_tflops,
    }
    out = Path(args.out)
    if "kernels" in args.parts:
        result["kernels"] = kernels_part(model, args.batches, copy_tbps)
        write_json(out / f"{NAME}.json", result)
    if "decode" in args.parts:
        result["decode"] = decode_part(model, args.batches, args.prompt_len, args.gen, copy_tbps, gemm_tflops)
        write_json(out / f"{NAME}.json", result)
    if "sharing" in args.parts:
        result["sharing"] = sharing_part(model, args.share_batches, args.prefix, args.own, args.gen)
        write_json(out / f"{NAME}.json", result)
    if "serve" in args.parts:
        result["serve"] = serve_part(args.serve_models, args.serve_batch, args.prompt_len, args.gen, out)
        write_json(out / f"{NAME}.json", result)
    report(result, out)


def _routing(result: dict[str, Any]) -> str:
    """How the run's dummy routers chose experts: uniform draws made at load (``model/dummy_routing``);
    drawn each step (``torch.rand_like``) from 29456de; before, by their random weights."""
    if result.get("dummy_routing") == "uniform_table":
        return "uniform at random, drawn at load (a dummy model's routers, `model/dummy_routing.py`)"
    if result.get("dummy_routing") == "uniform":
        return "uniform at random, drawn each step (a dummy model's routers)"
    return "by the random weights (a batch converges on a few experts)"


def report(result: dict[str, Any], out: Path) -> None:
    s = result["settings"]
    lines = [
        f"# Mixture of experts: {s['model']} on one GPU",
        "",
        f"{result['device']}; torch {result['torch']}; commit {result['commit']}; {result['date']}; dummy "
        f"weights, bf16, routing: {_routing(result)}. Ceilings measured in this run: copy "
        f"{result['copy_TBps']:.2f} TB/s, GEMM {result['gemm_TFLOPs']:.0f} TFLOP/s. Written by "
        "`benchmarks/moe.py`.",
    ]
    if result.get("kernels"):
        lines += [
            "",
            "## One MoE layer: fused kernels vs `torch._grouped_mm` (graphed, median replay)",
            "",
            "| B | experts touched | fused ms | with routing ms | grouped_mm ms | fused speed-up "
            "| fused TB/s | of copy rate |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in result["kernels"]:
            base = (
                f"{r['grouped_mm_ms']:.3f} | {r['fused_over_grouped_mm']:.2f}x"
                if "grouped_mm_ms" in r
                else "n/a | n/a"
            )
            lines.append(
                f"| {r['B']} | {r['experts_touched']} | {r['fused_ms']:.3f} | "
                f"{r['fused_with_routing_ms']:.3f} | "
                f"{base} | {r['fused_TBps']:.2f} | {r['fused_of_copy_rate']:.2f} |"
            )
    if result.get("decode"):
        lines += [
            "",
            f"## Decode step, attention off (the ceiling), CUDA graphs ({s['prompt_len']}-token prompts, "
            f"{s['gen']} generated)",
            "",
            "Step ms is the wall window from the first decode step to the last request's end over the "
            "steps; it also holds the run's end, where all B requests finish at once. GPU busy and idle "
            "are a step's on the GPU's clock (idle: waiting for the host between decode steps).",
            "",
            "| B | step ms | GPU busy ms | GPU idle ms | weights read GB | bytes ms | FLOPs ms "
            "| roofline / step | roofline / GPU step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in result["decode"]:
            idle = f"{r['gpu_idle_ms']:.3f}" if "gpu_idle_ms" in r else "n/a"
            gpu_step = f"{r['of_roofline_gpu']:.2f}" if "of_roofline_gpu" in r else "n/a"
            lines.append(
                f"| {r['B']} | {r['step_ms']:.3f} | {r['gpu_ms']:.3f} | {idle} | {r['weight_GB']:.2f} | "
                f"{r['bytes_ms']:.3f} | {r['flops_ms']:.3f} | {r['of_roofline']:.2f} | {gpu_step} |"
            )
    if result.get("sharing"):
        lines += [
            "",
            f"## Shared prefix: sharing on / off ({s['own']} own tokens each, {s['gen']} generated)",
            "",
            "| B | P | sharing on tok/s | sharing off tok/s | on / off |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in result["sharing"]:
            lines.append(
                f"| {r['B']} | {r['P']} | {r['auto_tok_s']:,.0f} | {r['sharing_off_tok_s']:,.0f} | "
                f"{r['on_over_off']:.2f}x |"
            )
    if result.get("serve"):
        lines += [
            "",
            f"## `prefixserve serve`: a burst of {result['serve'][0]['B']} concurrent completions "
            f"({s['prompt_len']}-token prompts, {s['gen']} tokens each)",
            "",
            "| model | start s | tok/s | note |",
            "| --- | --- | --- | --- |",
        ]
        for r in result["serve"]:
            note = r.get("error", "")
            if r["model"].startswith("gpt-oss") and "error" not in r:
                note = "attention sinks: attention launched eagerly (no whole-step decode graphs)"
            tok = f"{r['tok_s']:,.0f}" if "tok_s" in r else "n/a"
            lines.append(f"| {r['model']} | {r.get('start_s', 0):.0f} | {tok} | {note} |")
    write_json(out / f"{NAME}.json", result)
    write_text(out, f"{NAME}.md", lines)
    plt = pyplot()
    if plt is None or not (result.get("kernels") or result.get("decode")):
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    if result.get("kernels"):
        ks = result["kernels"]
        x = range(len(ks))
        axes[0].bar([i - 0.2 for i in x], [r["fused_ms"] for r in ks], width=0.4, label="fused")
        axes[0].bar(
            [i + 0.2 for i in x], [r.get("grouped_mm_ms", 0) for r in ks], width=0.4, label="grouped_mm"
        )
        axes[0].set_xticks(list(x), [f"B={r['B']}" for r in ks])
        axes[0].set_ylabel("ms per MoE layer")
        axes[0].legend(fontsize=7)
    if result.get("decode"):
        ds = result["decode"]
        axes[1].bar([f"B={r['B']}" for r in ds], [r["of_roofline"] for r in ds])
        axes[1].axhline(0.6, color="k", lw=0.8, ls="--")
        axes[1].set_ylabel("roofline / step (attention off)")
    fig.suptitle(f"{s['model']} on {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=120)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--model", default="qwen3-30b-a3b")
    r.add_argument("--parts", nargs="+", default=["kernels", "decode", "sharing", "serve"])
    r.add_argument("--serve-models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"])
    r.add_argument("--serve-batch", type=int, default=64)
    r.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024])
    r.add_argument("--share-batches", type=int, nargs="+", default=[256])
    r.add_argument("--prefix", type=int, default=16384)
    r.add_argument("--own", type=int, default=64)
    r.add_argument("--prompt-len", type=int, default=64)
    r.add_argument("--gen", type=int, default=64)


if __name__ == "__main__":
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)
