"""Which block ids does a new document get once the pool has wrapped? (CPU, tiny model, block mechanics)

Replays ``serving_gpu``'s offline comparison (``benchmarks/serving_gpu/hydragen.py``: a warm-up and
three timed bursts of 256 chats after an 8K-token system prompt, then the same of 256 questions about
a new 16K-token document, over a 40,000-block pool) on the tiny dummy model: the allocations are the
GPU run's (same token counts, pool, chunking), only the arithmetic is tiny. For each burst it prints
the long allocations (16+ blocks) and how many runs of consecutive ids each got, the pool's scattered
allocation and eviction counters, and the run lengths of the document's cached blocks: the shared
segment the GPU kernels read with whole-tile TMA copies only when it is one run.

At 01d58b2 the fourth document (the third timed, which ran at 3.4K tok/s where the others ran at
7.3K) got its 1,024 blocks in 1,003 runs; with ``kv/placement.py`` it gets one (issue 55).

Run: PYTHONPATH=. python -m benchmarks.probes.pool_bursts [--bursts 4] [--output-scale 1.0]
(~6 min on a 2-core CPU; ``--output-scale 0.25`` shortens the answers, and the pool then never wraps)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.harness import TINY, dummy_model
from benchmarks.serving_gpu.workload import chat_requests, doc_requests, system_prompt
from prefixserve import LLM, SamplingParams
from prefixserve.kv import block_pool
from prefixserve.kv.cache_events import prompt_digests


def run_lengths(blocks: list[int]) -> list[int]:
    """Runs of consecutive ascending ids (kept here so the probe runs on checkouts without
    ``kv/fragmentation.py``)."""
    out, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            out.append(i - start)
            start = i
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=4, help="bursts of each kind (serving_gpu: 1 + 3 timed)")
    ap.add_argument("--output-scale", type=float, default=1.0, help="answer lengths, times serving_gpu's")
    ap.add_argument("--num-kv-blocks", type=int, default=40000)
    args = ap.parse_args()
    long_allocs: list[list[int]] = []
    allocate = block_pool.BlockPool.allocate

    def spy(self: block_pool.BlockPool, count: int) -> list[int]:
        got = allocate(self, count)
        if count >= 16:
            long_allocs.append(run_lengths(got))
        return got

    block_pool.BlockPool.allocate = spy  # type: ignore[method-assign]
    model = dummy_model(dict(TINY, max_position_embeddings=32768), Path(tempfile.mkdtemp()) / "tiny")
    llm = LLM(
        model=model,
        device="cpu",
        max_num_seqs=1024,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=2048,
        progress=False,
    )
    tok, pool = llm.get_tokenizer(), llm.engine.pool
    scale = args.output_scale
    sizes = argparse.Namespace(
        user_tokens=[64, 256],
        output_tokens=[int(128 * scale), int(512 * scale)],
        doc_tokens=16384,
        questions=256,
        question_tokens=32,
        gen=int(128 * scale),
    )
    system = system_prompt(tok, 8192, seed=8192)
    bursts = [
        ("chat", chat_requests(tok, system, 256, 7000 + r, sizes, None, logprobs=False, tag="b"))
        for r in range(args.bursts)
    ]
    bursts += [("document", doc_requests(tok, sizes, 8000 + r)) for r in range(args.bursts)]
    for kind, reqs in bursts:
        long_allocs.clear()
        scattered, evicted = pool.scattered_allocations, pool.evictions
        params = [
            SamplingParams(max_tokens=r["body"]["max_tokens"], temperature=0.0, ignore_eos=True) for r in reqs
        ]
        t0 = time.perf_counter()
        if kind == "chat":
            llm.chat([r["body"]["messages"] for r in reqs], params)
        else:
            llm.generate([r["body"]["prompt"] for r in reqs], params)
        line = (
            f"{kind:8s} {time.perf_counter() - t0:5.1f} s  long allocations {len(long_allocs)} "
            f"(in one run: {sum(len(r) == 1 for r in long_allocs)})  "
            f"scattered +{pool.scattered_allocations - scattered}  evicted +{pool.evictions - evicted}  "
            f"cached {pool.num_cached}"
        )
        if kind == "document":  # the shared document: the common prefix of two questions' token ids
            a, b = (tok.encode(r["body"]["prompt"]) for r in reqs[:2])
            common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            runs = run_lengths(pool.lookup(prompt_digests(a[: common + 1], pool.block_size)))
            more = "..." if len(runs) > 6 else ""
            line += f"  document: {sum(runs)} blocks in {len(runs)} runs {runs[:6]}{more}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
