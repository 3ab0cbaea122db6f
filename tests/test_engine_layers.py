"""Data flows one way: the engine's loop imports the device worker, never the reverse.

The model runner (and the CUDA graphs it drives, and tensor parallelism's runner and workers: all of
``prefixserve/worker``) take host arrays and return sampled token ids; they must not learn about
requests, sequences, the scheduler or outputs, or import the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "prefixserve" / "worker"
FORBIDDEN = (
    "prefixserve.engine",
    "prefixserve.sequence",
    "prefixserve.scheduler",
    "prefixserve.outputs",
    "prefixserve.protocols",
    "prefixserve.entrypoints",
    "prefixserve.ray_scaleout",
)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("module", sorted(p.name for p in WORKER.glob("*.py")))
def test_the_device_side_knows_nothing_of_requests_or_the_loop(module: str) -> None:
    bad = sorted(m for m in _imports(WORKER / module) if m.startswith(FORBIDDEN))
    assert bad == [], f"{module} imports {bad}"


def test_the_package_reexports_what_callers_import() -> None:
    from prefixserve.engine import PLACEHOLDER_TOKEN, Engine, SystemPromptKV
    from prefixserve.worker.model_runner import ModelRunner

    assert Engine.__module__ == "prefixserve.engine.llm_engine"
    assert SystemPromptKV.__module__ == "prefixserve.engine.system_prompts"
    assert PLACEHOLDER_TOKEN < 0 and ModelRunner.__module__ == "prefixserve.worker.model_runner"
