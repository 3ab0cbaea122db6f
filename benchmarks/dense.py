"""The dense path (everything but attention) against the bare matmuls and the rooflines (GPU, issue 28).

In one run, for the model (default dummy Llama-3.1-8B shapes, bf16):
  bare_ms         a decode step's weight matmuls alone at B rows: per layer the fused qkv, o, fused
                  gate-up and down projections, then lm_head; captured in one CUDA graph, median
                  replay, the fastest of three 200 ms windows (one before the engine's, two after)
  engine_ms       the engine's decode step with attention="none", B sequences of --prompt-len tokens
                  decoding --gen tokens together: wall time per step (what tokens/s a user sees),
                  and engine_gpu_ms: the GPU's busy time per decode step (the engine's CUDA events)
  engine_cublas_* the same engine with every matmul on cuBLAS and SiLU-and-mul a kernel of its own
                  (``fused.skinny_matmuls(False)``, ``fused.gate_up_kernels(False)``), unless
                  --no-cublas-path
  engine_torch_*  the same engine with the dense-path Triton kernels off (``fused.triton_kernels(False)``:
                  stacked weights, elementwise work in torch, cuBLAS), unless --no-torch-path
  prefill         one prefill step of --prefill-tokens tokens (one sequence): the bare matmuls at that
                  many rows (lm_head on the one sampled row) vs the engine's step (GPU busy time)
  rooflines       memory: the step's weight bytes / a 2 GiB device-to-device copy's rate (read + write);
                  GEMM: FLOPs / an 8192^3 bf16 matmul's rate; both measured in this run
                  (``benchmarks.attention.measure_ceilings``, as attention.json's T* uses them)

Targets (issue 28): engine <= 1.15x bare at every B >= 16; at B=1 >= 70% of the memory roofline;
the prefill step's dense part >= 70% of the GEMM rate.

Usage (GPU, about two minutes on an H200):
  PYTHONPATH=. python -m benchmarks.dense run [--out DIR] [--model dummy:llama-3.1-8b] [--no-torch-path]
      [--no-cublas-path]
  python -m benchmarks.dense report --json FILE [--out DIR]     # dense.md again from a JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import RESULTS, run_info, run_or_report, write_text
from benchmarks.harness.timing import bench_ms

BATCHES = (1, 16, 64, 256, 1024)


def _prompt(length: int, rng: random.Random) -> dict:
    return {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(length)]}


# ---- the model's weights: bytes, FLOPs, and the bare matmuls -------------------------------------
def _matrices(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every (weight, bias) a decode step multiplies by, in order: per layer qkv, o, gate-up, down."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [(attn.qkv_proj.weight, attn.qkv_proj.bias), (attn.o_proj.weight, None)]
        out += [(mlp.gate_up_proj.weight, None), (mlp.down_proj.weight, None)]
    return out


def weight_stats(model: torch.nn.Module) -> dict[str, float]:
    """Bytes a decode step reads (layer matrices + lm_head; the embedding reads B rows only) and FLOPs."""
    layers = _matrices(model)
    layer_params = sum(w.numel() for w, _ in layers)
    lm = model.lm_head.weight
    size = lm.element_size()
    return {
        "weight_bytes": (layer_params + lm.numel()) * size
        + sum(b.numel() * size for _, b in layers if b is not None),
        "flops_per_token": 2.0 * layer_params,  # the layers' matmuls
        "flops_per_logit_row": 2.0 * lm.numel(),  # lm_head, per sampled row
    }


def bare_step(model: torch.nn.Module, rows: int, logit_rows: int) -> Callable[[], None]:
    """The step's matmuls alone on random inputs: ``rows`` tokens through every layer, ``logit_rows``
    through lm_head (the engine computes logits for the sampled rows only)."""
    cfg = model.config
    dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    x = torch.randn(rows, cfg.hidden_size, device=dev, dtype=dtype)
    attn_out = torch.randn(rows, cfg.num_attention_heads * cfg.head_dim, device=dev, dtype=dtype)
    act = torch.randn(rows, cfg.intermediate_size, device=dev, dtype=dtype)
    last = torch.randn(logit_rows, cfg.hidden_size, device=dev, dtype=dtype)
    mats = _matrices(model)
    inputs = [x, attn_out, x, act] * cfg.num_hidden_layers

    def step() -> None:
        for inp, (w, b) in zip(inputs, mats, strict=True):
            F.linear(inp, w, b)
        F.linear(last, model.lm_head.weight)

    return step


# ---- the engine ------------------------------------------------------------------------------------
def engine_decode(llm: Any, batch: int, prompt_len: int, gen: int) -> dict[str, float]:
    """One untimed run of the batch's shape (compiles, graph capture), then the timed one."""
    from prefixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    rng = random.Random(batch)
    llm.generate([_prompt(prompt_len, rng) for _ in range(batch)], params)
    before = llm.metrics()
    outs = llm.generate([_prompt(prompt_len, rng) for _ in range(batch)], params)
    after = llm.metrics()
    first = max(o.metrics["first_token_time"] for o in outs)
    last = max(o.metrics["finish_time"] for o in outs)
    busy = after["decode_gpu_busy_seconds_total"] - before["decode_gpu_busy_seconds_total"]
    idle = after["decode_gpu_idle_seconds_total"] - before["decode_gpu_idle_seconds_total"]
    # the prefill is one step (max_num_batched_tokens holds it), so the window is gen - 1 decode
    # steps of all B rows; the decode GPU counters skip the first (it follows the prefill). The GPU's
    # idle time between decode steps says how much of ms - gpu_ms the host kept it waiting in steps.
    steps = max(1, gen - 2)
    return {
        "ms": 1e3 * (last - first) / (gen - 1),
        "gpu_ms": 1e3 * busy / steps,
        "gpu_idle_ms": 1e3 * idle / steps,
    }


