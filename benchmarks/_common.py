"""Shared by benchmark scripts: run metadata and result writing (JSON + Markdown, plots optional)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def run_info() -> dict[str, Any]:
    """Where and when a result was measured: device, versions, commit.

    ``PREFIXSERVE_COMMIT`` wins when set: the device machine's copy of the tree may carry a stale .git.
    """
    try:
        if os.environ.get("PREFIXSERVE_COMMIT"):
            raise OSError("commit given by the environment")
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        # The device machine gets a copy of the tree without .git: pass PREFIXSERVE_COMMIT there.
        commit = os.environ.get("PREFIXSERVE_COMMIT", "unknown")
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu: {platform.processor() or platform.machine()}"
    )
    return {
        "device": device,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run_or_report(
    doc: str | None,
    name: str,
    default_out: Path,
    add_run_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], None],
    report: Callable[[dict[str, Any], Path], None],
) -> None:
    """A GPU benchmark's command line: ``run [--out DIR] ...`` measures and writes NAME.json and its
    report; ``report --json FILE [--out DIR]`` rewrites the report from a JSON (copied into DIR)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default=str(default_out))
    add_run_args(r)
    p = sub.add_parser("report")
    p.add_argument("--json", required=True)
    p.add_argument("--out", default=str(default_out))
    args = ap.parse_args()
    if args.mode == "run":
        run(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = json.loads(Path(args.json).read_text())
    name = result.get("settings", {}).get("name") or name  # a run saved under its own --name
    if Path(args.json).resolve() != (out / f"{name}.json").resolve():
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    report(result, out)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is missing (no plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def write_text(out_dir: Path, name: str, lines: list[str]) -> str:
    """Markdown lines into out_dir/name (the folder made if missing), printed too; returns the text."""
    text = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(text)
    print(text)
    return text


def write_results(name: str, payload: dict[str, Any], markdown: str, out: Path = RESULTS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def gpu_idle_frac(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The GPU's idle share between decode steps (waiting for the host), from two ``llm.metrics()``."""
    idle = after["decode_gpu_idle_seconds_total"] - before["decode_gpu_idle_seconds_total"]
    busy = after["decode_gpu_busy_seconds_total"] - before["decode_gpu_busy_seconds_total"]
    return idle / max(idle + busy, 1e-9)
