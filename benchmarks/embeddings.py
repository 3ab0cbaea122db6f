"""Embeddings of passages that share a context: the prefix computed once against computed for each.

The workload is contextual retrieval: each chunk of a document is embedded with the whole document in
front of it (the document, then the chunk, pooled at the chunk's last token), so a retriever's
vectors know what the chunk is about. D documents of P tokens, C chunks of K tokens each, through
``LLM.embed`` ("last" pooling, normalized) in one call per mode:

* ``shared``: as the engine runs it: the chunks of a document share its blocks, so each document is
  computed once;
* ``unshared``: every input with a ``cache_salt`` of its own, so nothing is shared and every input
  computes its whole prompt (what an engine without prefix caching for embeddings does).

Both modes run on one engine (the same kernels and graphs) after an untimed warm-up of salted inputs.
Reported: seconds, inputs/s, prompt tokens and the share served from the prefix cache, the ratio,
the ratio of tokens computed (the bound the speed-up approaches where prefill dominates), and the
lowest cosine similarity between a chunk's vectors in the two modes (1.0 in float32).

    python -m benchmarks.embeddings --device cpu
    python -m benchmarks.embeddings --device cuda --model dummy:llama-3.1-8b --docs 32 --doc-tokens 2000 \
        --chunks 16 --chunk-tokens 64 --num-kv-blocks 8000

Writes docs/benchmarks/embeddings_{cpu,gpu}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from benchmarks.harness import RESULTS, bar_chart, run_info, write_results
from prefixserve import LLM, PoolingParams


def _inputs(args: argparse.Namespace, salt: str | None) -> list[dict[str, Any]]:
    rng = random.Random(0)
    docs = [[rng.randrange(100, 20000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    inputs = []
    for d, doc in enumerate(docs):
        for c in range(args.chunks):
            chunk = [rng.randrange(100, 20000) for _ in range(args.chunk_tokens)]
            item: dict[str, Any] = {"prompt_token_ids": doc + chunk}
            if salt is not None:
                item["cache_salt"] = f"{salt}-{d}-{c}"
            inputs.append(item)
    return inputs


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run(llm: LLM, inputs: list[dict[str, Any]]) -> tuple[dict[str, Any], torch.Tensor]:
    _sync()
    t0 = time.perf_counter()
    outs = llm.embed(inputs, PoolingParams())
    _sync()
    seconds = time.perf_counter() - t0
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    row = {
        "seconds": seconds,
        "inputs": len(outs),
        "inputs_per_s": len(outs) / seconds,
        "prompt_tokens": prompt,
        "computed_tokens": prompt - cached,
        "cached_share": cached / prompt,
    }
    return row, torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float64)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(
        model=args.model, device=args.device, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, progress=False,
    )  # fmt: skip
    warm = _inputs(args, "warm")[: max(1, args.max_num_seqs)]
    llm.embed(warm)  # kernels, graphs and allocations: untimed
    results: dict[str, dict[str, Any]] = {}
    vectors = {}
    for mode, salt in (("unshared", "each"), ("shared", None)):
        results[mode], vectors[mode] = _run(llm, _inputs(args, salt))
        print(mode, results[mode])
    cosine = (vectors["shared"] * vectors["unshared"]).sum(-1)  # both normalized
    llm.shutdown()
    return {
        "info": run_info(("transformers",)),
        "settings": vars(args),
        "results": results,
        "speedup": results["unshared"]["seconds"] / results["shared"]["seconds"],
        "computed_ratio": results["unshared"]["computed_tokens"] / results["shared"]["computed_tokens"],
        "min_cosine": float(cosine.min()),
    }


def markdown(result: dict[str, Any], name: str) -> str:
    s, info, r = result["settings"], result["info"], result["results"]
    lines = [
        f"# Embeddings of chunks in their document's context ({s['device']})",
        "",
        f"`python -m benchmarks.embeddings --device {s['device']} --model {s['model']} --docs {s['docs']} "
        f"--doc-tokens {s['doc_tokens']} --chunks {s['chunks']} --chunk-tokens {s['chunk_tokens']} "
        f"--num-kv-blocks {s['num_kv_blocks']} --max-num-seqs {s['max_num_seqs']} "
        f"--max-num-batched-tokens {s['max_num_batched_tokens']}`: {s['docs']} documents of "
        f"{s['doc_tokens']} tokens, {s['chunks']} chunks of {s['chunk_tokens']} tokens each, every chunk "
        f"embedded behind its whole document (`LLM.embed`, last-token pooling, {s['dtype']}), one engine, "
        "both modes after an untimed warm-up.",
        "",
        "| mode | seconds | inputs/s | prompt tokens | computed | from the prefix cache |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, row in r.items():
        lines.append(
            f"| {mode} | {row['seconds']:.2f} | {row['inputs_per_s']:.1f} | {row['prompt_tokens']:,} | "
            f"{row['computed_tokens']:,} | {row['cached_share']:.1%} |"
        )
    lines += [
        "",
        f"Sharing each document's blocks embeds the chunks **{result['speedup']:.2f}x** faster than "
        f"computing every prompt whole; it computes {result['computed_ratio']:.2f}x fewer tokens, the bound "
        "where prefill is all the work. The lowest cosine similarity between a chunk's two vectors is "
        f"{result['min_cosine']:.6f}.",
        "",
        f"Device: {info['device']} ({info['cpu_count']} CPUs); torch {info['torch']}, "
        f"commit {info['commit']}, {info['date']}.",
        "",
        f"![seconds]({name}.png)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--num-kv-blocks", type=int, default=1024, help="the KV pool (16-token blocks)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--name", default=None, help="result file name (default embeddings_cpu / embeddings_gpu)")
    args = ap.parse_args(argv)
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    name = args.name or ("embeddings_cpu" if args.device == "cpu" else "embeddings_gpu")
    result = measure(args)
    args.model = args.model or "default"
    write_results(name, result, markdown(result, name))
    title = f"{args.docs} docs x {args.chunks} chunks, {args.device}"
    bar_chart(RESULTS / f"{name}.png", result["results"], "seconds", "seconds", title, ["#888888", "#3b7dd8"])


if __name__ == "__main__":
    main()
