"""Result files: JSON + Markdown (+ a plot) under docs/benchmarks/, and the ``run`` / ``report``
command line of GPU benchmarks (a report can be rewritten from a saved JSON without a GPU)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "benchmarks"


def run_or_report(
    doc: str | None,
    name: str,
    default_out: Path,
    add_run_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], None],
    report: Callable[[dict[str, Any], Path], None],
    argv: list[str] | None = None,
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
    args = ap.parse_args(argv)
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


def bar_chart(
    path: Any, results: dict[str, dict[str, Any]], key: str, ylabel: str, title: str, colors: list[str]
) -> None:
    """One bar a mode (``results``' keys) of each mode's ``key``, saved as a PNG at ``path``."""
    plt = pyplot()
    if plt is None:
        return
    modes = list(results)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.bar(modes, [results[m][key] for m in modes], color=colors[: len(modes)])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_text(out_dir: Path, name: str, lines: list[str]) -> str:
    """Markdown lines into out_dir/name (the folder made if missing), printed too; returns the text."""
    text = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(text)
    print(text)
    return text


def write_json(path: Path, payload: dict[str, Any], indent: int = 2) -> None:
    """One result as JSON (the folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent) + "\n")


def write_results(name: str, payload: dict[str, Any], markdown: str, out: Path = RESULTS) -> None:
    """NAME.json and NAME.md into ``out``; the Markdown printed too."""
    write_json(out / f"{name}.json", payload)
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def write_or_print(json_path: Path | None, payload: dict[str, Any], markdown: str) -> None:
    """A probe's result: its JSON at ``json_path`` and the Markdown beside it (printed too), or, with
    no path, the Markdown printed only."""
    if json_path is None:
        print(markdown)
    else:
        write_results(json_path.stem, payload, markdown, out=json_path.parent)


def cell(x: float | None, spec: str = ".0f") -> str:
    """A table cell: ``x`` formatted, or ``-`` where it was not measured."""
    return "-" if x is None else format(x, spec)


def ratio_cell(a: float | None, b: float | None, unit: str) -> str:
    """a / b as ``1.23x`` or ``45%``; ``-`` where either was not measured."""
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x" if unit == "x" else f"{a / b:.0%}"
