"""Soak: one server, hundreds of bursts of chats and documents, the KV pool wrapping many times.

Benchmarks start every engine fresh; users don't. In ``serving_gpu.json``'s runs the offline API's third
burst of questions over a new 16K-token document ran at half the first's speed: by then every free
block of the pool was cached, and the pool handed the new document scattered block ids, so the
shared-segment kernels lost their whole-tile reads (issue 55; ``kv/placement.py``). This script checks
that a long-running server stays as fast, as small and as clean as a fresh one:

- one ``prefixserve serve`` (started as a user starts it), driven by ``benchmarks.serving_client``
  processes, bursts alternating: **chats** (``--chats`` at once after one of ``--system-prompts``
  system prompts, taken in turn, so they are cached, reused and evicted) and **documents** (a new
  ``--doc-tokens`` document each time, ``--questions`` questions about it at once);
- per burst: tokens/s (generated tokens / first send to last answer), the server's resident memory
  (its process and children, from /proc; also by process, and anonymous / file-backed), the engine's
  CUDA memory (allocated, reserved: /metrics), blocks in use and the free space's fragmentation
  (sampled from /metrics during the burst), and the burst's scattered allocations, evicted blocks and
  preemptions (/metrics counters);
- at the end: blocks still held by nobody's request (leaked) and the verdicts on the targets
  (``benchmarks/soak_report.py``): the last bursts' tokens/s >= 0.95 of the first's for chats and
  for documents, resident and CUDA memory flat after warm-up (< 1% growth), zero leaked blocks.

Host memory that grows and then stops (bounded, so "flat after warm-up" holds only once it is full;
measured with ``--device cpu`` and the engine in its own process, 20,000 blocks, 128-request bursts,
3.5K-token documents, on a 2-core VM; the Python heaps of both processes stayed flat in tracemalloc):

- the CPU KV pool's pages, resident as blocks are first written (``kv/cache.py``'s ``pool_zeros``),
  until the whole pool has been written (it wrapped); a GPU pool is device memory;
- the CPU engine's oneDNN primitive caches (ideep's ``LRU_CACHE_CAPACITY``, oneDNN's
  ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1,024 entries each): a matmul primitive per row count a step
  had, ~160 KB each for the tiny model: the engine's malloc in-use bytes grew 145 -> 555 MiB over 60
  bursts, 109 -> 115 MiB over 36 with both capacities at 16 (bursts 4.5x slower); a GPU engine has none;
- free heap glibc keeps after a burst (per thread arena): given back once the process is idle
  (``serving/host_trim.py``; the HTTP process: median 355 -> 330 MiB over the same 30 bursts).

Usage (GPU; the defaults, sized for the 8B dummy model on one H100, take ~7 min, start-up included):
    PYTHONPATH=. python -m benchmarks.soak run
    python -m benchmarks.soak report --json docs/benchmarks/soak.json
Tiny CPU run (a check that every part works; writes soak_cpu.*, into a temp dir unless --out):
    PYTHONPATH=. python -m benchmarks.soak run --device cpu
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, TINY, dummy_model, run_info, run_or_report
from benchmarks.harness.server import (
    Clients,
    ServerProcess,
    apply_cpu_defaults,
    scrape,
    serve_command,
    wait_idle,
)
from benchmarks.serving_gpu.workload import chat_requests, doc_requests, system_prompt
from benchmarks.soak_report import report

# what --device cpu changes (explicit options still win): the tiny model, sizes that run in ~2 min
CPU = dict(
    bursts=24,
    warmup=2,
    window=4,
    chats=8,
    system_tokens=128,
    system_prompts=2,
    user_tokens=[8, 24],
    output_tokens=[4, 8],
    doc_tokens=768,
    questions=8,
    question_tokens=8,
    gen=6,
    num_kv_blocks=320,
    max_num_seqs=64,
    max_num_batched_tokens=256,
    clients=1,
    sample_s=0.05,
)
# /metrics counters whose change over a burst is recorded (names as ``scrape`` gives them)
COUNTERS = {
    "scattered_allocations": "kv_scattered_allocations_total",
    "run_evicted_blocks": "kv_run_evicted_blocks_total",
    "evicted_blocks": "prefix_cache_evicted_blocks_total",
    "preemptions": "preemptions_total",
    "prompt_tokens_computed": "prompt_tokens_computed_total",
    "prefix_cache_hit_tokens": "prefix_cache_hit_tokens_total",
    "generation_tokens": "generation_tokens_total",
}


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--model", default=None, help="default: dummy:llama-3.1-8b (cuda), the tiny model (cpu)")
    r.add_argument("--name", default=None, help="result file name (default soak, soak_cpu on the CPU)")
    r.add_argument("--bursts", type=int, default=200, help="bursts in all, chats and documents in turn")
    r.add_argument("--warmup", type=int, default=2, help="first bursts of each kind not judged (compiles)")
    r.add_argument(
        "--window",
        type=int,
        default=6,
        help="bursts of a kind whose median is 'first' / 'last' (the first ones run before the pool wraps)",
    )
    r.add_argument("--chats", type=int, default=128, help="chats in a chat burst")
    r.add_argument("--system-tokens", type=int, default=2048)
    r.add_argument("--system-prompts", type=int, default=4, help="distinct system prompts, taken in turn")
    r.add_argument("--user-tokens", type=int, nargs=2, default=[32, 128])
    r.add_argument("--output-tokens", type=int, nargs=2, default=[32, 64], help="a chat's answer")
    r.add_argument("--doc-tokens", type=int, default=8192)
    r.add_argument("--questions", type=int, default=128, help="questions in a document burst")
    r.add_argument("--question-tokens", type=int, default=32)
    r.add_argument("--gen", type=int, default=32, help="tokens of a question's answer")
    r.add_argument(
        "--num-kv-blocks", type=int, default=20000, help="the pool (a burst fills ~1/17 of it: ~12 turnovers)"
    )
    r.add_argument("--max-num-seqs", type=int, default=256)
    r.add_argument("--max-num-batched-tokens", type=int, default=2048)
    r.add_argument("--clients", type=int, default=4, help="load generator processes")
    r.add_argument("--sample-s", type=float, default=0.2, help="/metrics sampling period during a burst")
    r.add_argument("--burst-timeout", type=float, default=180.0)
    r.add_argument("--server-timeout", type=float, default=600.0)
    r.add_argument("--server-arg", action="append", default=[], help="one more argument for the server")


MEMORY_FIELDS = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}


def tree_memory(pid: int) -> dict[str, int]:
    """Resident bytes of a process and all its descendants (the server and its engine process):
    ``rss`` in all, ``server`` (the process itself) and ``children``, and by kind over the tree:
    ``anon`` (heaps, Python objects, pinned buffers), ``file`` (mapped libraries and files as paged in)
    and ``shmem``. Which side grows, and how, says where to look."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total = dict.fromkeys(("rss", "server", "children", *MEMORY_FIELDS.values()), 0)
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            key = MEMORY_FIELDS.get(parts[0]) if parts else None
            if key:
                total[key] += int(parts[1]) * 1024
                if key == "rss":
                    total["server" if p == pid else "children"] += int(parts[1]) * 1024
    return total


