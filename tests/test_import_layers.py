"""Import layering: no import cycles inside a package, counting imports made inside functions too.

``import_graph`` and ``find_cycles`` take any package directory, so other packages can add
themselves to ``PACKAGES``. Also: the engine core and the CLI import without the server's packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["prefixserve/entrypoints"]  # package dirs (relative to the repo root) that must have no cycles


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of ``modules`` (importing a.b.c runs a.b.c)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def import_graph(package_dir: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """{module: modules of ``package_dir`` it imports}, from every import statement anywhere in the file.

    Module-level, function-level and ``TYPE_CHECKING`` imports all count; relative imports are
    resolved; ``from pkg import name`` points at ``pkg.name`` when that is a module of the package.
    """
    files = {_module_name(p, root.resolve()): p for p in sorted(package_dir.resolve().rglob("*.py"))}
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


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = import_graph(ROOT / package)
    assert len(graph) > 1
    assert find_cycles(graph) == [], "import cycles (move the shared code into a module both import)"


# The packages of prefixserve from the bottom up (DESIGN.md "The house"): a module imports only from
# its own layer or those below it. The model and the KV cache know nothing of requests, the
# scheduler nothing of the engine; only entrypoints (and the Ray batch driver beside them, which
# runs the batch runner's rows in Ray actors) see the engine. "" is the package's own __init__.
LAYERS = (
    ("config", "triton_support", "detokenizer", "outputs"),
    ("attention", "sampling"),
    ("model", "sequence"),
    ("kv",),
    ("promptcache", "scheduler"),
    ("engine",),
    ("distributed", "entrypoints"),
    ("", "__main__"),
)


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_import_only_their_layer_or_those_below() -> None:
    rank = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    graph = import_graph(ROOT / "prefixserve")
    packages = {_package_of(m) for m in graph}
    assert packages <= set(rank), f"add these packages to LAYERS: {sorted(packages - set(rank))}"
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if rank[_package_of(target)] > rank[_package_of(module)]
    )
    assert upward == [], "imports up the layers (move the shared code down): " + "; ".join(upward)


def test_the_cycle_finder_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n    return g\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.a import x\n")  # into the cycle, not part of it
    graph = import_graph(pkg, tmp_path)
    assert graph["pkg.b"] == {"pkg.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("")
    assert find_cycles(import_graph(pkg, tmp_path)) == []


def test_the_core_and_the_cli_import_without_the_server_packages() -> None:
    """The engine core needs only torch, triton, transformers, gguf, numpy, safetensors, tqdm, rich
    (defusedxml: at the first PML document)."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        BLOCKED = {"fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "defusedxml"}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked: {name}")

        sys.meta_path.insert(0, Block())
        import prefixserve.engine, prefixserve.entrypoints.llm, prefixserve.entrypoints.cli as cli
        try:
            cli.main(["serve", "--help"])
        except SystemExit as exc:
            assert exc.code == 0
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok []")
