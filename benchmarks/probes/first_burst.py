"""Does the first burst after start-up meet graph captures? Captures and wall time per burst, with and
without the start-up capture pass (``Engine.capture_graphs``, which a server runs before /health).

An engine with a pinned system prompt (issue 52's case: 8K tokens) serves bursts of chats behind it,
of varied batch sizes and own lengths; each burst reports the decode-graph and piece captures it
met and its wall time. Run it twice, once with ``--no-warmup``, in separate processes.

PYTHONPATH=. python -m benchmarks.probes.first_burst --model dummy:llama-3.1-8b [--no-warmup]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from prefixserve import LLM, SamplingParams


def _captures(llm: LLM) -> int:
    return int(llm.metrics()["cuda_graph_captures_total"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--system-tokens", type=int, default=8192)
    ap.add_argument("--bursts", type=int, nargs="+", default=[48, 16, 96, 33, 128])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    system = " ".join(rng.choice(words) for _ in range(args.system_tokens))
    started = time.perf_counter()
    llm = LLM(
        model=args.model, dtype="bfloat16", device="cuda", max_num_seqs=args.max_num_seqs,
        system_prompts={"app": system}, progress=False,
    )  # fmt: skip
    loaded = time.perf_counter() - started
    warm_s = 0.0
    if not args.no_warmup:
        t0 = time.perf_counter()
        llm.engine.capture_graphs(progress=True)
        warm_s = time.perf_counter() - t0
    rows = []
    for n in args.bursts:
        convs = [
            [{"role": "system", "content": system},
             {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(8, 200)))}]
            for _ in range(n)
        ]  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(32, 96), ignore_eos=True)
        before, t0 = _captures(llm), time.perf_counter()
        llm.chat(convs, params)
        rows.append({"requests": n, "captures": _captures(llm) - before, "seconds": time.perf_counter() - t0})
        print(rows[-1], flush=True)
    result = {"warmup": not args.no_warmup, "load_s": loaded, "warmup_s": warm_s, "bursts": rows}
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"warm-up {'off' if args.no_warmup else f'{warm_s:.1f} s'}: captures per burst "
        f"{[r['captures'] for r in rows]}, seconds {[round(r['seconds'], 2) for r in rows]}"
    )


if __name__ == "__main__":
    main()