class Sampler(threading.Thread):
    """Scrapes /metrics every ``period`` seconds while a burst runs: peak blocks in use, the worst
    free-space fragmentation and the shortest longest-free-run seen."""

    def __init__(self, url: str, period: float) -> None:
        super().__init__(daemon=True)
        self.url, self.period = url, period
        self.stop = threading.Event()
        self.peak_used = 0.0
        self.max_fragmentation = 0.0
        self.min_longest_run: float | None = None

    def run(self) -> None:
        while not self.stop.wait(self.period):
            m = scrape(self.url)
            if not m:
                continue
            self.peak_used = max(self.peak_used, m.get("kv_blocks_used", 0.0))
            self.max_fragmentation = max(self.max_fragmentation, m.get("kv_free_fragmentation", 0.0))
            longest = m.get("kv_longest_free_run")
            if longest is not None:
                self.min_longest_run = min(longest, self.min_longest_run or longest)


def burst_requests(args: argparse.Namespace, tok: Any, systems: list[str], i: int) -> list[dict[str, Any]]:
    """Burst ``i``: chats after system prompt ``i // 2 % S`` (even i), or a new document (odd i)."""
    if i % 2 == 0:
        system = systems[(i // 2) % len(systems)]
        return chat_requests(tok, system, args.chats, 10_000 + i, args, None, logprobs=False, tag="s")
    return doc_requests(tok, args, 20_000 + i)


def run_burst(
    args: argparse.Namespace, server: ServerProcess, clients: Clients, reqs: list[dict[str, Any]]
) -> dict[str, Any]:
    """One burst through the clients, with /metrics sampled beside it and read before and after."""
    before = wait_idle(server.url)
    sampler = Sampler(server.url, args.sample_s)
    sampler.start()
    try:
        res = clients.run(server.url, reqs, args.burst_timeout, lead=0.2)["results"]
    finally:
        sampler.stop.set()
        sampler.join()
    after = wait_idle(server.url)
    ok = [r for r in res if r["error"] is None and r["end"] is not None]
    span = max((r["end"] for r in ok), default=0.0) - min((r["sent"] for r in ok), default=0.0)
    tokens = sum(r["tokens"] for r in ok)
    out: dict[str, Any] = {
        "requests": len(res),
        "errors": len(res) - len(ok),
        "error_sample": next((r["error"] for r in res if r["error"] is not None), None),
        "generated_tokens": tokens,
        "time_s": span,
        "tok_s": tokens / span if span > 0 else 0.0,
        "blocks_used_peak": max(sampler.peak_used, after.get("kv_blocks_used", 0.0)),
        "blocks_used_after": after.get("kv_blocks_used"),
        "free_fragmentation_max": sampler.max_fragmentation,
        "longest_free_run_min": sampler.min_longest_run,
        "gpu_allocated_bytes": after.get("gpu_memory_allocated_bytes"),
        "gpu_reserved_bytes": after.get("gpu_memory_reserved_bytes"),
    }
    memory = tree_memory(server.proc.pid) if server.proc else {}
    out["rss_bytes"] = memory.get("rss")
    out["memory"] = memory
    for key, name in COUNTERS.items():
        out[key] = after.get(name, 0.0) - before.get(name, 0.0)
    return out


def run(args: argparse.Namespace) -> None:
    apply_cpu_defaults(args, sys.argv[1:], CPU)
    tmp = Path(tempfile.mkdtemp(prefix="soak_"))
    if args.model is None:
        args.model = "dummy:llama-3.1-8b" if args.device == "cuda" else dummy_model(TINY, tmp / "tiny")
    name = args.name or ("soak" if args.device == "cuda" else "soak_cpu")
    out_dir = Path(args.out) if args.device == "cuda" or args.out != str(RESULTS) else tmp / "out"
    from prefixserve.model.loader import tokenizer_for

    model_name, tok = tokenizer_for(args.model, progress=False)
    rng = random.Random(55)
    systems = [
        system_prompt(tok, args.system_tokens, rng.randrange(10**6)) for _ in range(args.system_prompts)
    ]
    server = ServerProcess(serve_command(args), tmp / "server.log", "soak")
    result: dict[str, Any] = {
        "benchmark": name,
        "run": run_info(("openai",)),
        "model_name": model_name,
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "mode"},
            "name": name,
            "out": str(out_dir),
        },
        "bursts": [],
    }
    clients = Clients(args.clients)
    t0 = time.monotonic()
    try:
        result["server_start_s"] = server.launch(args.server_timeout)
        first = scrape(server.url)
        result["kv_blocks_total"] = first.get("kv_blocks_total")
        result["kv_blocks_used_idle"] = first.get("kv_blocks_used")
        for i in range(args.bursts):
            reqs = burst_requests(args, tok, systems, i)
            b = run_burst(args, server, clients, reqs)
            b.update(i=i, kind="chat" if i % 2 == 0 else "document", elapsed_s=time.monotonic() - t0)
            b["warm"] = i // 2 < args.warmup
            result["bursts"].append(b)
            print(
                f"[{i:4d} {b['kind']:8s}] {b['tok_s']:8.0f} tok/s  peak {b['blocks_used_peak']:6.0f} blocks  "
                f"frag {b['free_fragmentation_max']:.2f}  scattered {b['scattered_allocations']:.0f}  "
                f"evicted {b['evicted_blocks']:.0f}  rss {(b['rss_bytes'] or 0) / 2**20:.0f} MiB  "
                f"errors {b['errors']}",
                flush=True,
            )
        end = wait_idle(server.url)
        result["end"] = {k: v for k, v in end.items() if k.startswith(("kv_", "gpu_", "num_"))}
    finally:
        clients.close()
        result["exit_code"] = server.terminate()
        result["server_log_tail"] = server.log_tail(20)
    result["wall_s"] = time.monotonic() - t0
    report(result, out_dir)


def main() -> None:
    run_or_report(__doc__, "soak", RESULTS, add_run_args, run, report)


if __name__ == "__main__":
    main()
