"""Host cost of the OpenAI server per streamed token, on the CPU, against the offline ``LLM`` API.

Question (issue: a burst of 256 streamed chats reaches ~3.4K tok/s through the server against ~7.2K
through ``LLM`` on an H200, the server process GIL-bound): how many CPU milliseconds does the server
spend per 1,000 streamed tokens, and on which thread: the asyncio/uvicorn main thread (SSE chunks,
JSON, ASGI, HTTP) or the engine thread (``Engine.step``, ``_deliver``)? The model is a tiny dummy
(2 layers, hidden 64) so that a step's forward costs little and host work dominates, as it does on
the GPU.

Per burst: ``--requests`` streamed chat requests at once (one shared system prompt, a short user turn
each, ``--output-tokens`` uniform in its range, greedy, ignore_eos), sent by ``--clients`` processes
of ``benchmarks.serving_client`` (the official ``openai`` client, async, usage chunk on). Measured:
wall time from the first send to the last end, generated tokens (from the usage chunks), and the CPU
seconds (utime + stime from /proc/PID/task/TID/stat) of the server's threads over the burst, split
into the main thread, the engine thread (named ``ps-engine`` for the OS) and the others (torch,
tokenizer workers), plus the client processes' CPU. The same requests then run through ``LLM.chat``
in this process (engine only: its CPU per 1K tokens is the floor of the server's engine thread).

Each ``--variant LABEL[=SERVER ARGS]`` starts its own server (``python -m prefixserve serve``); the
results are merged by label into docs/benchmarks/server_overhead.json (``--fresh`` starts it anew),
so a before/after table builds up over several runs. torch runs one thread (OMP_NUM_THREADS=1) in
the server and here, so that its workers do not spin on the few cores of a CPU box.

    python -m benchmarks.server_overhead                                  # default server, offline
    python -m benchmarks.server_overhead --variant h11="--http h11 --loop asyncio" --no-offline
    python -m benchmarks.server_overhead --requests 32 --no-write          # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, TINY, run_info, write_results
from benchmarks.harness.server import Clients, ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
NAME = "server_overhead"
ENGINE_THREAD = "ps-engine"  # serving.engine_thread.OS_THREAD_NAME
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The tokenizer's first ids only: the lm_head and the argmax over a 49152-token vocabulary cost more than
# the rest of a tiny model's step on the CPU (the GPU's forward is asynchronous, the CPU's is not), so
# prompts use words whose ids lie below this (the chat template's own ids do) and so do the samples.
VOCAB = 10240


# ---- CPU time per thread from /proc -------------------------------------------------------------
def _cpu_s(stat_path: Path) -> float:
    """utime + stime of one /proc stat file, in seconds (fields after the ``(comm)``)."""
    fields = stat_path.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads: main (tid == pid), engine (by its OS name), other."""
    out = {"main": 0.0, "engine": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu = _cpu_s(task / "stat")
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        key = "main" if int(task.name) == pid else "engine" if comm == ENGINE_THREAD else "other"
        out[key] += cpu
    return out


def process_cpu(pid: int) -> float:
    """CPU seconds of a whole process (its threads that ended included)."""
    return _cpu_s(Path(f"/proc/{pid}/stat"))


# ---- the workload ---------------------------------------------------------------------------------
def low_id_words(tok: Any, vocab: int) -> list[str]:
    """Words that the tokenizer encodes (after a space) as one id below ``vocab``."""
    words = []
    for i in range(vocab):
        piece = tok.decode([i])
        word = piece[1:]
        one_id = piece.startswith(" ") and word.isalpha() and len(word) > 2
        if one_id and tok.encode(piece, add_special_tokens=False) == [i]:
            words.append(word)
    return words


def make_requests(tok: Any, words: list[str], args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """``--requests`` chats after one shared system prompt, all due at once (a burst)."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    system = f"{seed}: {text(args.system_tokens)}"  # a word first would lose its space: other ids
    reqs = []
    for i in range(args.requests):
        body = {
            "model": "default",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{seed} {i}: {text(args.user_tokens)}"},
            ],
            "max_tokens": rng.randint(*args.output_tokens),
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        reqs.append({"i": i, "offset": 0.0, "kind": "chat", "stream": True, "logprobs": False, "body": body})
    return reqs


def check_ids(tok: Any, reqs: list[dict[str, Any]], vocab: int) -> None:
    """Every rendered prompt's ids fit the small vocabulary (else the embedding lookup fails)."""
    for r in reqs:
        ids = tok.apply_chat_template(r["body"]["messages"], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if max(ids) >= vocab:
            raise SystemExit(f"a prompt holds token id {max(ids)} >= the vocabulary of {vocab}")


# ---- the server ----------------------------------------------------------------------------------
class Server(ServerProcess):
    """The tiny model's server on the CPU (torch on one thread)."""

    def __init__(self, args: argparse.Namespace, model: str, extra: list[str], workdir: Path) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "prefixserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--model", model, "--device", "cpu", "--max-num-seqs", str(args.max_num_seqs)]
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks), *extra]
        super().__init__(cmd, workdir / f"server_{port}.log", "overhead", {"OMP_NUM_THREADS": "1"})

    def start(self, timeout: float = 120.0) -> Server:
        self.launch(timeout)
        return self

    def stop(self) -> None:
        self.terminate()