def engine_prefill(llm: Any, tokens: int, reps: int = 5) -> dict[str, float]:
    """Median GPU busy and wall time of a one-sequence prefill step of ``tokens`` (new tokens each rep)."""
    from prefixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(tokens)
    gpu, wall = [], []
    for i in range(reps + 2):  # two untimed
        before = llm.metrics()
        llm.generate([_prompt(tokens, rng)], params)
        after = llm.metrics()
        if i >= 2:
            gpu.append(after["gpu_busy_seconds_total"] - before["gpu_busy_seconds_total"])
            wall.append(after["step_seconds_total"] - before["step_seconds_total"])
    return {"gpu_ms": 1e3 * statistics.median(gpu), "wall_ms": 1e3 * statistics.median(wall)}


def _engine(args: argparse.Namespace) -> Any:
    from prefixserve import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device="cuda",
        attention="none",
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(max(args.batches) * args.prompt_len, args.prefill_tokens),
        progress=False,
    )


def _collect() -> None:
    """Give a dropped engine's memory back (its KV pool is most of the GPU)."""
    gc.collect()
    torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> None:
    from benchmarks.harness.timing import graphed, measure_ceilings
    from prefixserve.model import fused

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/dense.py needs a CUDA GPU")
    t_start = time.perf_counter()
    copy_tbps, gemm_tflops = measure_ceilings(torch.device("cuda"))
    print(f"copy {copy_tbps:.2f} TB/s, bf16 GEMM {gemm_tflops:.0f} TFLOP/s", flush=True)
    llm = _engine(args)
    model = llm.engine.runner.model
    stats = weight_stats(model)
    mem_ms = stats["weight_bytes"] / (copy_tbps * 1e12) * 1e3
    rows: list[dict[str, Any]] = []
    for b in args.batches:
        # The bare graph timed before and twice after the engine, the fastest taken: one 200 ms window
        # can land on a clock dip (on one H200, B=256 read 8.79 ms, above that machine's whole engine
        # step without attention), and the bare matmuls are the yardstick every fraction divides by
        bare_runs = [bench_ms(graphed(bare_step(model, b, b)), 200, warmup=10)]
        eng = engine_decode(llm, b, args.prompt_len, args.gen)
        # captured again after the engine: Gemma-3-12B's graph captured before it faulted (illegal
        # address) when replayed after the engine's own captures, Qwen3-8B's did not; most likely a
        # cuBLAS split-K workspace that those captures released (torch.cuda.graph empties the cache)
        bare_graph = graphed(bare_step(model, b, b))
        bare_runs += [bench_ms(bare_graph, 200, warmup=10), bench_ms(bare_graph, 200, warmup=10)]
        bare = min(bare_runs)
        del bare_graph
        gemm_ms = (b * (stats["flops_per_token"] + stats["flops_per_logit_row"])) / (gemm_tflops * 1e12) * 1e3
        rows.append(
            {
                "B": b,
                "bare_ms": bare,
                "bare_ms_runs": bare_runs,
                "engine_ms": eng["ms"],
                "engine_gpu_ms": eng["gpu_ms"],
                "memory_roofline_ms": mem_ms,
                "gemm_roofline_ms": gemm_ms,
                "roofline_ms": max(mem_ms, gemm_ms),
            }
        )
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    n = args.prefill_tokens
    prefill: dict[str, Any] = {
        "tokens": n,
        "flops": n * stats["flops_per_token"] + stats["flops_per_logit_row"],
        "bare_ms": bench_ms(graphed(bare_step(model, n, 1)), 200, warmup=10),
    }
    prefill["gemm_roofline_ms"] = prefill["flops"] / (gemm_tflops * 1e12) * 1e3
    eng = engine_prefill(llm, n)
    prefill["engine_ms"], prefill["engine_wall_ms"] = eng["gpu_ms"], eng["wall_ms"]
    print(prefill, flush=True)
    del model, llm
    _collect()
    if not args.no_cublas_path:  # a fresh engine whose graphs take cuBLAS for every matmul
        with fused.skinny_matmuls(False), fused.gate_up_kernels(False):
            llm = _engine(args)
            for row in rows:
                eng = engine_decode(llm, row["B"], args.prompt_len, args.gen)
                row["engine_cublas_ms"], row["engine_cublas_gpu_ms"] = eng["ms"], eng["gpu_ms"]
                print(row, flush=True)
            del llm
            _collect()
    if not args.no_torch_path:  # a fresh engine: its graphs are captured with the torch path
        with fused.triton_kernels(False):
            llm = _engine(args)
            for row in rows:
                eng = engine_decode(llm, row["B"], args.prompt_len, args.gen)
                row["engine_torch_ms"], row["engine_torch_gpu_ms"] = eng["ms"], eng["gpu_ms"]
                print(row, flush=True)
            eng = engine_prefill(llm, n)
            prefill["engine_torch_ms"], prefill["engine_torch_wall_ms"] = eng["gpu_ms"], eng["wall_ms"]
            del llm
            _collect()
    import triton

    result = {
        **run_info(),
        "triton": triton.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "copy_bandwidth_TBps": copy_tbps,
        "gemm_TFLOPs": gemm_tflops,
        **stats,
        "memory_roofline_ms": mem_ms,
        "rows": rows,
        "prefill": prefill,
        "run_seconds": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dense.json").write_text(json.dumps(result, indent=1))
    report(result, out)


def _x(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}"


def report(result: dict[str, Any], out_dir: Path) -> None:
    """dense.md: the table, the rooflines and the issue's targets, from the JSON."""
    mem = result["memory_roofline_ms"]
    first = result["rows"][0]
    torch_cols = any("engine_torch_ms" in r for r in result["rows"])
    cublas_cols = any("engine_cublas_ms" in r for r in result["rows"])
    lines = [
        f"# The dense path vs the bare matmuls ({result['device']})",
        "",
        f"torch {result['torch']}, triton {result.get('triton', '?')}, commit {result['commit']}, "
        f"{result['date']}; model {result['model']}, {result['dtype']}. Measured in this run: copy "
        f"{result['copy_bandwidth_TBps']:.2f} TB/s (read + write), bf16 GEMM {result['gemm_TFLOPs']:.0f} "
        f"TFLOP/s; a decode step reads {result['weight_bytes'] / 1e9:.2f} GB of weights, so the memory "
        f"roofline is {mem:.2f} ms. `bare`: the step's weight matmuls alone (fused qkv, o, fused gate-up, "
        "down per layer, lm_head), one CUDA graph, median replay"
        + (", the fastest of three windows around the engine's" if "bare_ms_runs" in first else "")
        + ". `engine`: the engine's decode step "
        f'with attention="none" ({result["prompt_len"]} prompt tokens, {result["gen"]} generated, decode '
        "under CUDA graphs): wall time per step; `GPU`: the GPU's busy time per step. `torch path`: the "
        "same engine with the dense-path Triton kernels off. `cuBLAS only`: the engine with every matmul "
        "on cuBLAS and SiLU-and-mul a kernel of its own (the skinny and gate-up kernels off). Written by "
        "`benchmarks/dense.py`.",
        "",
        "| B | bare ms | engine ms | engine GPU ms | engine / bare | roofline ms | bare at roofline "
        "| engine at roofline | engine tok/s |"
        + (" cuBLAS only ms | cuBLAS only / engine |" if cublas_cols else "")
        + (" torch path ms | torch path / bare |" if torch_cols else ""),
        "| ---: " * (9 + 2 * torch_cols + 2 * cublas_cols) + "|",
    ]
    for r in result["rows"]:
        cells = [
            str(r["B"]),
            f"{r['bare_ms']:.2f}",
            f"{r['engine_ms']:.2f}",
            f"{r['engine_gpu_ms']:.2f}",
            _x(r["engine_ms"], r["bare_ms"]),
            f"{r['roofline_ms']:.2f}",
            _x(r["roofline_ms"], r["bare_ms"]),
            _x(r["roofline_ms"], r["engine_ms"]),
            f"{1e3 * r['B'] / r['engine_ms']:.0f}",
        ]
        if cublas_cols:
            cells += [
                "—" if "engine_cublas_ms" not in r else f"{r['engine_cublas_ms']:.2f}",
                _x(r.get("engine_cublas_ms"), r["engine_ms"]),
            ]
        if torch_cols:
            cells += [
                f"{r.get('engine_torch_ms', float('nan')):.2f}",
                _x(r.get("engine_torch_ms"), r["bare_ms"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    p = result["prefill"]
    gemm = p["gemm_roofline_ms"]
    lines += [
        "",
        f"Prefill step of {p['tokens']} tokens (one sequence; {p['flops'] / 1e12:.1f} TFLOP, "
        f"{gemm:.1f} ms at the GEMM rate): bare matmuls {p['bare_ms']:.1f} ms ({gemm / p['bare_ms']:.0%} "
        f"of the GEMM rate), engine {p['engine_ms']:.1f} ms GPU busy ({gemm / p['engine_ms']:.0%}; "
        f"{p['engine_wall_ms']:.1f} ms wall)"
        + (
            f", torch path {p['engine_torch_ms']:.1f} ms ({gemm / p['engine_torch_ms']:.0%})."
            if "engine_torch_ms" in p
            else "."
        ),
        "",
        "Targets (issue 28):",
        "",
    ]
    over = [(r["B"], r["engine_ms"] / r["bare_ms"]) for r in result["rows"] if r["B"] >= 16]
    lines.append(
        "- engine <= 1.15x bare at every B >= 16: "
        + ("met" if all(x <= 1.15 for _, x in over) else "not met")
        + " ("
        + ", ".join(f"B={b}: {x:.2f}x" for b, x in over)
        + ")"
    )
    one = [r for r in result["rows"] if r["B"] == 1]
    if one:
        frac = mem / one[0]["engine_ms"]
        lines.append(
            f"- B=1 at >= 70% of the memory roofline: {'met' if frac >= 0.7 else 'not met'} ({frac:.0%})"
        )
    frac = gemm / p["engine_ms"]
    lines.append(
        f"- prefill dense part >= 70% of the GEMM rate: {'met' if frac >= 0.7 else 'not met'} ({frac:.0%})"
    )
    write_text(out_dir, "dense.md", lines)


def main() -> None:
    def add_run_args(r: argparse.ArgumentParser) -> None:
        r.add_argument("--model", default="dummy:llama-3.1-8b")
        r.add_argument("--dtype", default="bfloat16")
        r.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
        r.add_argument("--prompt-len", type=int, default=64)
        r.add_argument("--gen", type=int, default=64)
        r.add_argument("--prefill-tokens", type=int, default=8192)
        r.add_argument("--no-torch-path", action="store_true", help="skip the engine with the kernels off")
        r.add_argument(
            "--no-cublas-path", action="store_true", help="no engine without the skinny and gate-up kernels"
        )

    run_or_report(__doc__, "dense", RESULTS, add_run_args, run, report)


if __name__ == "__main__":
    main()
