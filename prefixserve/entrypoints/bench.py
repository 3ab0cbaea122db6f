"""A synthetic shared-prefix workload for ``prefixserve bench``: one prefix, unique suffixes."""

from __future__ import annotations

import random
import statistics
import time
from array import array
from typing import Any


def shared_prefix_prompts(
    vocab_size: int, special_ids: set[int], num_requests: int, prefix_len: int, suffix_len: int, seed: int
) -> list[array]:
    """Random token prompts: a common prefix, then ``suffix_len`` tokens unique to each request
    (int64 arrays: a big batch of long prompts as lists would slow every full GC pass of the run)."""
    rng = random.Random(seed)
    pool = [t for t in range(min(vocab_size, 32000)) if t not in special_ids]
    prefix = array("q", rng.choices(pool, k=prefix_len))
    return [prefix + array("q", rng.choices(pool, k=suffix_len)) for _ in range(num_requests)]


def run_shared_prefix_bench(
    llm: Any, num_requests: int, prefix_len: int, suffix_len: int, output_len: int, seed: int = 0
) -> dict[str, float]:
    """Generate ``output_len`` tokens (EOS ignored) for every request; report throughput and sharing."""
    from prefixserve.sampling.params import SamplingParams

    if min(num_requests, suffix_len, output_len) < 1 or prefix_len < 0:
        raise ValueError("num-requests, suffix-len and output-len must be >= 1, prefix-len >= 0")
    tok = llm.get_tokenizer()
    special = set(getattr(tok, "all_special_ids", []) or [])
    prompts = shared_prefix_prompts(
        llm.engine.model_config.vocab_size, special, num_requests, prefix_len, suffix_len, seed
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = llm.metrics()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    after = llm.metrics()

    def delta(key: str) -> float:
        return float(after[key] - before[key])

    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    read = delta("attention_kv_tokens_read_total")
    return {
        "requests": num_requests,
        "elapsed_s": elapsed,
        "output_tokens_per_s": gen / elapsed,
        "total_tokens_per_s": (gen + sum(len(p) for p in prompts)) / elapsed,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "prefix_cache_hit_rate": delta("prefix_cache_hit_tokens_total")
        / max(1.0, delta("prompt_tokens_total")),
        "kv_read_saving_x": delta("attention_kv_tokens_logical_total") / max(1.0, read),
        "cascade_steps": delta("cascade_steps_total"),
        "steps": delta("steps_total"),
    }
