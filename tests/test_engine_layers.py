"""The engine package's data flows one way: the loop imports the runner, never the reverse.

The model runner (and the CUDA graphs it drives) take host arrays and return sampled token ids; they
must not learn about requests, sequences, the scheduler or outputs, or import the loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "prefixserve" / "engine"
FORBIDDEN = (
    "prefixserve.engine.llm_engine",
    "prefixserve.engine.output_processor",
    "prefixserve.engine.system_prompts",
    "prefixserve.sequence",
    "prefixserve.scheduler",
    "prefixserve.outputs",
    "prefixserve.entrypoints",
)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("module", ["model_runner.py", "cuda_graph.py"])
def test_the_device_side_knows_nothing_of_requests_or_the_loop(module: str) -> None:
    bad = sorted(m for m in _imports(ENGINE / module) if m.startswith(FORBIDDEN))
    assert bad == [], f"{module} imports {bad}"


def test_the_package_reexports_what_callers_import() -> None:
    from prefixserve.engine import PLACEHOLDER_TOKEN, Engine, SystemPromptKV
    from prefixserve.engine.model_runner import ModelRunner

    assert Engine.__module__ == "prefixserve.engine.llm_engine"
    assert SystemPromptKV.__module__ == "prefixserve.engine.system_prompts"
    assert PLACEHOLDER_TOKEN < 0 and ModelRunner.__module__ == "prefixserve.engine.model_runner"
