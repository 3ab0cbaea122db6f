"""Shared helpers of the kernel tests (conftest.py has set TRITON_INTERPRET where needed)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def paged_cache(
    seq_lens: list[int],
    block_size: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare: int = 3,
    device: torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random K/V caches and shuffled block tables (one table per sequence, no block reused)."""
    need = sum(math.ceil(s / block_size) for s in seq_lens) + spare
    k = torch.randn(need, block_size, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(need, block_size, kv_heads, dim, generator=gen).to(device, dtype)
    perm = torch.randperm(need, generator=gen).tolist()
    tables, at = [], 0
    for s in seq_lens:
        n = math.ceil(s / block_size)
        tables.append(perm[at : at + n])
        at += n
    return k, v, tables


def padded_table(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """The tables as one [S, width] int32 block table (zeros past a table's end; width: the longest)."""
    width = max(len(t) for t in tables) if width is None else width
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)


def e4m3_cache(
    seq_lens: list[int], block_size: int, kv_heads: int, dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], torch.Tensor]:
    """``paged_cache``'s K / V as e4m3 codes (of N(0, 1) values: no NaN code), their tables and the
    padded block table."""
    k, v, tables = paged_cache(seq_lens, block_size, kv_heads, dim, torch.float32, gen)
    return k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), tables, padded_table(tables)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; NaN (an unwritten, poisoned row) fails every comparison."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def compiled_for_hopper(script: str, *args: str, **env: str) -> list[dict]:
    """Run ``script`` (beside this file: it compiles kernels for sm_90 with the real compiler and
    prints one JSON line each) in a process without ``TRITON_INTERPRET``; its lines, parsed. Skips
    where Triton's wheel has no ptxas."""
    here = Path(__file__).resolve()
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ["PYTHONPATH"] = os.pathsep.join([str(here.parents[2]), environ.get("PYTHONPATH", "")])
    environ.update(env)
    run = subprocess.run(
        [sys.executable, str(here.with_name(script)), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # a wheel without ptxas: the compiler cannot find its binary (a compile error that merely passes
    # through ``_ptxas``'s hook is a failure, not a skip)
    if run.returncode and "ptxas" in run.stderr.lower() and "CompilationError" not in run.stderr:
        pytest.skip(run.stderr[-500:])  # pragma: no cover
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


class CountedCalls:
    """Wraps ``module.name`` (a kernel's launcher) for the test, counting its calls: which kernel a
    step took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> None:
        self.calls = 0
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
