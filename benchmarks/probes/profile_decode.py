"""cProfile of the engine's host side while it decodes a shared-prefix batch (where host time goes).

PYTHONPATH=. python -m benchmarks.probes.profile_decode --batch 256 --prefix 16384 --gen 32
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from benchmarks.throughput import _prompts
from prefixserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    llm = LLM(
        model="dummy:llama-3.1-8b",
        attention=args.attention,
        max_num_seqs=args.batch,
        max_num_batched_tokens=16384,
        progress=False,
    )
    params = SamplingParams(max_tokens=args.gen, ignore_eos=True)
    llm.generate(_prompts(args.batch, args.prefix, 64, seed=1), SamplingParams(max_tokens=3, ignore_eos=True))
    prompts = _prompts(args.batch, args.prefix, 64)
    # prefill outside the profile: admit the batch and run until every sequence has its first token
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"p{i}", params=params, prompt_token_ids=p["prompt_token_ids"])
    while llm.engine.counters["generation_tokens_total"] < 3 + args.batch * 3 + args.batch:
        llm.engine.step()
    prof = cProfile.Profile()
    prof.enable()
    while llm.engine.has_unfinished():
        llm.engine.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
