"""benchmarks/throughput.py's report: the attainable step from dense.json, and ``--report`` rewriting a
saved grid's Markdown from its JSON (synthetic runs, no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import throughput

DEVICE = "NVIDIA H200"


def _saved_run(out: Path, fraction: float) -> float:
    """A one-point grid (B=256, P=16K) at ``fraction`` of the attainable step and its dense.json in
    ``out``; returns the attainable tok/s."""
    dense = {"device": DEVICE, "commit": "abc1234", "copy_bandwidth_TBps": 4.27, "gemm_TFLOPs": 686.0}
    dense["rows"] = [{"B": 256, "bare_ms": 7.0}]
    (out / "dense.json").write_text(json.dumps(dense))
    best = throughput.attainable_tok_s(256, 16384, 64, 128, dense, "dummy:llama-3.1-8b")
    row = {"B": 256, "P": 16384, "auto_tok_s": fraction * best}
    row |= {"sharing_off_tok_s": 2900.0, "ceiling_tok_s": 32000.0}
    saved = {
        "device": DEVICE,
        "torch": "2.11.0",
        "commit": "abc1234",
        "date": "2026-11-25 14:30 UTC",
        "model": "dummy:llama-3.1-8b",
        "gen": 128,
        "own": 64,
        "cuda_graphs": True,
        "rows": [row],
        "n8": None,
    }
    (out / "throughput.json").write_text(json.dumps(saved))
    return best


def test_attainable_step_is_bare_matmuls_plus_attention_bound() -> None:
    """B / (bare + 32 layers x max(bytes / bandwidth, FLOPs / GEMM rate)) for Llama-3.1-8B's shapes."""
    dense = {"copy_bandwidth_TBps": 4.0, "gemm_TFLOPs": 500.0, "rows": [{"B": 64, "bare_ms": 4.0}]}
    s = 64 + 128 / 2  # the mean own length over the decode
    bytes_ms = (1024 + 64 * s) * (2 * 8 * 128 * 2) / 4e12 * 1e3
    flops_ms = 4 * 64 * 32 * 128 * (1024 + s) / 500e12 * 1e3
    want = 64 / (4.0 + 32 * max(bytes_ms, flops_ms)) * 1e3
    assert throughput.attainable_tok_s(64, 1024, 64, 128, dense, "dummy:llama-3.1-8b") == pytest.approx(want)
    assert throughput.attainable_tok_s(256, 1024, 64, 128, dense, "dummy:llama-3.1-8b") is None  # no bare row


def test_report_rewrites_markdown_from_saved_json(tmp_path, monkeypatch) -> None:
    """``--report`` keeps the saved run's device, date and commit, and prints the fraction to three
    places, so a point just under 0.8 never reads as 80%."""
    best = _saved_run(tmp_path, fraction=0.7987)
    monkeypatch.setattr(throughput, "plot", lambda payload, out: None)  # no matplotlib needed
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--report", "--out", str(tmp_path)])
    throughput.main()
    md = (tmp_path / "throughput.md").read_text()
    assert "NVIDIA H200; torch 2.11.0; commit abc1234; 2026-11-25 14:30 UTC" in md
    cells = next(line for line in md.splitlines() if line.startswith("| 256 | 16384 |")).split(" | ")
    assert cells[7] == "0.799"  # the fraction column: three places, not a rounded percentage
    again = json.loads((tmp_path / "throughput.json").read_text())
    assert again["commit"] == "abc1234" and again["rows"][0]["attainable_tok_s"] == pytest.approx(best)
