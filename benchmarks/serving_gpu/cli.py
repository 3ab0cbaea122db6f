"""The command line: parts to run, the smoke run's tiny sizes, merging earlier runs' sections."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, TINY, dummy_model, run_info
from benchmarks.harness.server import Clients
from benchmarks.serving_gpu.hydragen import hydragen_line, hydragen_part
from benchmarks.serving_gpu.rate import Deadline, rate_part
from benchmarks.serving_gpu.report import NAME, SECTIONS, find_issues, fmt, write_report

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
            args.model = dummy_model(TINY, tmp_root / "tiny")
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
        "run": run_info(("openai", "fastapi", "uvicorn")),
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
