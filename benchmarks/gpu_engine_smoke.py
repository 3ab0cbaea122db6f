"""The whole engine on a GPU: greedy outputs equal across attention backends, and a decode-speed probe.

1. Exactness: a 4-layer model with Llama-3.1-8B layer shapes (dummy weights, fp32), 16 requests sharing
   a 1,024-token prefix: greedy outputs with attention = reference, cascade, triton and auto must match.
2. Speed probe (bf16, full 8B shapes): decode tokens/s at B=64 with a 4,096-token shared prefix, for
   triton (sharing), triton_paged (no sharing) and auto (per-step choice), with the engine's host
   share of step time. Eager mode; CUDA graphs are future work.

    python benchmarks/gpu_engine_smoke.py            (writes docs/benchmarks/gpu_engine_smoke.json/.md)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.decode_run import shared_prompts
from benchmarks.harness import dummy_model, run_info, write_results
from benchmarks.harness.models import shipped_config
from prefixserve import LLM, SamplingParams


def exactness() -> dict:
    model = dummy_model({**shipped_config("llama-3.1-8b"), "num_hidden_layers": 4}, Path(tempfile.mkdtemp()))
    prompts = shared_prompts(16, 1024, 24)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for attention in ("reference", "cascade", "triton", "auto"):
        llm = LLM(
            model=model,
            dtype="float32",
            device="cuda",
            attention=attention,
            num_kv_blocks=4096,
            progress=False,
        )
        outs[attention] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        m = llm.metrics()
        outs[attention + "_saving"] = m["attention_kv_tokens_logical_total"] / max(
            1, m["attention_kv_tokens_read_total"]
        )
        del llm
        torch.cuda.empty_cache()
    ref = outs["reference"]
    return {
        a: {"equal_to_reference": outs[a] == ref, "kv_read_saving_x": outs[a + "_saving"]}
        for a in ("reference", "cascade", "triton", "auto")
    }


def decode_speed(attention: str, batch: int, prefix: int, gen: int) -> dict:
    llm = LLM(
        model="dummy:llama-3.1-8b",
        dtype="bfloat16",
        device="cuda",
        attention=attention,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        progress=False,
    )
    prompts = shared_prompts(batch, prefix, 64)
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))  # warm up: this batch's kernels
    torch.cuda.synchronize()
    before = llm.metrics()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    first = max(o.metrics["first_token_time"] for o in outs)
    last = max(o.metrics["finish_time"] for o in outs)
    after = llm.metrics()
    steps = after["step_seconds_total"] - before["step_seconds_total"]
    result = {
        "decode_tok_s": batch * (gen - 1) / (last - first),
        "elapsed_s": elapsed,
        "prefill_s": first - min(o.metrics["arrival_time"] for o in outs),
        "host_frac": (after["step_host_seconds_total"] - before["step_host_seconds_total"])
        / max(steps, 1e-9),
        "cascade_steps": after["cascade_steps_total"] - before["cascade_steps_total"],
    }
    del llm
    torch.cuda.empty_cache()
    return result


def main() -> None:
    exact = exactness()
    speed = {a: decode_speed(a, 64, 4096, 32) for a in ("triton", "triton_paged", "auto")}
    payload = {**run_info(), "exactness": exact, "decode_B64_P4096": speed}
    md = [
        "# The engine on a GPU (smoke)",
        "",
        f"{payload['device']}; torch {payload['torch']}; commit "
        f"{payload['commit']}; {payload['date']}. Written by `benchmarks/gpu_engine_smoke.py`.",
        "",
        "| attention | greedy equal to reference (fp32, 4 layers of 8B shape) | KV read saving |",
        "| --- | --- | ---: |",
    ]
    md += [f"| {a} | {r['equal_to_reference']} | {r['kv_read_saving_x']:.1f}x |" for a, r in exact.items()]
    md += [
        "",
        "Decode, Llama-3.1-8B shapes (dummy weights, bf16), B=64, 4,096-token shared prefix, eager:",
        "",
        "| attention | decode tokens/s | prefill s | host share of step time | shared-path steps |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    md += [
        f"| {a} | {r['decode_tok_s']:.0f} | {r['prefill_s']:.2f} | {r['host_frac']:.0%} "
        f"| {r['cascade_steps']:.0f} |"
        for a, r in speed.items()
    ]
    write_results("gpu_engine_smoke", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
