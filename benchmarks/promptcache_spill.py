"""The Prompt Cache benchmark's prefix spill section (``benchmarks/promptcache.py --spill-docs``): documents
asked about in turn through a pool a third of their size, the prefix cache's host tier off and on."""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.promptcache_workload import words
from prefixserve import LLM, SamplingParams


def pinned_allocs() -> tuple[int, float] | None:
    """``cudaHostAlloc`` calls so far by PyTorch's caching host allocator and their seconds (None
    off CUDA)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("num_host_alloc", 0)), 1e-6 * float(stats.get("host_alloc_time.total", 0))


def run_spill(args: argparse.Namespace, make_llm: Callable[..., LLM]) -> dict[str, Any]:
    """The prefix cache's host tier: ``--spill-docs`` documents asked about in turn, a pool that holds
    about a third of them; prefix hit rate and wall time with and without ``spill_prefix_cache``.

    The host tier is the engine's (``module_host_bytes``, 4 GiB by default: 2,048 blocks of an 8B
    model, two thirds of 24 2K-token documents), so pool and host tier together hold every document
    and rounds 2 and 3 can hit throughout: the best hit rate is 2/3. The spill's pinned slots are
    allocated when the engine starts; the timed rounds count the pinned allocations they make."""
    out: dict[str, Any] = {"docs": args.spill_docs, "doc_tokens": args.spill_doc_tokens, "rounds": 3}
    for spill in (False, True):
        blocks = args.spill_docs * args.spill_doc_tokens // 16 // 3 + 8
        llm = make_llm(args, num_kv_blocks=blocks, spill_prefix_cache=spill)
        rng = random.Random(args.seed + 5)
        docs = [words(rng, llm.get_tokenizer(), args.spill_doc_tokens) for _ in range(args.spill_docs)]
        sp = llm.engine.spill
        allocs = pinned_allocs()
        t0 = time.perf_counter()
        for r in range(out["rounds"]):
            for doc in docs:
                llm.generate(doc + f" Question {r}: what came first?", SamplingParams(max_tokens=1))
        m = llm.metrics()
        tag = "spill" if spill else "no_spill"
        out[f"{tag}_s"] = time.perf_counter() - t0
        out[f"{tag}_hit_rate"] = m["prefix_cache_hit_tokens_total"] / m["prompt_tokens_total"]
        out[f"{tag}_host_hit_tokens"] = m["prefix_cache_host_hit_tokens_total"]
        out[f"{tag}_spilled_blocks"] = m.get("prefix_cache_spilled_blocks_total", 0)
        after = pinned_allocs()
        if allocs is not None and after is not None:
            out[f"{tag}_pinned_allocs"] = after[0] - allocs[0]
            out[f"{tag}_pinned_alloc_s"] = after[1] - allocs[1]
        if sp is not None:
            out["host_capacity_bytes"] = llm.engine.modules.host.capacity_bytes
            out["host_capacity_blocks"] = sp.host_capacity_blocks
            out["spill_restored_blocks"] = sp.restored_blocks
            out["spill_slabs"] = sp.slots.allocations  # pinned buffers of the spill, made at start
            out["spill_best_hit_rate"] = best_hit_rate(out, blocks, sp.host_capacity_blocks)
        out["kv_blocks"] = blocks
        print(json.dumps(out))
        del llm
        gc.collect()
    return out


def best_hit_rate(out: dict[str, Any], kv_blocks: int, host_blocks: int) -> float:
    """The hit rate a perfect two-tier LRU would reach: every revisit hits if pool and host tier hold
    all the documents' blocks, none (cyclic order) if they do not."""
    need = out["docs"] * (out["doc_tokens"] // 16)
    return (out["rounds"] - 1) / out["rounds"] if kv_blocks + host_blocks >= need else 0.0


def spill_lines(sp: dict[str, Any]) -> list[str]:
    """The report's spill table and the host tier's line."""
    lines = [
        "",
        f"The prefix cache's host tier: {sp['docs']} documents of {sp['doc_tokens']} tokens asked about "
        f"in turn, {sp['rounds']} rounds, a pool of {sp['kv_blocks']} blocks (about a third of them):",
        "",
        "| | prefix-cache hit rate | host hits (tokens) | wall s |",
        "| --- | ---: | ---: | ---: |",
        f"| evicted blocks dropped | {sp['no_spill_hit_rate']:.1%} | 0 | {sp['no_spill_s']:.2f} |",
        f"| evicted blocks spilled to host | {sp['spill_hit_rate']:.1%} | {sp['spill_host_hit_tokens']} "
        f"| {sp['spill_s']:.2f} |",
    ]
    if "host_capacity_blocks" in sp:
        allocs = sp.get("spill_pinned_allocs")
        took = f" ({sp['spill_pinned_alloc_s']:.3f} s)" if allocs is not None else ""
        lines += [
            "",
            f"Host tier: {sp['host_capacity_bytes'] / 2**30:.1f} GiB, {sp['host_capacity_blocks']} "
            f"blocks; with the pool's {sp['kv_blocks']}, against the documents' "
            f"{sp['docs'] * (sp['doc_tokens'] // 16)}: best hit rate {sp['spill_best_hit_rate']:.1%}; "
            f"{sp['spill_spilled_blocks']} blocks spilled, {sp['spill_restored_blocks']} restored; "
            f"{sp['spill_slabs']} slabs of the spill's slots (pinned when the engine starts on CUDA), "
            f"{'-' if allocs is None else allocs} pinned allocations{took} during the timed rounds.",
        ]
    return lines
