"""Import layering: no import cycles inside a package, counting imports made inside functions too.

``tests/import_graph.py`` reads the imports; other packages can add themselves to ``PACKAGES``.
Also: packages import only down the layers, and the engine core and the CLI import without the
server's packages.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.import_graph import ROOT, find_circles, import_graph

PACKAGES = ["prefixserve/entrypoints"]  # package dirs (relative to the repo root) that must have no cycles


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = import_graph([ROOT / package])
    assert len(graph) > 1
    assert find_circles(graph) == [], "import cycles (move the shared code into a module both import)"


# The packages of prefixserve from the bottom up (DESIGN.md "The house"): a module imports only from
# its own layer or those below it. The model and the KV cache know nothing of requests, the
# scheduler nothing of the engine; only entrypoints (and the Ray batch driver beside them, which
# runs the batch runner's rows in Ray actors) see the engine. "" is the package's own __init__.
LAYERS = (
    ("config", "triton_support", "detokenizer", "outputs", "pooling_params", "version"),
    ("attention", "sampling"),
    ("model", "sequence"),
    ("kv", "structured"),
    ("promptcache", "scheduler", "worker"),
    ("engine",),
    ("serving",),
    ("distributed", "entrypoints"),
    ("", "__main__"),
)


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_import_only_their_layer_or_those_below() -> None:
    rank = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    graph = import_graph([ROOT / "prefixserve"])
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
    graph = import_graph([pkg], tmp_path)
    assert graph["pkg.b"] == {"pkg.c"}
    assert find_circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("")
    assert find_circles(import_graph([pkg], tmp_path)) == []


def test_the_core_and_the_cli_import_without_the_server_packages() -> None:
    """The engine core needs only torch, triton, transformers, gguf, numpy, safetensors, tqdm, rich
    (defusedxml: at the first PML document; xgrammar: at the first structured-outputs request)."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        BLOCKED = {"fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "defusedxml",
                   "xgrammar"}

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
