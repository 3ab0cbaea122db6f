"""Where and when a result was measured: device, versions, commit, date."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch


def git_commit() -> str:
    """The tree's short commit, ``+dirty`` when tracked files differ from it.

    ``PREFIXSERVE_COMMIT`` wins when set: the device machine's copy of the tree may carry a stale .git
    (or none).
    """
    if os.environ.get("PREFIXSERVE_COMMIT"):
        return os.environ["PREFIXSERVE_COMMIT"]
    here = Path(__file__).parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=here
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=here
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


SOURCE_DIRS = ("prefixserve", "benchmarks")  # the code a result depends on (not the docs it writes)


def source_trees(root: Path | None = None) -> dict[str, str] | None:
    """The git tree id of each of ``SOURCE_DIRS`` as the files are now (tracked and unignored ones),
    12 hex digits: ``git rev-parse COMMIT:prefixserve`` gives the same id for a commit holding that
    code. Unlike the commit it holds where .git is stale (the device machine's copy keeps the
    session's first), and results written under docs/ do not change it. None without git."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        with tempfile.TemporaryDirectory() as scratch:  # a private index: the checkout's is untouched
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
            git = {"env": env, "cwd": root, "capture_output": True, "text": True, "check": True}
            subprocess.run(["git", "add", "-A", "--", *SOURCE_DIRS], **git)
            return {
                name: subprocess.run(["git", "write-tree", f"--prefix={name}/"], **git).stdout.strip()[:12]
                for name in SOURCE_DIRS
            }
    except (OSError, subprocess.CalledProcessError):
        return None


def run_info(packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """Device, CPU count, Python and torch versions, commit and UTC date; plus each of ``packages``'
    installed version (None where missing)."""
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu: {platform.processor() or platform.machine()}"
    )
    info: dict[str, Any] = {
        "device": device,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "source_trees": source_trees(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dummy_routing": "uniform_table",  # dummy MoE routers: draws made at load (model/dummy_routing.py)
    }
    for pkg in packages:
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    return info


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what platform knows where that is missing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
