"""No import circle anywhere in the repository, and no module over 600 lines.

One graph over every module of ``prefixserve/`` and ``benchmarks/`` together (a circle may cross
the two), read statically from the source: module-level, function-level and ``TYPE_CHECKING``
imports all count, since a circle that only closes inside a function still ties the two modules
together. A module that grows past 600 lines has taken on a second job; split it.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import ROOT, find_circles, import_graph

PACKAGES = ("prefixserve", "benchmarks")
MAX_LINES = 600
KNOWN_LONG: set[str] = set()  # none: every module is under MAX_LINES


def test_no_import_circle_in_the_repository() -> None:
    graph = import_graph([ROOT / p for p in PACKAGES])
    assert any(m.startswith("benchmarks.") for m in graph) and any(
        m.startswith("prefixserve.") for m in graph
    )
    circles = find_circles(graph)
    assert circles == [], "import circles (move the shared code into a module both import): " + "; ".join(
        " <-> ".join(c) for c in circles
    )


def test_the_circle_finder_sees_function_level_imports_across_packages(tmp_path: Path) -> None:
    for pkg in ("a", "b"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "a" / "x.py").write_text("from b import y\n")
    (tmp_path / "b" / "y.py").write_text("def f():\n    from . import z\n")
    (tmp_path / "b" / "z.py").write_text("import a.x\n")
    graph = import_graph([tmp_path / "a", tmp_path / "b"], tmp_path)
    assert find_circles(graph) == [["a.x", "b.y", "b.z"]]
    (tmp_path / "b" / "z.py").write_text("")
    assert find_circles(import_graph([tmp_path / "a", tmp_path / "b"], tmp_path)) == []


def test_no_module_over_600_lines() -> None:
    long = {
        p.relative_to(ROOT).as_posix(): n
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert set(long) <= KNOWN_LONG, f"modules over {MAX_LINES} lines (split them by job): {long}"
