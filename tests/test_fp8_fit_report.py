"""The FP8 fit benchmark's report: each grid point's on / off ratio from its two runs, and a point cut
short (only one mode measured) shown with dashes rather than dropped or failing."""

from __future__ import annotations

from pathlib import Path

from benchmarks.fp8_fit import report


def _mode(tok_s: float, batch: int) -> dict:
    return {"tok_s": tok_s, "step_ms": 1e3 * batch / tok_s, "kv_blocks_used_peak": 10, "preemptions": 0}


def test_report_has_each_points_ratio_and_dashes_for_a_run_cut_short(tmp_path: Path) -> None:
    result = {
        "device": "NVIDIA H200",
        "torch": "2.11",
        "commit": "abc1234",
        "date": "2026-12-01",
        "bf16_weights_GiB": 131.4,
        "settings": {"model": "dummy:llama-3.1-70b", "own": 64, "gen": 64, "serve_prompt_len": 128},
        "grids": [
            {
                "weights": "fp8",
                "engines": {"on": {"weights_GiB": 67.7, "kv_blocks": 12446, "load_s": 29.0}},
                "points": [
                    {
                        "B": 256,
                        "P": 16384,
                        "on": _mode(4000.0, 256),
                        "off": _mode(1000.0, 256),
                        "on_over_off": 4.0,
                    },
                    {"B": 64, "P": 1024, "on": _mode(2400.0, 64)},
                ],
            }
        ],
        "serve": {"B": 64, "start_s": 93.0, "wall_s": 2.0, "completion_tokens": 4096, "tok_s": 2048.0},
    }
    report(result, tmp_path)
    md = (tmp_path / "fp8_fit.md").read_text()
    assert "| 256 | 16,384 | 4,000 | 64.0 | 1,000 | 256.0 | 4.00x | 0 |" in md
    assert "| 64 | 1,024 | 2,400 | 26.7 | - | - | - | 0 |" in md
    assert "**2,048 tok/s**" in md
