"""Kernel tests: on a machine without CUDA the Triton kernels run in the CPU interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, so it is set here, at collection
time. With a GPU the same tests run compiled on CUDA tensors, and the ``gpu``-marked ones run too.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # without the optional Triton package there is nothing to test here
    import triton  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
