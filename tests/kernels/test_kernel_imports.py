"""Imports inside prefixserve/attention go one way: no cycle, and the planning and kernel modules and the
Triton backends follow the layer order written in the attention package docstring. Module-level and
function-level imports both count (a function-level import is a cycle put off, not removed). Parses the
source; imports nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ATTENTION = ROOT / "prefixserve" / "attention"
KERNELS = ATTENTION / "kernels"
PLANNING = ATTENTION / "planning"
PACKAGE = "prefixserve.attention"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str], own: str = "") -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in its body (``from pkg import mod``
    counts as importing ``pkg.mod`` when that is a module, else as importing ``pkg``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            names = [n for n in names[:-1] if n in modules] or [node.module]
        else:
            continue
        found |= {n for n in names if n in modules}
    found.discard(own)
    return found


def _graph() -> dict[str, set[str]]:
    paths = sorted(ATTENTION.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules, _module_name(p)) for p in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_the_attention_package() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_kernel_modules_follow_the_documented_layer_order() -> None:
    doc = ast.get_docstring(ast.parse((ATTENTION / "__init__.py").read_text())) or ""
    chain = re.search(r"planning\.plan\s*<.*?triton_backend", doc, re.S)
    assert chain, "the attention package docstring must give the layer order"
    order = [name.strip() for name in chain.group(0).split("<")]
    files = [p for d in (KERNELS, PLANNING) for p in d.glob("*.py") if p.stem != "__init__"]
    subpackages = sorted(f"{p.parent.name}.{p.stem}" for p in files)
    named = sorted(n for n in order if n.split(".")[0] in ("kernels", "planning"))
    assert named == subpackages, "every planning and kernel module appears in the layer order, once"
    assert len(set(order)) == len(order), "a module appears in the layer order once"
    missing = [n for n in order if not (ATTENTION / f"{n.replace('.', '/')}.py").is_file()]
    assert not missing, f"the layer order names modules that do not exist: {missing}"
    rank = {f"{PACKAGE}.{name}": i for i, name in enumerate(order)}
    graph = _graph()
    upward = []
    for module, i in rank.items():
        for imported in graph[module]:
            if imported in rank and rank[imported] >= i:
                upward.append(f"{module} imports {imported}")
    assert not upward, upward


def test_kernel_modules_define_a_kernel() -> None:
    """Files in kernels/ are kernels: each defines a ``@triton.jit`` / ``@gluon.jit`` function (host
    planning lives in planning/, the backends' launch code in the attention package)."""
    plain = [
        p.name
        for p in sorted(KERNELS.glob("*.py"))
        if p.stem != "__init__" and not re.search(r"@(triton|gluon)\.jit\b", p.read_text())
    ]
    assert not plain, f"modules in kernels/ without a kernel: {plain}"


def test_the_cycle_check_sees_function_level_imports(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by an import inside a function is found."""
    graph = {"a": {"b"}, "b": set()}
    assert _cycle(graph) is None
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from prefixserve.attention.kernels import merge\n")
    assert _imports(src, {f"{PACKAGE}.kernels.merge"}) == {f"{PACKAGE}.kernels.merge"}
    graph["b"] = {"a"}
    assert _cycle(graph) == ["a", "b", "a"]
