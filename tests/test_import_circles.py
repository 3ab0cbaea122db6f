"""No import circle anywhere in the repository, and no module over 600 lines.

One graph over every module of ``prefixserve/`` and ``benchmarks/`` together (a circle may cross
the two), read statically from the source: module-level, function-level and ``TYPE_CHECKING``
imports all count, since a circle that only closes inside a function still ties the two modules
together. A module that grows past 600 lines has taken on a second job; split it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prefixserve", "benchmarks")
MAX_LINES = 600
KNOWN_LONG: set[str] = set()  # none: every module is under MAX_LINES


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def import_graph(package_dirs: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the modules (of any of ``package_dirs``) it imports anywhere in its file}."""
    files = {
        _module_name(p, root): p
        for d in package_dirs
        for p in sorted(d.rglob("*.py"))
        if "__pycache__" not in p.parts
    }
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" for alias in node.names]
            for target in targets:
                found = _resolve(target, modules)
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    u = stack.pop()
                    on_stack.discard(u)
                    component.append(u)
                    if u == v:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


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
