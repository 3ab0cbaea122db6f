"""A configuration's server (attention, prefix cache, pinned prompts) and what its /metrics moved."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.server import ServerProcess, free_port, http_get, scrape


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
