"""Triton compiles counted and, once serving, logged; step lists packed at aligned starts."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixserve.attention.planning.step_plan import to_device_packed
from prefixserve.triton_support import compile_watch
from tests.conftest import tiny_cascade_llm

knobs = pytest.importorskip("triton").knobs


class _Fn:
    name = "_paged_kernel"


def _compile(key: object) -> None:
    """What Triton's ``_do_compile`` calls around one compile."""
    runtime = knobs.runtime
    assert runtime.jit_cache_hook(key=key, repr="r", fn=_Fn(), compile={}, is_manual_warmup=False,
                                  already_compiled=False) is None  # fmt: skip
    runtime.jit_post_compile_hook(key=key, repr=f"_paged_kernel(q_tiles: i32) {key}", fn=_Fn(),
                                  compile={}, is_manual_warmup=False, already_compiled=False)  # fmt: skip


def test_compiles_counted_then_logged_while_serving(monkeypatch, caplog) -> None:
    """Every compile counts with its seconds; after ``serving`` each is logged and counted apart; a hook
    installed before ours still runs."""
    earlier: list[object] = []
    monkeypatch.setattr(compile_watch, "_installed", False)
    monkeypatch.setattr(compile_watch, "WATCH", compile_watch.CompileWatch())
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda key, **kw: earlier.append(key))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = compile_watch.watch()
    assert compile_watch.watch() is watch  # installed once
    caplog.set_level(logging.INFO, logger=compile_watch.__name__)
    _compile(("a", 1))
    assert watch.metrics()["kernel_compiles_total"] == 1
    assert watch.metrics()["kernel_compiles_serving_total"] == 0 and not caplog.records
    watch.serving()
    _compile(["unhashable", "key"])
    m = watch.metrics()
    assert m["kernel_compiles_total"] == 2 and m["kernel_compiles_serving_total"] == 1
    assert m["kernel_compile_seconds_total"] >= m["kernel_compile_serving_seconds_total"] >= 0
    assert earlier == [("a", 1), ["unhashable", "key"]]
    (record,) = caplog.records
    assert "compiled kernel _paged_kernel while serving" in record.getMessage()
    assert "unhashable" in record.getMessage()


def test_engine_reports_compiles_and_serves_after_capture(tiny_config_path: Path) -> None:
    """The engine's metrics carry the process's compiles; ``capture_graphs`` marks the start of serving."""
    llm = tiny_cascade_llm(tiny_config_path, async_scheduling=False)
    m = llm.engine.metrics()
    for key in ("kernel_compiles_total", "kernel_compile_seconds_total", "kernel_compiles_serving_total"):
        assert key in m
    llm.engine.capture_graphs()
    assert llm.engine.stats.compiles.is_serving


@pytest.mark.parametrize("sizes", [[3, 5, 0, 2], [4, 8], [1], [], [7, 1, 1, 9]])
def test_packed_step_lists_start_aligned(sizes: list[int]) -> None:
    """Each array of a packed upload starts 16-byte aligned (Triton specialises pointers on it) and
    holds its values."""
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(-5, 1000, size=n) for n in sizes]
    views = to_device_packed(arrays, torch.device("cpu"))
    assert len(views) == len(arrays)
    for a, v in zip(arrays, views, strict=True):
        assert v.dtype == torch.int32 and v.storage_offset() % 4 == 0
        assert v.tolist() == a.tolist()