def server_burst(server: Server, clients: Clients, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """One burst through the server: throughput and CPU per 1K tokens of each thread and the clients."""
    assert server.proc is not None
    pid = server.proc.pid
    client_pids = [p.pid for p in clients.procs]
    before, clients_before = thread_cpu(pid), sum(process_cpu(p) for p in client_pids)
    whole_before = process_cpu(pid)
    run = clients.run(server.url, reqs, timeout=600.0)
    after, clients_after = thread_cpu(pid), sum(process_cpu(p) for p in client_pids)
    whole_after = process_cpu(pid)
    res = run["results"]
    ok = [r for r in res if r["error"] is None and r["end"] is not None]
    if len(ok) < len(res):
        raise RuntimeError(
            f"{len(res) - len(ok)} requests failed: {next(r['error'] for r in res if r['error'])}"
        )
    tokens = sum(r["tokens"] for r in ok)
    wall = max(r["end"] for r in ok) - min(r["sent"] for r in ok)
    per_k = 1000.0 / tokens
    cpu = {k: (after[k] - before[k]) * 1000 * per_k for k in before}  # ms per 1K tokens
    cpu["process"] = (whole_after - whole_before) * 1000 * per_k
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "chunks_per_request": statistics.mean(len(r["chunks"]) for r in ok),
        "cpu_ms_per_1k": cpu,
        "client_cpu_ms_per_1k": (clients_after - clients_before) * 1000 * per_k,
    }


def run_variant(
    args: argparse.Namespace, model: str, extra: list[str], bursts: list[list[dict[str, Any]]], workdir: Path
) -> dict[str, Any]:
    """Start a server, warm it (one burst, not kept), then time the other bursts."""
    server = Server(args, model, extra, workdir).start()
    clients = Clients(args.clients)
    try:
        server_burst(server, clients, bursts[0])
        runs = [server_burst(server, clients, b) for b in bursts[1:]]
    finally:
        clients.close()
        server.stop()
    for r in runs:
        print(
            f"  {r['tok_s']:.0f} tok/s, server {r['cpu_ms_per_1k']['process']:.0f} CPU ms/1K tok", flush=True
        )
    return {"server_args": " ".join(extra), "runs": runs, "median": median_run(runs)}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field, the median over the timed bursts."""
    out: dict[str, Any] = {}
    for key in ("tokens", "wall_s", "tok_s", "chunks_per_request", "client_cpu_ms_per_1k"):
        out[key] = statistics.median(r[key] for r in runs)
    out["cpu_ms_per_1k"] = {
        k: statistics.median(r["cpu_ms_per_1k"][k] for r in runs) for k in runs[0]["cpu_ms_per_1k"]
    }
    return out


# ---- the offline API -------------------------------------------------------------------------------
def offline(args: argparse.Namespace, model: str, bursts: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The same bursts through ``LLM.chat`` in this process: tokens/s and CPU ms per 1K tokens."""
    import torch

    from prefixserve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(
        model, device="cpu", max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, progress=False
    )
    runs = []
    try:
        for k, reqs in enumerate(bursts):
            params = [
                SamplingParams(max_tokens=r["body"]["max_tokens"], temperature=0.0, ignore_eos=True)
                for r in reqs
            ]
            cpu0, t0 = time.process_time(), time.perf_counter()
            outs = llm.chat([r["body"]["messages"] for r in reqs], params)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if k:  # the first burst warms up
                runs.append(
                    {
                        "tokens": tokens,
                        "wall_s": wall,
                        "tok_s": tokens / wall,
                        "cpu_ms_per_1k": cpu * 1e6 / tokens,
                    }
                )
                print(
                    f"  offline {tokens / wall:.0f} tok/s, {cpu * 1e6 / tokens:.0f} CPU ms/1K tok", flush=True
                )
    finally:
        llm.shutdown()
    return {
        "runs": runs,
        "median": {
            k: statistics.median(r[k] for r in runs) for k in ("tokens", "wall_s", "tok_s", "cpu_ms_per_1k")
        },
    }


