"""Embeddings on the GPU path (Triton attention, CUDA graphs, launch-ahead) against the same inputs
computed with nothing shared, in float32: "last" and "mean" pooling, a first pass (each document's
blocks computed once, the chunks behind it) and a second pass (every prompt cached but its last
token, so the last rows run in decode-sized, graphed steps).

    python -m benchmarks.probes.embeddings_check --json $OUT/embeddings_check.json
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import run_info
from benchmarks.harness.models import TINY, dummy_model
from benchmarks.harness.output import write_or_print
from prefixserve import LLM, PoolingParams


def _inputs(salt: str | None, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for d, doc_len in enumerate((5, 16, 100, 333)):
        doc = [rng.randrange(100, 20000) for _ in range(doc_len)]
        for c, tail in enumerate((1, 7, 40)):
            item: dict[str, Any] = {
                "prompt_token_ids": doc + [rng.randrange(100, 20000) for _ in range(tail)]
            }
            if salt is not None:
                item["cache_salt"] = f"{salt}-{d}-{c}"
            out.append(item)
    return out


def _vectors(llm: LLM, inputs: list[dict[str, Any]], pooling: str) -> tuple[torch.Tensor, int]:
    outs = llm.embed(inputs, PoolingParams(pooling=pooling, normalize=False))
    return torch.tensor([o.outputs.embedding for o in outs]), sum(o.num_cached_tokens for o in outs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = dummy_model({**TINY, "hidden_size": 256, "num_attention_heads": 4}, Path(tmp))
        llm = LLM(model=model, device="cuda", dtype="float32", num_kv_blocks=2048, progress=False)
        for pooling in ("last", "mean"):
            want, _ = _vectors(llm, _inputs(f"alone-{pooling}"), pooling)
            for name in ("first pass", "second pass"):
                got, cached = _vectors(llm, _inputs(None), pooling)
                err = (got - want).abs().max().item() / want.abs().max().item()
                rows.append({"pooling": pooling, "pass": name, "cached_tokens": cached, "max_rel_err": err})
        llm.shutdown()
    ok = all(r["max_rel_err"] < 1e-4 for r in rows) and all(r["cached_tokens"] > 0 for r in rows)
    lines = ["| pooling | pass | cached tokens | max rel. error vs unshared |", "| --- | --- | ---: | ---: |"]
    lines += [
        f"| {r['pooling']} | {r['pass']} | {r['cached_tokens']} | {r['max_rel_err']:.2e} |" for r in rows
    ]
    text = "\n".join(["# Embeddings on the GPU path: shared against unshared, float32", "", *lines, ""])
    text += f"\n{'PASS' if ok else 'FAIL'}\n"
    write_or_print(args.json, {"info": run_info(), "rows": rows, "pass": ok}, text)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
