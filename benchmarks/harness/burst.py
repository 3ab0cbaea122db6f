"""A model served by ``prefixserve serve`` and timed on a burst of concurrent completions: what a user
starting the server on one GPU meets (start-up seconds, then tokens/s of B requests at once).

Shared by the MoE benchmark (its families beside each other) and the FP8 fit benchmark (the 70B shape
with FP8 weights on one GPU)."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.harness.server import ServerProcess, http_get, serve_command


def burst(url: str, batch: int, prompt_len: int, gen: int, seed: int) -> tuple[float, int]:
    """``batch`` concurrent /v1/completions requests; (wall seconds, completion tokens)."""
    rng = random.Random(seed)
    served = json.loads(http_get(url + "/v1/models")[1])["data"][0]["id"]

    def one(i: int) -> int:
        body = {"model": served, "prompt": [rng.randrange(100, 30000) for _ in range(prompt_len)]}
        body |= {"max_tokens": gen, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as resp:
            return int(json.load(resp)["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        tokens = sum(pool.map(one, range(batch)))
    return time.perf_counter() - t0, tokens


def served_burst(
    model: str,
    batch: int,
    prompt_len: int,
    gen: int,
    log: Path,
    server_args: tuple[str, ...] = (),
    num_kv_blocks: int = 4096,
) -> dict[str, Any]:
    """``model`` served on the GPU (``server_args`` beside the pool sizes), an untimed burst (compiles,
    graph captures), then a timed one: start seconds and tokens/s, or the error of a model that does
    not serve (its reason goes into the table)."""
    opts = SimpleNamespace(
        model=model, device="cuda", max_num_seqs=batch, num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=8192, server_arg=list(server_args),
    )  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(serve_command(opts), log, model)
    row: dict[str, Any] = {"model": model, "B": batch, "server_args": list(server_args)}
    try:
        row["start_s"] = server.launch(timeout=600)
        burst(server.url, batch, prompt_len, gen, seed=1)
        wall, tokens = burst(server.url, batch, prompt_len, gen, seed=2)
        row |= {"wall_s": wall, "completion_tokens": tokens, "tok_s": tokens / wall}
    except Exception as exc:
        row["error"] = repr(exc)[-300:]
    finally:
        server.terminate()
    print(row, flush=True)
    return row