# ---- report ----------------------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    s, run = result["settings"], result["run"]
    lines = [
        "# Server host cost per streamed token (CPU, tiny model)",
        "",
        f"Measured by `python -m benchmarks.server_overhead` ({run['device']}, {run['cpu_count']} cores, "
        f"Python {run['python']}, torch {run['torch']}, commit {run['commit']}, {run['date']}).",
        "",
        f"A burst of {s['requests']} streamed chat requests at once (shared system prompt of "
        f"~{s['system_tokens']} tokens, user turn ~{s['user_tokens']}, "
        f"{s['output_tokens'][0]}-{s['output_tokens'][1]} output tokens, "
        f"greedy, ignore_eos) from {s['clients']} `openai` client processes on the same host; dummy model "
        f"(2 layers, hidden 64, vocabulary {VOCAB}: prompts of words with low ids) on `--device cpu`, torch "
        "on one thread. Median of "
        f"{s['bursts']} bursts after a warm-up burst. CPU is ms per 1,000 streamed tokens (utime + stime "
        "over the burst): main = asyncio/uvicorn thread, engine = `ps-engine` thread, other = the "
        "server's other threads, clients = the load generator processes.",
        "",
        "| variant | commit | server args | tok/s | wall s | chunks/req | server CPU | main | engine | other "
        "| clients |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, v in result["variants"].items():
        m, c = v["median"], v["median"]["cpu_ms_per_1k"]
        lines.append(
            f"| {label} | {v.get('commit', '')} | `{v['server_args'] or '(default)'}` | {m['tok_s']:.0f} | "
            f"{m['wall_s']:.2f} | {m['chunks_per_request']:.0f} | {c['process']:.0f} | {c['main']:.0f} | "
            f"{c['engine']:.0f} | {c['other']:.0f} | {m['client_cpu_ms_per_1k']:.0f} |"
        )
    off = result.get("offline")
    if off:
        m = off["median"]
        lines += [
            "",
            f"Offline `LLM.chat`, same bursts, in-process (commit {off.get('commit', '')}): "
            f"{m['tok_s']:.0f} tok/s, {m['cpu_ms_per_1k']:.0f} CPU ms per 1K tokens.",
        ]
    if result.get("notes"):
        lines += ["", *result["notes"]]
    return "\n".join(lines) + "\n"


def load_previous(fresh: bool) -> dict[str, Any]:
    path = RESULTS / f"{NAME}.json"
    if fresh or not path.exists():
        return {}
    return json.loads(path.read_text())


def parse_variant(text: str) -> tuple[str, list[str]]:
    label, _, extra = text.partition("=")
    return label, shlex.split(extra)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--output-tokens", type=int, nargs=2, default=[128, 256])
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--bursts", type=int, default=2, help="timed bursts (after one warm-up burst)")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=8192)
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="LABEL[=ARGS]",
        help="a server to run (repeatable)",
    )
    p.add_argument("--no-offline", action="store_true", help="skip the offline LLM runs")
    p.add_argument("--fresh", action="store_true", help="do not merge into the existing JSON")
    p.add_argument("--no-write", action="store_true", help="print, write nothing under docs/")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="server_overhead_"))
    cfg = workdir / "config.json"
    cfg.write_text(json.dumps({**TINY, "vocab_size": VOCAB}))
    model = f"dummy:{cfg}"

    from prefixserve.model.loader import tokenizer_for

    _, tok = tokenizer_for(model, progress=False)
    if tok is None:
        raise SystemExit("no tokenizer for the dummy model: the benchmark needs the default model's")
    words = low_id_words(tok, VOCAB)
    bursts = [make_requests(tok, words, args, seed) for seed in range(args.bursts + 1)]
    for reqs in bursts:
        check_ids(tok, reqs, VOCAB)
    info = run_info()
    result = load_previous(args.fresh or args.no_write)
    settings = {
        k: v for k, v in vars(args).items() if k not in ("variant", "fresh", "no_write", "note", "no_offline")
    }
    result.update(benchmark=NAME, run=info, settings=settings)
    result.setdefault("variants", {})
    result["notes"] = args.note or result.get("notes", [])
    for label, extra in map(parse_variant, args.variant or ["default"]):
        print(f"[{label}] server {' '.join(extra) or '(default)'}", flush=True)
        result["variants"][label] = {
            **run_variant(args, model, extra, bursts, workdir),
            "commit": info["commit"],
        }
    if not args.no_offline:
        result["offline"] = {**offline(args, model, bursts), "commit": info["commit"]}
    if args.no_write:
        print(markdown(result))
    else:
        write_results(NAME, result, markdown(result))


if __name__ == "__main__":
    main()
