"""``python -m prefixserve serve`` started as a subprocess the way a user starts it (and stopped), its
/metrics scraped, and client processes (``benchmarks/serving_client.py``) that load it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.harness.output import ROOT


def serve_command(args: Any, *extra: str) -> list[str]:
    """``prefixserve serve`` on a free local port as the server benchmarks start it: ``args``' model,
    device and pool sizes (``--max-num-seqs``, ``--num-kv-blocks``, ``--max-num-batched-tokens``),
    then ``extra`` and every ``--server-arg``."""
    cmd = [sys.executable, "-m", "prefixserve", "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    cmd += ["--model", args.model, "--device", args.device, "--attention", "auto"]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), *extra]
    return cmd + args.server_arg


def apply_cpu_defaults(args: Any, argv: list[str], cpu: dict[str, Any]) -> None:
    """On the CPU (``args.device``), ``cpu``'s tiny sizes for every option not given in ``argv``."""
    if args.device != "cpu":
        return
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    for key, value in cpu.items():
        if key not in given:
            setattr(args, key, value)


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
    """The server's /metrics as {name: value}; HTTP answers summed by status class (http_2xx, ...),
    refusals at arrival by reason (``requests_refused_queue_requests_total``, ...)."""
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
        elif key.startswith("prefixserve_requests_refused_total{"):  # by reason, as the engine names them
            m = re.search(r'reason="(\w+)"', key)
            if m:
                out[f"requests_refused_{m.group(1)}_total"] = float(value)
        elif key.endswith('_bucket{le="1.0"}'):  # a histogram's count within 1 s (how many took longer)
            out[key.removeprefix("prefixserve_").split("{")[0] + "_le_1s"] = float(value)
        elif "{" not in key:
            out[key.removeprefix("prefixserve_")] = float(value)
    return out


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once the engine has no request left (the answers are in, the last step may not be)."""
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        idle = m and not m.get("num_requests_running") and not m.get("num_requests_waiting")
        if idle or time.monotonic() - t0 > timeout:
            return m
        time.sleep(0.05)


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
        self,
        url: str,
        requests: list[dict[str, Any]],
        timeout: float,
        lead: float = 1.0,
        request_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send every request at its offset from a common start (``lead`` seconds from now); the ones
        still running ``timeout`` seconds after the start are cancelled. ``request_timeout``: each
        request's HTTP timeout (the client's default, 600 s, when None)."""
        start_at = time.monotonic() + lead
        share: list[list[dict[str, Any]]] = [[] for _ in self.procs]
        for k, r in enumerate(sorted(requests, key=lambda r: r["offset"])):
            share[k % len(self.procs)].append(r)
        for proc, reqs in zip(self.procs, share, strict=True):
            job = {"url": url + "/v1", "start_at": start_at, "deadline": start_at + timeout, "requests": reqs}
            if request_timeout is not None:
                job["timeout"] = request_timeout
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
        results: list[dict[str, Any]] = []
        fatal = []
        lags: list[dict[str, float]] = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("a client process died")
            answer = json.loads(line)
            results += answer["results"]
            if answer.get("loop_lag"):
                lags.append(answer["loop_lag"])
            if answer.get("fatal"):
                fatal.append(answer["fatal"])
        if fatal:
            raise RuntimeError(f"client failed: {fatal}")
        loop_lag = {k: max(x[k] for x in lags) for k in ("p99", "max")} if lags else None  # worst process
        return {"results": sorted(results, key=lambda r: r["i"]), "start_at": start_at, "loop_lag": loop_lag}

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
