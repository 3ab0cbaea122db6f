"""FP8 KV cache on a GPU (issue 103): exactness across attention paths, pool size and decode speed.

1. Exactness: a 4-layer model of Llama-3.1-8B layer shapes (dummy weights, fp32), 16 requests sharing a
   1,024-token prefix, ``kv_cache_dtype="fp8"``: greedy outputs with attention = reference (eager),
   cascade, triton and auto (CUDA graphs) must match.
2. Pool and speed (bf16, full 8B shapes, ``--gpu-memory-utilization``): KV pool tokens and decode
   tokens/s at B=64 with a 4,096-token shared prefix, model-dtype cache against FP8.

    PYTHONPATH=. python -m benchmarks.fp8_kv      (prints JSON; --quick: exactness only)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.decode_run import shared_prompts
from benchmarks.harness import dummy_model, run_info
from benchmarks.harness.models import shipped_config
from prefixserve import LLM, SamplingParams


def exactness() -> dict:
    model = dummy_model({**shipped_config("llama-3.1-8b"), "num_hidden_layers": 4}, Path(tempfile.mkdtemp()))
    prompts = shared_prompts(16, 1024, 24)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs: dict[str, list] = {}
    for attention in ("reference", "cascade", "triton", "auto"):
        llm = LLM(
            model=model,
            dtype="float32",
            device="cuda",
            attention=attention,
            enforce_eager=attention == "reference",
            kv_cache_dtype="fp8",
            num_kv_blocks=4096,
            progress=False,
        )
        outs[attention] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    return {a: outs[a] == outs["reference"] for a in outs}


def pool_and_speed(kv_cache_dtype: str, batch: int, prefix: int, gen: int, utilization: float) -> dict:
    llm = LLM(
        model="dummy:llama-3.1-8b",
        dtype="bfloat16",
        device="cuda",
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=utilization,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        progress=False,
    )
    pool_tokens = llm.metrics()["kv_pool_tokens"]
    prompts = shared_prompts(batch, prefix, 64)
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))  # warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True))
    torch.cuda.synchronize()
    first = max(o.metrics["first_token_time"] for o in outs)
    last = max(o.metrics["finish_time"] for o in outs)
    result = {
        "kv_pool_tokens": pool_tokens,
        "decode_tok_s": batch * (gen - 1) / (last - first),
        "elapsed_s": time.perf_counter() - t0,
    }
    del llm
    torch.cuda.empty_cache()
    return result


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--quick", action="store_true", help="exactness only")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    args = parser.parse_args()
    payload: dict = {**run_info(), "fp8_greedy_equal_to_reference": exactness()}
    if not args.quick:
        payload["decode_B64_P4096"] = {
            kv: pool_and_speed(kv, 64, 4096, 32, args.gpu_memory_utilization) for kv in ("auto", "fp8")
        }
    print(json.dumps(payload, indent=1, default=str))


if __name__ == "__main__":
    main()
