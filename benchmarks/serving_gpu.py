"""Serving on the GPU through the real server path (``benchmarks/serving.py --device cuda``).

RelayAttention's and Hydragen's end-to-end experiments, run against ``python -m prefixserve serve``
started as a subprocess the way a user starts it, loaded by the official ``openai`` client (streaming)
from a few client processes on the same host (``benchmarks/serving_client.py``).

Part ``rate`` (RelayAttention Fig. 5/6): a pinned system prompt of 2K and of 8K tokens, user turns of
64-256 tokens, outputs of 128-512 tokens (EOS ignored, greedy), Poisson arrivals at doubling rates
until the mean normalised latency (end-to-end seconds / generated tokens) passes the SLO (0.1 s/token).
Each rate point gets the same requests and arrival times for every configuration. Configurations:

* ``on``: ``--attention auto``, prefix cache on, both system prompts pinned (``--system-prompt``);
* ``off``: ``--attention triton_paged`` (the plain per-sequence paged kernel; ``reference`` on a CPU)
  and ``--no-prefix-caching``: every request computes its system prompt and attends it alone;
* ``pinned`` (optional): the plain kernel with the prompts pinned (vLLM with the system prompt's KV
  stored once): only the attention differs from ``on``.

Part ``hydragen``: one 16K-token document and 256 questions sent at once; 16 problems after a 2K-token
few-shot prefix, n=64 samples each (the completions API's ``n``); time to all answers and generated
tokens/s with the document's KV stored once (prefix cache on) for ``on`` (``auto``), ``off``
(``triton_paged``) and the no-attention ceiling (``--attention none``), each its own server. Then
the offline ``LLM`` API against the ``on`` server on the same bursts with the same engine settings
(a 256-chat burst with the 8K system prompt, and the document's 256 questions).

``--part report --merge A.json B.json`` writes the report of earlier runs merged (no device needed).
``--smoke`` runs every code path on the CPU with a tiny dummy model and tiny sizes (into a temp dir).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAME = "serving_gpu"
SECTIONS = ("rate", "offline_vs_server", "hydragen")

WORDS = [
    "bike",
    "wheel",
    "chain",
    "gear",
    "brake",
    "saddle",
    "pedal",
    "frame",
    "fork",
    "tyre",
    "spoke",
    "hub",
    "crank",
    "lever",
    "cable",
    "route",
    "climb",
    "descent",
    "weather",
    "map",
    "rain",
    "wind",
    "coffee",
    "repair",
    "pump",
    "valve",
    "tube",
    "patch",
    "light",
    "lock",
    "helmet",
    "jersey",
    "glove",
    "river",
    "bridge",
    "harbour",
    "lantern",
    "meadow",
    "orchard",
    "granite",
    "copper",
    "violet",
    "amber",
    "signal",
    "station",
    "market",
    "ledger",
    "invoice",
    "parcel",
    "courier",
    "ticket",
    "window",
    "garden",
    "kettle",
    "pepper",
    "thunder",
    "silver",
    "marble",
]

# the smoke run: every code path, tiny sizes, on the CPU (seconds, not minutes)
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
SMOKE = dict(
    system_tokens=[64, 256],
    user_tokens=[8, 32],
    output_tokens=[8, 24],
    window=2.0,
    min_requests=6,
    max_requests=24,
    rate_ladder=[2.0, 4.0, 8.0, 16.0],
    rate_max=8.0,
    warm_requests=8,
    slo=0.006,  # low enough that the tiny model crosses it: the interpolation runs too
    clients=2,
    doc_tokens=512,
    questions=16,
    question_tokens=16,
    problems=4,
    samples=4,
    fewshot_tokens=128,
    problem_tokens=16,
    gen=16,
    burst=16,
    repeats=1,
    max_num_seqs=32,
    hydragen_max_num_seqs=64,
    num_kv_blocks=2048,
    point_timeout=60.0,
    server_timeout=120.0,
)


# ---- text of a given token length --------------------------------------------------------------
def words_text(rng: random.Random, count: int) -> str:
    out = []
    for i in range(count):
        out.append(rng.choice(WORDS))
        if i % 13 == 12:
            out[-1] += "."
    return " ".join(out)


def text_of_tokens(tok: Any, rng: random.Random, n: int) -> str:
    """About ``n`` tokens of word salad (cut at a token boundary, then decoded)."""
    text = words_text(rng, n + 8)
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        text += " " + words_text(rng, n)
        ids = tok.encode(text, add_special_tokens=False)
    return str(tok.decode(ids[:n]))


def system_prompt(tok: Any, n: int, seed: int) -> str:
    rng = random.Random(seed)
    head = "You are the support assistant of a cycling shop. Follow these house rules. "
    return head + text_of_tokens(tok, rng, max(1, n - len(tok.encode(head, add_special_tokens=False))))


def rendered_tokens(tok: Any, messages: list[dict[str, str]], generation: bool = False) -> int:
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    else:
        text = "".join(m["content"] for m in messages)
    return len(tok.encode(text, add_special_tokens=False))


# ---- the server: `python -m prefixserve serve` -------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {name: value}; HTTP answers summed by status class (http_2xx, ...)."""
    status, text = http_get(url + "/metrics")
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key.startswith("prefixserve_http_requests_total{"):
            m = re.search(r'status="(\d)\d\d"', key)
            if m:
                out[f"http_{m.group(1)}xx"] = out.get(f"http_{m.group(1)}xx", 0.0) + float(value)
        elif "{" not in key:
            out[key.removeprefix("prefixserve_")] = float(value)
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = (
        "requests_total",
        "requests_aborted_total",
        "prompt_tokens_total",
        "prompt_tokens_computed_total",
        "prefix_cache_hit_tokens_total",
        "generation_tokens_total",
        "attention_kv_tokens_read_total",
        "attention_kv_tokens_logical_total",
        "preemptions_total",
        "steps_total",
        "step_seconds_total",
        "step_host_seconds_total",
        "gpu_busy_seconds_total",
        "gpu_idle_seconds_total",
        "cuda_graph_captures_total",
        "cuda_graph_capture_seconds_total",
        "http_5xx",
        "http_4xx",
        "time_to_first_token_seconds_sum",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_sum",
        "inter_token_latency_seconds_count",
    )
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    out: dict[str, float] = {
        "requests": d["requests_total"],
        "aborted": d["requests_aborted_total"],
        "prompt_tokens_computed": d["prompt_tokens_computed_total"],
        "prefix_cache_hit_tokens": d["prefix_cache_hit_tokens_total"],
        "generation_tokens": d["generation_tokens_total"],
        "preemptions": d["preemptions_total"],
        "steps": d["steps_total"],
        "step_s": d["step_seconds_total"],
        "step_host_s": d["step_host_seconds_total"],
        "gpu_busy_s": d["gpu_busy_seconds_total"],
        "gpu_idle_s": d["gpu_idle_seconds_total"],
        "graph_captures": d["cuda_graph_captures_total"],
        "graph_capture_s": d["cuda_graph_capture_seconds_total"],
        "http_5xx": d["http_5xx"],
        "http_4xx": d["http_4xx"],
        "kv_read_saving_x": d["attention_kv_tokens_logical_total"]
        / max(1.0, d["attention_kv_tokens_read_total"]),
        "kv_blocks_used_after": after.get("kv_blocks_used", 0.0),
        "running_after": after.get("num_requests_running", 0.0),
        "waiting_after": after.get("num_requests_waiting", 0.0),
    }
    if d["time_to_first_token_seconds_count"]:
        out["server_ttft_mean_s"] = (
            d["time_to_first_token_seconds_sum"] / d["time_to_first_token_seconds_count"]
        )
    if d["inter_token_latency_seconds_count"]:
        out["server_itl_mean_s"] = (
            d["inter_token_latency_seconds_sum"] / d["inter_token_latency_seconds_count"]
        )
    return out


