"""Import layering: no import cycles inside a package, counting imports made inside functions too.

``tests/import_graph.py`` reads the imports; other packages can add themselves to ``PACKAGES``.
Also: packages import only down the layers and never loop, the protocols and the serving layer
import no web framework, the batch runner and the Ray ingress read bodies with the protocols (not the
server's routes), and the engine core and the CLI import without the server's packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.import_graph import ROOT, find_circles, import_graph

# package dirs (relative to the repo root) that must have no cycles
PACKAGES = [
    "prefixserve/entrypoints",
    "prefixserve/protocols",
    "prefixserve/ray_scaleout",
    "prefixserve/serving",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = import_graph([ROOT / package])
    assert len(graph) > 1
    assert find_circles(graph) == [], "import cycles (move the shared code into a module both import)"


# The packages of prefixserve from the bottom up (docs/architecture.md): a module imports only from
# its own layer or those below it. The model and the KV cache know nothing of requests, the
# scheduler nothing of the engine. The serving layer (the engine on a thread or in its own process,
# admission, overload control, the server's upkeep) sits on the engine and below the protocols
# (what a request body means, what an answer looks like): serving decides (refuse, drop, abort a
# stalled stream) and the server says so in HTTP (its 429s are the protocols' APIErrors, built in
# entrypoints/openai/overload_http.py), so serving needs nothing of bodies or answers; below them,
# it cannot come to build an HTTP answer itself. The protocols sit below every entry path;
# the entry points (LLM, batch runner, the HTTP server) on them; the Ray package above the entry
# points, since a Ray Serve replica serves the single server's app and the Ray batch driver runs the
# batch runner's rows. The CLI dispatches to every entry path, Ray's too, so it is the top with
# ``__main__``: a unit of its own here (a dotted name is a module or sub-package placed apart from
# its package). "" is the package's own __init__.
LAYERS = (
    ("config", "triton_support", "detokenizer", "outputs", "pooling_params", "version", "host_copy"),
    ("attention", "sampling"),
    ("model", "sequence"),
    ("kv", "structured"),
    ("promptcache", "scheduler", "worker"),
    ("engine",),
    ("serving",),
    ("protocols",),
    ("entrypoints",),
    ("ray_scaleout",),
    ("entrypoints.cli", "", "__main__"),
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit_of(module: str) -> str:
    """The LAYERS unit of a ``prefixserve.`` module: its longest dotted prefix (after ``prefixserve``)
    that LAYERS names, else its package."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    return parts[0] if parts else ""


def _unit_graph() -> dict[str, set[str]]:
    """{unit: the other units its modules import}."""
    units: dict[str, set[str]] = {}
    for module, targets in import_graph([ROOT / "prefixserve"]).items():
        mine = units.setdefault(_unit_of(module), set())
        mine |= {_unit_of(t) for t in targets} - {_unit_of(module)}
    return units


def test_packages_import_only_their_layer_or_those_below() -> None:
    graph = import_graph([ROOT / "prefixserve"])
    units = {_unit_of(m) for m in graph}
    assert units <= set(RANK), f"add these packages to LAYERS: {sorted(units - set(RANK))}"
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if RANK[_unit_of(target)] > RANK[_unit_of(module)]
    )
    assert upward == [], "imports up the layers (move the shared code down): " + "; ".join(upward)


def test_no_package_loop() -> None:
    """No two units import each other, even on one layer (entrypoints <-> the Ray package was one)."""
    assert find_circles(_unit_graph()) == []


def test_the_batch_runner_and_the_ray_package_import_protocols_not_the_server_routes() -> None:
    """The batch runner and the Ray ingress read bodies with the protocols; only the Ray replica (which
    serves the single server's app) and the Ray ingress's app (CORS) import the server, and then
    only its app assembly, never a route module."""
    graph = import_graph([ROOT / "prefixserve"])
    server = "prefixserve.entrypoints.openai."
    assert not [t for t in graph["prefixserve.entrypoints.batch_runner"] if t.startswith(server)]
    app_assembly = {server + m for m in ("app", "server", "batch_settings", "cors")}
    ray = {m: ts for m, ts in graph.items() if m.startswith("prefixserve.ray_scaleout")}
    assert ray
    from_server = {m: sorted(t for t in ts if t.startswith(server)) for m, ts in ray.items()}
    assert {t for ts in from_server.values() for t in ts} <= app_assembly, from_server
    users = {m for m, ts in from_server.items() if ts}
    assert users <= {"prefixserve.ray_scaleout.serve_replica", "prefixserve.ray_scaleout.serve_app"}, users
    routing = ("serve_ingress", "serve_objects", "router", "serve_metrics")
    for name in routing:
        entry = [
            t for t in ray[f"prefixserve.ray_scaleout.{name}"] if t.startswith("prefixserve.entrypoints")
        ]
        assert entry == [], f"the Ray ingress's {name} imports the entry points: {entry}"


WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn")


def _assert_no_web_framework(package: str, min_modules: int) -> None:
    """Read statically (function-level and ``TYPE_CHECKING`` imports too), and at run time: every
    module of ``prefixserve.<package>`` imports with FastAPI, starlette and uvicorn blocked."""
    found = []
    for path in sorted((ROOT / "prefixserve" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in WEB_FRAMEWORKS]
    assert found == []
    code = textwrap.dedent(
        f"""
        import importlib, importlib.abc, pkgutil, sys
        BLOCKED = {WEB_FRAMEWORKS!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked: {{name}}")

        sys.meta_path.insert(0, Block())
        package = importlib.import_module("prefixserve.{package}")
        modules = [m.name for m in pkgutil.walk_packages(package.__path__, "prefixserve.{package}.")]
        for name in modules:
            importlib.import_module(name)
        print(len(modules), sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.strip().split(" ", 1)
    assert int(count) >= min_modules and loaded == "[]"


def test_protocols_never_import_a_web_framework() -> None:
    _assert_no_web_framework("protocols", 11)


def test_serving_never_imports_a_web_framework() -> None:
    """The engine thread and process, admission and overload control run under the HTTP server and
    the Ray replicas but know no web framework: what is HTTP stays in entrypoints/openai/."""
    _assert_no_web_framework("serving", 8)


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