@dataclass
class ServerSpec:
    name: str  # on | off | pinned | ceiling
    attention: str
    prefix_caching: bool
    pins: dict[str, str] = field(default_factory=dict)  # application -> system prompt text
    max_num_seqs: int = 256


class ServerProcess:
    """``python -m prefixserve serve ...`` in a subprocess, its output in a log file: started and
    waited on until /health answers, stopped by SIGTERM (killed if it ignores it)."""

    def __init__(self, cmd: list[str], log_path: Path, name: str, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log_path, self.name, self.env = cmd, log_path, name, env or {}
        self.url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self, timeout: float) -> float:
        """Start the server; returns the seconds it took to answer /health."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if http_get(self.url + "/health", timeout=2.0)[0] == 200:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                self.terminate()
                raise RuntimeError(f"server {self.name} not up after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def terminate(self, timeout: float = 60.0) -> int | str | None:
        """SIGTERM, then wait; returns the exit code (None if it was not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return f"killed after {timeout:.0f} s (SIGTERM ignored)"


class Server(ServerProcess):
    """A configuration's server (``ServerSpec``), with what it was and how it ran (``info``)."""

    def __init__(self, args: argparse.Namespace, spec: ServerSpec, workdir: Path) -> None:
        self.spec = spec
        port = free_port()
        cmd = [sys.executable, "-m", "prefixserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--model", args.model, "--device", args.device, "--attention", spec.attention]
        cmd += ["--max-num-seqs", str(spec.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if not spec.prefix_caching:
            cmd.append("--no-prefix-caching")
        for app, text in spec.pins.items():
            path = workdir / f"system_{app}.txt"
            path.write_text(text)
            cmd += ["--system-prompt", f"{app}={path}"]
        cmd += args.server_arg
        super().__init__(cmd, workdir / f"server_{spec.name}_{port}.log", spec.name)
        self.info: dict[str, Any] = {
            "name": spec.name,
            "attention": spec.attention,
            "prefix_caching": spec.prefix_caching,
            "pinned": sorted(spec.pins),
            "max_num_seqs": spec.max_num_seqs,
            "command": " ".join(
                c if "=" not in c or not c.endswith(".txt") else c.split("=")[0] + "=FILE" for c in cmd[1:]
            ),
        }

    def start(self, timeout: float) -> Server:
        self.info["start_s"] = self.launch(timeout)
        _, models = http_get(self.url + "/v1/models")
        card = json.loads(models)["data"][0]
        self.info["model"], self.info["max_model_len"] = card["id"], card.get("max_model_len")
        m = scrape(self.url)
        self.info["kv_blocks_total"] = m.get("kv_blocks_total")
        self.info["kv_blocks_used_idle"] = m.get("kv_blocks_used")  # the pinned prompts' blocks
        print(
            f"[server {self.spec.name}] up in {self.info['start_s']:.1f} s: {self.info['command']}",
            flush=True,
        )
        return self

    def problems(self) -> list[str]:
        """Lines of the server log that say something went wrong (tracebacks, errors, 5xx)."""
        bad = []
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return bad
        for line in text.splitlines():
            if re.search(r"Traceback|ERROR|CRITICAL|\" 5\d\d|WARNING", line):
                bad.append(line[:300])
        return bad[:20]

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        t0 = time.monotonic()
        with contextlib.suppress(OSError):
            self.info["idle_metrics"] = {
                k: v for k, v in scrape(self.url).items() if k.startswith("kv_blocks")
            }
        self.info["exit_code"] = self.terminate(timeout)
        self.info["stop_s"] = time.monotonic() - t0
        self.info["log_problems"] = self.problems()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the load generator processes --------------------------------------------------------------
class Clients:
    """A few ``python -m benchmarks.serving_client`` processes; a job's requests are dealt between them."""

    def __init__(self, count: int) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.serving_client"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(max(1, count))
        ]

    def run(
        self, url: str, requests: list[dict[str, Any]], timeout: float, lead: float = 1.0
    ) -> dict[str, Any]:
        """Send every request at its offset from a common start (``lead`` seconds from now)."""
        start_at = time.monotonic() + lead
        share: list[list[dict[str, Any]]] = [[] for _ in self.procs]
        for k, r in enumerate(sorted(requests, key=lambda r: r["offset"])):
            share[k % len(self.procs)].append(r)
        for proc, reqs in zip(self.procs, share, strict=True):
            job = {"url": url + "/v1", "start_at": start_at, "deadline": start_at + timeout, "requests": reqs}
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
        results: list[dict[str, Any]] = []
        fatal = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("a client process died")
            answer = json.loads(line)
            results += answer["results"]
            if answer.get("fatal"):
                fatal.append(answer["fatal"])
        if fatal:
            raise RuntimeError(f"client failed: {fatal}")
        return {"results": sorted(results, key=lambda r: r["i"]), "start_at": start_at}

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- statistics ---------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize(results: list[dict[str, Any]], start_at: float) -> dict[str, Any]:
    """Latency and throughput of one point, from the clients' records."""
    ok = [r for r in results if r["error"] is None and r["end"] is not None and r["tokens"] > 0]
    errors = [r["error"] for r in results if r["error"] is not None]
    out: dict[str, Any] = {"requests": len(results), "ok": len(ok), "errors": len(errors)}
    if errors:
        out["error_kinds"] = sorted({e.split(":")[0] for e in errors})
        out["error_sample"] = errors[0][:300]
    if not ok:
        return out
    e2e = [r["end"] - r["sent"] for r in ok]
    first = [(r["first"] if r["first"] is not None else r["end"]) - r["sent"] for r in ok]
    norm = [(r["end"] - r["sent"]) / r["tokens"] for r in ok]
    tpot = [(e - f) / (r["tokens"] - 1) for r, e, f in zip(ok, e2e, first, strict=True) if r["tokens"] > 1]
    gaps: list[float] = []
    max_gap = 0.0
    for r in ok:
        prev = None
        for t, k in r.get("chunks") or []:
            if prev is not None:
                gaps += [(t - prev) / k] * k
                max_gap = max(max_gap, t - prev)
            prev = t
    span = max(r["end"] for r in ok) - min(r["due"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    # the queue building up: TTFT of the last quarter of arrivals against the first quarter's (a finite
    # window hides an overload from the mean latency, not from this)
    by_due = [f for _, f in sorted(zip([r["due"] for r in ok], first, strict=True))]
    quarter = max(1, len(by_due) // 4)
    backlog = mean(by_due[-quarter:]) - mean(by_due[:quarter])
    lag = [r["sent"] - r["due"] for r in results if r.get("sent") is not None and r.get("due") is not None]
    counted = sum(r.get("counted", 0) for r in ok)
    out.update(
        duration_s=span,
        throughput_req_s=len(ok) / span,
        throughput_tok_s=tokens / span,
        generated_tokens=tokens,
        norm_latency_mean=mean(norm),
        norm_latency_p99=pct(norm, 0.99),
        e2e_mean_s=mean(e2e),
        e2e_p99_s=pct(e2e, 0.99),
        ttft_mean_s=mean(first),
        ttft_p99_s=pct(first, 0.99),
        backlog_growth_s=backlog,
        itl_mean_s=mean(gaps),
        itl_p99_s=pct(gaps, 0.99),
        itl_max_s=max_gap,
        tpot_mean_s=mean(tpot),
        tpot_p99_s=pct(tpot, 0.99),
        cached_prompt_fraction=sum(r["cached_tokens"] for r in ok)
        / max(1, sum(r["prompt_tokens"] for r in ok)),
        prompt_tokens_mean=mean([float(r["prompt_tokens"]) for r in ok]),
        client_lag_max_s=max(lag) if lag else 0.0,
        client_lag_p99_s=pct(lag, 0.99) if lag else 0.0,
        streamed_token_fraction=counted / max(1, tokens),
    )
    return out


def over(point: dict[str, Any], slo: float, backlog_s: float) -> bool:
    """The server did not keep up at this point: timed out, mean normalised latency over the SLO, or a
    queue that grew by more than ``backlog_s`` of TTFT across the window."""
    return bool(
        point.get("timed_out")
        or not point.get("norm_latency_mean", float("inf")) <= slo
        or not point.get("backlog_growth_s", float("inf")) <= backlog_s
    )


def sustainable(points: list[dict[str, Any]], slo: float, backlog_s: float = float("inf")) -> dict[str, Any]:
    """The highest rate the server keeps up with (``over``): measured, and interpolated linearly between
    the last point kept up with and the first not (on the normalised latency when that crossed the SLO,
    else the measured rate). Points in rate order."""
    pts = sorted(points, key=lambda p: p["rate_req_s"])
    last_ok = None
    first_bad = None
    for p in pts:
        if over(p, slo, backlog_s):
            first_bad = p
            break
        last_ok = p
    out: dict[str, Any] = {"slo_s_per_token": slo, "backlog_growth_limit_s": backlog_s}
    if last_ok is None:
        out.update(measured=None, interpolated=None, bound="below the lowest rate measured")
        out["lowest_rate"] = pts[0]["rate_req_s"] if pts else None
        return out
    out["measured"] = last_ok["rate_req_s"]
    if first_bad is None:
        out.update(interpolated=None, bound=f">= {last_ok['rate_req_s']:g} (never crossed)")
        return out
    r0, n0 = last_ok["rate_req_s"], last_ok["norm_latency_mean"]
    r1, n1 = first_bad["rate_req_s"], first_bad.get("norm_latency_mean", float("inf"))
    if not math.isfinite(n1) or n1 <= n0 or n1 <= slo:
        out["interpolated"] = r0
    else:
        out["interpolated"] = r0 + (slo - n0) * (r1 - r0) / (n1 - n0)
    out["bound"] = f"between {r0:g} and {r1:g}"
    return out


# ---- workloads ----------------------------------------------------------------------------------
def chat_requests(
    tok: Any,
    system: str,
    n: int,
    seed: int,
    args: argparse.Namespace,
    rate: float | None,
    logprobs: bool,
    stream: bool = True,
    tag: str = "",
) -> list[dict[str, Any]]:
    """``n`` chats after ``system``: user turns and output lengths uniform in their ranges, arrivals
    Poisson at ``rate`` (None: all at once). The same seed gives the same lengths and arrivals."""
    rng = random.Random(seed)
    lens = [(rng.randint(*args.user_tokens), rng.randint(*args.output_tokens)) for _ in range(n)]
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        if rate is not None:
            t += rng.expovariate(rate)
    words = random.Random(f"{seed}-{tag}")
    out = []
    for i, ((user, gen), offset) in enumerate(zip(lens, offsets, strict=True)):
        head = f"Question {tag}{seed}-{i}: "
        text = head + text_of_tokens(
            tok, words, max(1, user - len(tok.encode(head, add_special_tokens=False)))
        )
        body = {
            "model": "default",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            "max_tokens": gen,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        out.append(
            {"i": i, "offset": offset, "kind": "chat", "stream": stream, "logprobs": logprobs, "body": body}
        )
    return out


def doc_requests(tok: Any, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """One ``doc_tokens`` document, ``questions`` questions about it, all at once (completions)."""
    rng = random.Random(seed)
    doc = f"Document {seed}. " + text_of_tokens(tok, rng, args.doc_tokens)
    doc_tokens = len(tok.encode(doc, add_special_tokens=False))
    out = []
    for i in range(args.questions):
        q = f"Question {i}: " + text_of_tokens(tok, rng, args.question_tokens) + "?"
        body = {
            "model": "default",
            "prompt": f"{doc}\n\n{q}\nAnswer:",
            "max_tokens": args.gen,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        out.append(
            {"i": i, "offset": 0.0, "kind": "completion", "stream": False, "body": body, "doc": doc_tokens}
        )
    return out


def sample_requests(tok: Any, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """``problems`` problems after one ``fewshot_tokens`` prefix, ``samples`` samples each (``n``)."""
    rng = random.Random(seed)
    fewshot = f"Worked examples {seed}. " + text_of_tokens(tok, rng, args.fewshot_tokens)
    out = []
    for i in range(args.problems):
        problem = f"Problem {i}: " + text_of_tokens(tok, rng, args.problem_tokens)
        body = {
            "model": "default",
            "prompt": f"{fewshot}\n\n{problem}\nSolution:",
            "max_tokens": args.gen,
            "n": args.samples,
            "temperature": 1.0,
            "seed": seed * 1000 + i,
            "extra_body": {"ignore_eos": True},
        }
        out.append({"i": i, "offset": 0.0, "kind": "completion", "stream": False, "body": body})
    return out


# ---- part: rate ---------------------------------------------------------------------------------
def rate_specs(args: argparse.Namespace, systems: dict[str, str]) -> list[ServerSpec]:
    plain = "triton_paged" if args.device == "cuda" else "reference"
    specs = {
        "on": ServerSpec("on", "auto", True, dict(systems), args.max_num_seqs),
        "off": ServerSpec("off", plain, False, {}, args.max_num_seqs),
        "pinned": ServerSpec("pinned", plain, True, dict(systems), args.max_num_seqs),
    }
    return [specs[c] for c in args.configs]


class Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.end = None if not seconds else time.monotonic() + seconds

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() > self.end


def run_point(
    clients: Clients,
    server: Server,
    tok: Any,
    system: str,
    rate: float,
    seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    n = int(min(args.max_requests, max(args.min_requests, round(rate * args.window))))
    reqs = chat_requests(tok, system, n, seed, args, rate, logprobs=args.logprobs)
    before = scrape(server.url)
    t0 = time.monotonic()
    run = clients.run(server.url, reqs, args.point_timeout)
    wall = time.monotonic() - t0
    time.sleep(0.2)  # let the engine thread's snapshot catch up
    stats = summarize(run["results"], run["start_at"])
    stats["timed_out"] = any(r["error"] == "deadline" for r in run["results"])
    stats["server"] = metrics_delta(before, scrape(server.url))
    stats["wall_s"] = wall
    return stats


def rate_part(
    args: argparse.Namespace, tok: Any, workdir: Path, clients: Clients, deadline: Deadline
) -> dict[str, Any]:
    systems = {f"s{n}": system_prompt(tok, n, seed=n) for n in sorted(args.system_tokens, reverse=True)}
    sizes = {
        f"s{n}": rendered_tokens(tok, [{"role": "system", "content": systems[f"s{n}"]}])
        for n in args.system_tokens
    }
    section: dict[str, Any] = {
        "system_prompt_tokens": sizes,
        "servers": {},
        "points": [],
        "warm": [],
        "sustainable": {},
        "skipped": [],
    }
    for spec in rate_specs(args, systems):
        server = Server(args, spec, workdir)
        try:
            server.start(args.server_timeout)
            for k, (app, system) in enumerate(systems.items()):
                size = sizes[app]
                # warm-up: a burst with the run's lengths (kernels compile, graphs get captured); its
                # throughput says where the sweep starts (a quarter of this burst's request rate)
                warm_reqs = chat_requests(tok, system, args.warm_requests, 900 + k, args, None, args.logprobs)
                warm = summarize(clients.run(server.url, warm_reqs, args.point_timeout)["results"], 0.0)
                burst_rate = warm.get("throughput_req_s", args.rate_ladder[0])
                section["warm"].append({"config": spec.name, "system_tokens": size, **warm})
                ladder = sorted(args.rates or [r for r in args.rate_ladder if r <= args.rate_max])
                if args.rates:
                    order = ladder
                else:  # up from half the burst's rate until the SLO is crossed; down if the first crosses
                    start = max([i for i, r in enumerate(ladder) if r <= burst_rate / 2] or [0])
                    order = ladder[start:]
                print(
                    f"[rate {spec.name} {size} tok] warm-up burst: {burst_rate:.2f} req/s, "
                    f"{warm.get('throughput_tok_s', 0):.0f} tok/s; rates from {order[0]:g}",
                    flush=True,
                )
                points: list[dict[str, Any]] = []
                downward = False
                while order:
                    rate = order.pop(0)
                    if deadline.passed():
                        section["skipped"].append(
                            {"config": spec.name, "system_tokens": size, "rate_req_s": rate}
                        )
                        print(
                            f"[rate {spec.name} {size} tok] {rate:g} req/s skipped: out of time", flush=True
                        )
                        continue
                    seed = 1000 * (k + 1) + int(rate * 100)  # same requests for every configuration
                    stats = run_point(clients, server, tok, system, rate, seed, args)
                    row = {
                        "config": spec.name,
                        "system_tokens": size,
                        "app": app,
                        "rate_req_s": rate,
                        **stats,
                    }
                    points.append(row)
                    section["points"].append(row)
                    print(point_line(row), flush=True)
                    if args.rates:
                        continue
                    crossed = over(row, args.slo, args.backlog)
                    if crossed and len(points) == 1 and not downward:
                        downward = True  # the first rate is already over the SLO: walk down
                        order = [r for r in reversed(ladder) if r < rate]
                    elif (crossed and not downward) or (downward and not crossed):
                        break
                section["sustainable"].setdefault(spec.name, {})[str(size)] = sustainable(
                    points, args.slo, args.backlog
                )
        finally:
            server.stop()
            section["servers"][spec.name] = server.info
    return section


def point_line(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"[rate {r['config']} {r['system_tokens']} tok] {r['rate_req_s']:g} req/s: no request finished"
    return (
        f"[rate {r['config']} {r['system_tokens']} tok] {r['rate_req_s']:g} req/s ({r['requests']} req): "
        f"{r['throughput_req_s']:.2f} req/s, {r['throughput_tok_s']:.0f} tok/s, "
        f"norm {r['norm_latency_mean']:.4f} (p99 {r['norm_latency_p99']:.4f}) s/tok, "
        f"TTFT {r['ttft_mean_s']:.3f} (p99 {r['ttft_p99_s']:.3f}) s, "
        f"ITL {1e3 * r['itl_mean_s']:.1f} (p99 {1e3 * r['itl_p99_s']:.1f}) ms, errors {r['errors']}, "
        f"{r['wall_s']:.0f} s"
    )


# ---- part: hydragen + offline vs server --------------------------------------------------------
def burst_stats(run: dict[str, Any]) -> dict[str, Any]:
    res = run["results"]
    ok = [r for r in res if r["error"] is None and r["end"] is not None]
    out: dict[str, Any] = {"requests": len(res), "ok": len(ok), "errors": len(res) - len(ok)}
    if len(ok) < len(res):
        out["error_sample"] = next(r["error"] for r in res if r["error"] is not None)
    if ok:
        span = max(r["end"] for r in ok) - min(r["sent"] for r in ok)
        tokens = sum(r["tokens"] for r in ok)
        out.update(
            time_to_all_s=span,
            generated_tokens=tokens,
            tok_s=tokens / span,
            cached_prompt_fraction=sum(r["cached_tokens"] for r in ok)
            / max(1, sum(r["prompt_tokens"] for r in ok)),
        )
    return out


def server_burst(
    clients: Clients, server: Server, reqs: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    before = scrape(server.url)
    stats = burst_stats(clients.run(server.url, reqs, args.point_timeout * 2))
    time.sleep(0.2)
    stats["server"] = metrics_delta(before, scrape(server.url))
    return stats


def offline_runs(args: argparse.Namespace, bursts: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """The same bursts through the offline LLM API (this process), with the `on` server's settings;
    the engine is shut down and its GPU memory given back before the servers start."""
    import torch

    try:
        return _offline_runs(args, bursts)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _offline_runs(args: argparse.Namespace, bursts: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    from prefixserve import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        args.model,
        device=args.device,
        attention="auto",
        max_num_seqs=args.hydragen_max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        progress=False,
    )
    out: dict[str, Any] = {"load_s": time.monotonic() - t0, "runs": {}}

    def run(reqs: list[dict[str, Any]]) -> float:
        params = [
            SamplingParams(
                n=r["body"].get("n", 1),
                max_tokens=r["body"]["max_tokens"],
                temperature=r["body"]["temperature"],
                seed=r["body"].get("seed"),
                ignore_eos=True,
            )
            for r in reqs
        ]
        start = time.perf_counter()
        if reqs[0]["kind"] == "chat":
            outs = llm.chat([r["body"]["messages"] for r in reqs], params)
        else:
            outs = llm.generate([r["body"]["prompt"] for r in reqs], params)
        elapsed = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed

    try:
        for name, runs in bursts.items():
            warm, *timed = runs
            run(warm)
            out["runs"][name] = [run(r) for r in timed]
            print(f"[offline] {name}: {', '.join(f'{x:.0f}' for x in out['runs'][name])} tok/s", flush=True)
        if llm.engine.graphs is not None:
            out["graphs_captured"] = llm.engine.graphs.captures
        out["kv_blocks_total"] = llm.metrics()["kv_blocks_total"]
    finally:
        llm.shutdown()
    return out


def hydragen_part(
    args: argparse.Namespace, tok: Any, workdir: Path, clients: Clients
) -> tuple[dict[str, Any], dict[str, Any]]:
    plain = "triton_paged" if args.device == "cuda" else "reference"
    specs = [
        ServerSpec("on", "auto", True, {}, args.hydragen_max_num_seqs),
        ServerSpec("off", plain, True, {}, args.hydragen_max_num_seqs),
        ServerSpec("ceiling", "none", True, {}, args.hydragen_max_num_seqs),
    ]
    system = system_prompt(tok, max(args.system_tokens), seed=max(args.system_tokens))
    # the offline-vs-server bursts: [warm-up, timed...]; identical requests on both sides
    bursts = {
        "chat": [
            chat_requests(tok, system, args.burst, 7000 + r, args, None, logprobs=False, tag="b")
            for r in range(args.repeats + 1)
        ],
        "document": [doc_requests(tok, args, 8000 + r) for r in range(args.repeats + 1)],
    }
    comparison: dict[str, Any] = {
        "settings": {
            "burst_requests": args.burst,
            "system_tokens": rendered_tokens(tok, [{"role": "system", "content": system}]),
            "questions": args.questions,
            "repeats": args.repeats,
        }
    }
    if args.offline:
        comparison["offline"] = offline_runs(args, bursts)
    section: dict[str, Any] = {
        "settings": {
            "doc_tokens": bursts["document"][0][0]["doc"],
            "questions": args.questions,
            "problems": args.problems,
            "samples": args.samples,
            "fewshot_tokens": args.fewshot_tokens,
            "gen": args.gen,
        },
        "servers": {},
        "modes": {},
    }
    for spec in specs:
        if spec.name not in args.hydragen_modes:
            continue
        server = Server(args, spec, workdir)
        try:
            server.start(args.server_timeout)
            mode: dict[str, Any] = {}
            # untimed first: the same shapes with other tokens (compiles, graph captures)
            server_burst(clients, server, doc_requests(tok, args, 9000), args)
            if spec.name == "on":  # its timed document runs are the offline comparison's server side
                mode["document_runs"] = [
                    server_burst(clients, server, reqs, args) for reqs in bursts["document"][1:]
                ]
                mode["document"] = min(mode["document_runs"], key=lambda s: s.get("time_to_all_s", math.inf))
            else:
                mode["document"] = server_burst(clients, server, bursts["document"][1], args)
            server_burst(clients, server, sample_requests(tok, args, 9100), args)
            mode["samples"] = server_burst(clients, server, sample_requests(tok, args, 9200), args)
            for part in ("document", "samples"):
                print(f"[hydragen {spec.name}] {part}: {hydragen_line(mode[part])}", flush=True)
            if spec.name == "on" and args.offline:
                server_burst(clients, server, bursts["chat"][0], args)
                chat_runs = [server_burst(clients, server, reqs, args) for reqs in bursts["chat"][1:]]
                comparison["server"] = {
                    "chat": [s.get("tok_s", 0.0) for s in chat_runs],
                    "document": [s.get("tok_s", 0.0) for s in mode["document_runs"]],
                    "chat_runs": chat_runs,
                }
            section["modes"][spec.name] = mode
        finally:
            server.stop()
            section["servers"][spec.name] = server.info
    if "offline" in comparison and "server" in comparison:
        comparison["ratios"] = {
            name: {
                "best": max(comparison["server"][name]) / max(comparison["offline"]["runs"][name]),
                "mean": mean(comparison["server"][name]) / mean(comparison["offline"]["runs"][name]),
            }
            for name in ("chat", "document")
        }
        for name, r in comparison["ratios"].items():
            print(
                f"[offline vs server] {name}: server/offline {r['best']:.1%} (best), {r['mean']:.1%} (mean)"
            )
    return section, comparison


def hydragen_line(s: dict[str, Any]) -> str:
    if not s.get("ok"):
        return f"nothing finished ({s.get('error_sample')})"
    return (
        f"{s['time_to_all_s']:.2f} s to all answers, {s['tok_s']:.0f} tok/s, "
        f"prompt tokens computed {s['server']['prompt_tokens_computed']:.0f}, "
        f"KV read saving {s['server']['kv_read_saving_x']:.1f}x, errors {s['errors']}"
    )


# ---- issues the load exposed -------------------------------------------------------------------
def find_issues(result: dict[str, Any]) -> list[str]:
    issues = []
    logprobs = (result.get("settings") or {}).get("logprobs", False)
    for section in ("rate", "hydragen"):
        sec = result.get(section) or {}
        for name, info in (sec.get("servers") or {}).items():
            if info.get("exit_code") not in (0, None):
                issues.append(f"{section}: server {name} exited {info.get('exit_code')} on SIGTERM")
            idle = (info.get("idle_metrics") or {}).get("kv_blocks_used")
            pinned = info.get("kv_blocks_used_idle") or 0
            if idle is not None and idle > pinned:
                issues.append(
                    f"{section}: server {name} held {idle:.0f} KV blocks when idle ({pinned:.0f} pinned)"
                )
            for line in info.get("log_problems") or []:
                issues.append(f"{section}: server {name} log: {line}")
    rate = result.get("rate") or {}
    for p in rate.get("points", []):
        where = f"rate {p['config']} {p['system_tokens']} tok {p['rate_req_s']:g} req/s"
        if p.get("errors"):
            issues.append(f"{where}: {p['errors']} failed requests ({p.get('error_sample')})")
        if p.get("server", {}).get("http_5xx"):
            issues.append(f"{where}: {p['server']['http_5xx']:.0f} answers 5xx")
        if p.get("client_lag_max_s", 0) > 0.25:
            issues.append(f"{where}: the load generator sent a request {p['client_lag_max_s']:.2f} s late")
        if p.get("ok") and p.get("streamed_token_fraction", 1) < 0.99 and logprobs:
            issues.append(
                f"{where}: streamed chunks carried {p['streamed_token_fraction']:.0%} of the tokens"
            )
    hyd = result.get("hydragen") or {}
    for mode, runs in (hyd.get("modes") or {}).items():
        for part in ("document", "samples"):
            s = runs.get(part) or {}
            if s.get("errors"):
                issues.append(
                    f"hydragen {mode} {part}: {s['errors']} failed requests ({s.get('error_sample')})"
                )
    return issues


# ---- report -------------------------------------------------------------------------------------
def idle_share(server: dict[str, Any]) -> str:
    """The GPU's idle share of the point's steps (waiting on the host), from the server's counters."""
    busy, idle = server.get("gpu_busy_s"), server.get("gpu_idle_s")
    if not busy and not idle:
        return "-"
    return f"{idle / (busy + idle):.0%}"


def fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{NAME}.md").write_text(markdown(result))
    plotted = plot(result, out / f"{NAME}.png")
    print(f"wrote {out / NAME}.json, .md{', .png' if plotted else ''}", flush=True)


def markdown(result: dict[str, Any]) -> str:
    r, s = result["run"], result["settings"]
    lines = [
        "# Serving on the GPU: long system prompts (RelayAttention) and shared context (Hydragen)",
        "",
        f"{r['device']}; torch {r['torch']}; Python {r['python']}; commit {r['commit']}; {r['date']}; "
        f"model `{s['model']}` ({result.get('model_name', '')}); openai client {r.get('openai', '?')}. "
        "Written by `benchmarks/serving.py --device cuda`.",
        "",
        "The server is `python -m prefixserve serve` in its own process, started per configuration with "
        f"`--max-num-batched-tokens {s['max_num_batched_tokens']} --num-kv-blocks {s['num_kv_blocks']}` "
        "(blocks of 16 tokens); the load comes over loopback HTTP from "
        f"{s['clients']} processes running the official `openai` client (`AsyncOpenAI`, no retries), each "
        "point's arrival times dealt between them. On a GPU `serve` runs the engine in a child process "
        "of its own (`--engine-process auto`) since commit 2cc0217; sections measured at earlier commits "
        "ran it on a thread of the server's process.",
        "",
    ]
    if result.get("merged_from"):
        lines += [
            "Sections merged from earlier runs: "
            + ", ".join(f"{k} ({v})" for k, v in result["merged_from"].items())
            + ".",
            "",
        ]
    rate = result.get("rate")
    if rate:
        lines += rate_markdown(rate, s)
    cmp_ = result.get("offline_vs_server")
    if cmp_:
        lines += comparison_markdown(cmp_, s)
    hyd = result.get("hydragen")
    if hyd:
        lines += hydragen_markdown(hyd, s)
    issues = result.get("issues") or []
    lines += ["## What the load exposed", ""]
    lines += (
        [f"- {i}" for i in issues]
        if issues
        else [
            "- Nothing: no 5xx, no failed or late request, no KV "
            "block held after the load, every server exited 0."
        ]
    )
    lines += ["", f"Whole run: {result.get('wall_s', 0):.0f} s. Reproduce: `{s.get('command', '')}`."]
    return "\n".join(lines) + "\n"


def rate_markdown(rate: dict[str, Any], s: dict[str, Any]) -> list[str]:
    sizes = rate["system_prompt_tokens"]
    lines = [
        "## Long system prompt, Poisson arrivals (RelayAttention §4.3)",
        "",
        f"System prompts of {', '.join(str(v) for v in sizes.values())} tokens (as the chat template renders "
        f"them); user turns of {s['user_tokens'][0]}-{s['user_tokens'][1]} tokens and outputs of "
        f"{s['output_tokens'][0]}-{s['output_tokens'][1]} tokens (uniform, `ignore_eos`, greedy); streamed "
        f"chat completions. Each rate runs about {s['window']:g} s of Poisson arrivals ({s['min_requests']}-"
        f"{s['max_requests']} requests), the same requests and arrival times for every configuration; rates "
        "climb (x1.5, x1.33) from half a warm-up burst's request rate until the server stops keeping up: "
        f"the mean normalised latency passes {s['slo']} s/token, or the queue grows (the last quarter's "
        f"mean TTFT exceeds the first quarter's by more than {s.get('backlog', float('inf')):g} s; a "
        "finite window hides an overload from the mean latency, not from this).",
        "",
        "Sharing on: `--attention auto`, prefix cache on, both system prompts pinned (`--system-prompt`). "
        "Sharing off: `--attention triton_paged` (the plain paged kernel), `--no-prefix-caching`: each "
        "request computes its system prompt and attends it alone."
        + (
            " Pinned: the plain kernel with the prompts pinned (stored once, read per sequence)."
            if "pinned" in s.get("configs", [])
            else ""
        ),
        "",
        "Normalised latency = end-to-end seconds / generated tokens, per request; TTFT = send to first "
        "token; ITL = gaps between streamed chunks, split over the tokens a chunk carries "
        + (
            "(counted from each chunk's logprobs, `top_logprobs=0`)"
            if s.get("logprobs")
            else "(one per chunk)"
        )
        + "; TPOT = (end-to-end - TTFT) / (tokens - 1).",
        "",
        "| system prompt | sharing | rate (req/s) | requests | served (req/s) | tok/s | norm. latency mean "
        "| p99 (s/tok) | TTFT mean | p99 (s) | queue growth (s) | ITL mean | p99 (ms) | TPOT mean (ms) "
        "| cached prompt | KV read saving | GPU idle | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(rate["points"], key=lambda p: (p["system_tokens"], p["config"], p["rate_req_s"])):
        if not p.get("ok"):
            lines.append(
                f"| {p['system_tokens']} | {p['config']} | {p['rate_req_s']:g} | {p['requests']} | "
                f"- | - | - | - | - | - | - | - | - | - | - | - | - | {p.get('errors')} |"
            )
            continue
        lines.append(
            f"| {p['system_tokens']} | {p['config']}{' (timed out)' if p.get('timed_out') else ''} "
            f"| {p['rate_req_s']:g} | {p['requests']} "
            f"| {p['throughput_req_s']:.2f} | {p['throughput_tok_s']:.0f} "
            f"| {fmt(p['norm_latency_mean'], '.4f')} "
            f"| {fmt(p['norm_latency_p99'], '.4f')} | {fmt(p['ttft_mean_s'])} | {fmt(p['ttft_p99_s'])} "
            f"| {fmt(p.get('backlog_growth_s'), '.2f')} "
            f"| {fmt(1e3 * p['itl_mean_s'], '.1f')} | {fmt(1e3 * p['itl_p99_s'], '.1f')} "
            f"| {fmt(1e3 * p['tpot_mean_s'], '.1f')} | {p['cached_prompt_fraction']:.0%} "
            f"| {p['server']['kv_read_saving_x']:.1f}x | {idle_share(p['server'])} | {p['errors']} |"
        )
    lines += [
        "",
        f"Highest request rate the server keeps up with (mean normalised latency <= {s['slo']} s/token and "
        "no queue growth; interpolated on the latency between the last rate kept up with and the first not "
        "when the latency crossed; 'measured' is the last rate kept up with):",
        "",
    ]
    configs = list(rate["sustainable"])
    head = "| system prompt | " + " | ".join(f"{c} (req/s)" for c in configs) + " | on / off |"
    lines += [head, "|---:|" + "---:|" * (len(configs) + 1)]
    for size in sizes.values():
        cells, val = [], {}
        for c in configs:
            sus = rate["sustainable"][c].get(str(size), {})
            v = sus.get("interpolated") or sus.get("measured")
            val[c] = (v, sus.get("interpolated") is not None)
            cells.append(
                f"{fmt(sus.get('interpolated'), '.2f')} (measured {fmt(sus.get('measured'), 'g')}; "
                f"{sus.get('bound', '-')})"
            )
        ratio = "-"
        if "on" in val and "off" in val and val["on"][0] and val["off"][0] and val["off"][1]:
            ratio = f"{val['on'][0] / val['off'][0]:.2f}x" + ("" if val["on"][1] else " (at least)")
        lines.append(f"| {size} | " + " | ".join(cells) + f" | {ratio} |")
    big = str(max(sizes.values()))
    on = rate["sustainable"].get("on", {}).get(big, {})
    off = rate["sustainable"].get("off", {}).get(big, {})
    v_on, v_off = on.get("interpolated") or on.get("measured"), off.get("interpolated")
    if v_on and v_off:
        x = v_on / v_off
        verdict = (
            "met" if x >= 2.2 else ("NOT met" if on.get("interpolated") else "not settled (on never crossed)")
        )
        at_least = "" if on.get("interpolated") else " at least"
        lines += [
            "",
            f"Target >= 2.2x the sharing-off rate at the {big}-token prompt:{at_least} **{x:.2f}x**, "
            f"{verdict}.",
        ]
    if rate.get("skipped"):
        lines += [
            "",
            "Skipped for lack of time: "
            + ", ".join(
                f"{k['config']} {k['system_tokens']} tok {k['rate_req_s']:g} req/s" for k in rate["skipped"]
            )
            + ".",
        ]
    lines += [
        "",
        "Warm-up bursts (all at once, untimed for the sweep; they set where each sweep starts):",
        "",
        "| system prompt | sharing | requests | req/s | tok/s | TTFT mean (s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for w in rate.get("warm", []):
        lines.append(
            f"| {w['system_tokens']} | {w['config']} | {w['requests']} "
            f"| {fmt(w.get('throughput_req_s'), '.2f')} | {fmt(w.get('throughput_tok_s'), '.0f')} "
            f"| {fmt(w.get('ttft_mean_s'))} |"
        )
    lines += [
        "",
        "Servers: "
        + "; ".join(
            f"{k}: up in {fmt(v.get('start_s'), '.1f')} s, {v.get('kv_blocks_total')} KV blocks, "
            f"exit {v.get('exit_code')}"
            for k, v in rate["servers"].items()
        )
        + ".",
        "",
    ]
    return lines


def comparison_markdown(c: dict[str, Any], s: dict[str, Any]) -> list[str]:
    st = c["settings"]
    lines = [
        "## Offline API vs server, same bursts and engine settings",
        "",
        "Generated tokens/s of the same requests through `LLM.chat` / `LLM.generate` in one process and "
        f"through the `on` server (`--attention auto`, prefix cache, `--max-num-seqs "
        f"{s['hydragen_max_num_seqs']}`): `chat` = {st['burst_requests']} chats after a "
        f"{st['system_tokens']}-token system prompt sent at once (streamed), `document` = the document's "
        f"{st['questions']} questions sent at once; each after one untimed burst of the same shape, "
        f"{st['repeats']} timed repeats with other tokens.",
        "",
    ]
    if "offline" not in c or "server" not in c:
        return [*lines, "(not measured)", ""]
    lines += [
        "| burst | offline (tok/s) | server (tok/s) | server / offline (best) | (means) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ratio in c.get("ratios", {}).items():
        off = ", ".join(f"{x:.0f}" for x in c["offline"]["runs"][name])
        srv = ", ".join(f"{x:.0f}" for x in c["server"][name])
        lines.append(f"| {name} | {off} | {srv} | **{ratio['best']:.1%}** | {ratio['mean']:.1%} |")
    worst = min((v["best"] for v in c.get("ratios", {}).values()), default=float("nan"))
    lines += [
        "",
        f"Target: the server within 10% of the offline API: {'met' if worst >= 0.9 else 'NOT met'} "
        f"(worst burst {worst:.1%}).",
        "",
    ]
    return lines


def hydragen_markdown(h: dict[str, Any], s: dict[str, Any]) -> list[str]:
    st = h["settings"]
    lines = [
        "## Shared document and many samples (Hydragen)",
        "",
        f"`document`: one {st['doc_tokens']}-token document and {st['questions']} questions about it "
        f"(completions, one request each, all sent at once). `samples`: {st['problems']} problems after one "
        f"{st['fewshot_tokens']}-token few-shot prefix, `n={st['samples']}` samples each (temperature 1). "
        f"{st['gen']} tokens per answer (`ignore_eos`), answers not streamed. One server per mode, "
        f"`--max-num-seqs {s['hydragen_max_num_seqs']}`, prefix cache on in every mode (the document's KV is "
        "stored once): on = `--attention auto`, off = `--attention triton_paged` (each sequence reads the "
        "document itself, as vLLM with prefix caching does), ceiling = `--attention none` (attention "
        "skipped: the dense path alone). Each timed run follows an untimed run of the same shape with other "
        "tokens. "
        "Sharing off without the prefix cache is not run: 256 copies of the document's KV would need "
        f"{st['questions'] * st['doc_tokens'] * 128 / 1e6:.0f} GB for an 8B model.",
        "",
        "| workload | mode | time to all answers (s) | generated tok/s | vs off | of ceiling | prompt tokens "
        "computed | KV read saving | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    modes = h.get("modes", {})
    for part in ("document", "samples"):
        off = (modes.get("off") or {}).get(part, {}).get("tok_s")
        ceil = (modes.get("ceiling") or {}).get(part, {}).get("tok_s")
        for mode in ("on", "off", "ceiling"):
            x = (modes.get(mode) or {}).get(part)
            if not x or not x.get("ok"):
                continue
            saving = "-" if mode == "ceiling" else f"{x['server']['kv_read_saving_x']:.1f}x"
            lines.append(
                f"| {part} | {mode} | {x['time_to_all_s']:.2f} | {x['tok_s']:.0f} "
                f"| {fmt(x['tok_s'] / off if off else None, '.2f')}x "
                f"| {fmt(x['tok_s'] / ceil if ceil else None, '.0%')} "
                f"| {x['server']['prompt_tokens_computed']:.0f} | {saving} | {x['errors']} |"
            )
    lines += [
        "",
        "Servers: "
        + "; ".join(
            f"{k}: up in {fmt(v.get('start_s'), '.1f')} s, exit {v.get('exit_code')}"
            for k, v in h.get("servers", {}).items()
        )
        + ".",
        "",
    ]
    return lines


def plot(result: dict[str, Any], path: Path) -> bool:
    rate = result.get("rate")
    if not rate or not rate.get("points"):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({p["system_tokens"] for p in rate["points"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4.2), squeeze=False)
    styles = {
        "on": ("o-", "C0", "sharing on"),
        "off": ("s--", "C3", "sharing off"),
        "pinned": ("^-.", "C2", "pinned, plain kernel"),
    }
    slo = result["settings"]["slo"]
    for ax, size in zip(axes[0], sizes, strict=True):
        for config, (style, color, label) in styles.items():
            pts = sorted(
                (
                    p
                    for p in rate["points"]
                    if p["system_tokens"] == size and p["config"] == config and p.get("ok")
                ),
                key=lambda p: p["rate_req_s"],
            )
            if not pts:
                continue
            xs = [p["rate_req_s"] for p in pts]
            ax.plot(xs, [p["norm_latency_mean"] for p in pts], style, color=color, label=f"{label} (mean)")
            ax.plot(
                xs,
                [p["norm_latency_p99"] for p in pts],
                style[0] + ":",
                color=color,
                alpha=0.45,
                label=f"{label} (p99)",
            )
        ax.axhline(slo, color="grey", lw=0.8, ls=":")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="request rate (req/s)",
            ylabel="normalised latency (s/token)",
            title=f"{size}-token system prompt",
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"prefixserve server, {result['settings']['model']} on {result['run']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main ---------------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["rate", "hydragen", "all", "report"], default="all")
    p.add_argument(
        "--out",
        default=None,
        help="where serving_gpu.{json,md,png} go (default docs/benchmarks; "
        "a temp dir with --smoke); also copied to $OUT when that is set",
    )
    p.add_argument(
        "--merge",
        nargs="*",
        default=[],
        metavar="JSON",
        help="earlier results whose sections this run does not measure are kept (later files win)",
    )
    p.add_argument("--model", default="dummy:.gpu/llama8b/config.json")
    p.add_argument("--system-tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--user-tokens", type=int, nargs=2, default=[64, 256])
    p.add_argument("--output-tokens", type=int, nargs=2, default=[128, 512])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["off", "on"],
        choices=["on", "off", "pinned"],
        help="rate-part servers, in run order (off first: its sweep is short and bounded)",
    )
    p.add_argument("--rates", type=float, nargs="*", default=None, help="fixed rates (default: doubling)")
    p.add_argument(
        "--rate-ladder",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64],
    )
    p.add_argument("--rate-max", type=float, default=64.0)
    p.add_argument("--window", type=float, default=6.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=10)
    p.add_argument("--max-requests", type=int, default=320)
    p.add_argument("--warm-requests", type=int, default=32)
    p.add_argument("--slo", type=float, default=0.1, help="normalised latency bound (s/token)")
    p.add_argument(
        "--backlog",
        type=float,
        default=2.0,
        help="a rate is not kept up with if the last quarter's mean TTFT exceeds the first's by this (s)",
    )
    p.add_argument(
        "--logprobs",
        action="store_true",
        help="count each chunk's tokens from its logprobs (default: one per chunk with text, as vLLM's "
        "benchmark does; logprobs cost the server a log-softmax and their formatting)",
    )
    p.add_argument("--clients", type=int, default=4, help="load generator processes")
    p.add_argument(
        "--point-timeout", type=float, default=75.0, help="seconds a point may run; then cancelled"
    )
    p.add_argument(
        "--deadline", type=float, default=420.0, help="seconds after which no new rate starts (0: none)"
    )
    p.add_argument("--doc-tokens", type=int, default=16384)
    p.add_argument("--questions", type=int, default=256)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--problems", type=int, default=16)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--fewshot-tokens", type=int, default=2048)
    p.add_argument("--problem-tokens", type=int, default=64)
    p.add_argument("--gen", type=int, default=128, help="tokens per answer in the hydragen part")
    p.add_argument("--hydragen-modes", nargs="+", default=["on", "off", "ceiling"])
    p.add_argument("--burst", type=int, default=256, help="chats in the offline-vs-server burst")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats of each offline-vs-server burst")
    p.add_argument(
        "--no-offline", dest="offline", action="store_false", help="skip the offline API comparison"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="servers of the rate part")
    p.add_argument("--hydragen-max-num-seqs", type=int, default=1024, help="servers of the hydragen part")
    p.add_argument(
        "--num-kv-blocks", type=int, default=40000, help="every server's and the offline engine's pool"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for every server")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes on the CPU, into a temp dir")


def run_info_extra() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    from benchmarks._common import run_info

    info = run_info()
    for pkg in ("openai", "fastapi", "uvicorn"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    return info


def load_merged(files: list[str]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for f in files:
        path = Path(f)
        if not path.exists():
            print(f"--merge: {f} not found, skipped", flush=True)
            continue
        old = json.loads(path.read_text())
        for section in SECTIONS:
            if old.get(section):
                merged[section] = old[section]
                merged.setdefault("merged_from", {})[section] = (
                    old.get("merged_from", {}).get(section)
                    or old["run"]["commit"] + ", " + old["run"]["date"]
                )
        merged.setdefault("settings", old.get("settings"))
        merged.setdefault("run", old.get("run"))
        merged.setdefault("model_name", old.get("model_name"))
        for key in ("benchmark", "wall_s"):  # the run's own, for a report rewritten from it
            if key in old:
                merged.setdefault(key, old[key])
    return merged


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    add_args(p)
    if "--smoke" in argv:  # tiny sizes on the CPU; options given explicitly still win
        p.set_defaults(**SMOKE, device="cpu", model=None, deadline=0)
    args = p.parse_args(argv)
    t_start = time.monotonic()
    tmp_root = Path(tempfile.mkdtemp(prefix="serving_gpu_"))
    if args.smoke:
        if args.model is None:
            cfg = tmp_root / "tiny" / "config.json"
            cfg.parent.mkdir()
            cfg.write_text(json.dumps(TINY))
            args.model = f"dummy:{cfg}"
        args.out = args.out or str(tmp_root / "out")
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks"
    merged = load_merged(args.merge)
    if args.part == "report":
        if not merged:
            raise SystemExit("--part report needs --merge JSON...")
        result = {**merged, "run": merged["run"], "settings": merged["settings"]}
        own = f"{result['run']['commit']}, {result['run']['date']}"
        sources = {k: v for k, v in (result.pop("merged_from", None) or {}).items() if v != own}
        if sources:  # sections measured by other runs than the one the header names
            result["merged_from"] = sources
        result["issues"] = find_issues(result)
        write_report(result, out)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU here (use --smoke for a CPU run of every code path)")
    if args.model.startswith("dummy:") and not Path(args.model[6:]).exists():
        shipped = ROOT / "prefixserve" / "model" / "configs" / (args.model[6:] + ".json")
        if not shipped.exists():
            raise SystemExit(f"{args.model}: no such config")

    from prefixserve.model.loader import tokenizer_for

    model_name, tok = tokenizer_for(args.model, progress=False)
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer: the benchmark needs text prompts")
    argv_shown = " ".join(argv)
    result: dict[str, Any] = {
        "benchmark": NAME,
        "run": run_info_extra(),
        "model_name": model_name,
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("merge", "out")},
            "command": f"python benchmarks/serving.py {argv_shown}".strip(),
        },
    }
    workdir = tmp_root / "work"
    workdir.mkdir()
    clients = Clients(args.clients)
    deadline = Deadline(args.deadline)
    try:
        if args.part in ("rate", "all"):
            result["rate"] = rate_part(args, tok, workdir, clients, deadline)
        if args.part in ("hydragen", "all"):
            result["hydragen"], result["offline_vs_server"] = hydragen_part(args, tok, workdir, clients)
    finally:
        clients.close()
    for section in SECTIONS:
        if section not in result and merged.get(section):
            result[section] = merged[section]
            result.setdefault("merged_from", {})[section] = merged["merged_from"][section]
    result["issues"] = find_issues(result)
    result["wall_s"] = time.monotonic() - t_start
    write_report(result, out)
    env_out = os.environ.get("OUT")
    if env_out and Path(env_out).resolve() != out.resolve():
        for suffix in ("json", "md", "png"):
            src = out / f"{NAME}.{suffix}"
            if src.exists():
                shutil.copy(src, Path(env_out) / src.name)
    print_summary(result)
    if not args.smoke:
        shutil.rmtree(tmp_root, ignore_errors=True)


def print_summary(result: dict[str, Any]) -> None:
    print("\n== summary ==")
    rate = result.get("rate")
    if rate:
        for config, per in rate["sustainable"].items():
            for size, sus in per.items():
                print(
                    f"rate {config:7s} {size:>6s} tok: sustainable "
                    f"{fmt(sus.get('interpolated'), '.2f')} req/s "
                    f"(measured {fmt(sus.get('measured'), 'g')}; {sus.get('bound')})"
                )
    cmp_ = result.get("offline_vs_server") or {}
    for name, r in (cmp_.get("ratios") or {}).items():
        print(f"server/offline {name}: {r['best']:.1%} (best), {r['mean']:.1%} (mean)")
    for mode, runs in ((result.get("hydragen") or {}).get("modes") or {}).items():
        for part in ("document", "samples"):
            if runs.get(part):
                print(f"hydragen {mode:7s} {part:8s}: {hydragen_line(runs[part])}")
    for issue in result.get("issues") or []:
        print(f"ISSUE: {issue}")
    print(f"wall {result.get('wall_s', 0):.0f} s")
