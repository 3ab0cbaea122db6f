"""benchmarks/power.py arithmetic and reports, and attention.md's power section, on synthetic runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import attention, attention_report, power


def _state(ms: float, mhz: float, watts: float, capped: bool) -> dict:
    return {
        "ms": ms,
        "samples": 40,
        "sm_mhz": mhz,
        "sm_mhz_min": mhz - 100,
        "power_w": watts,
        "limit_w": 700.0,
        "temp_c": 50.0,
        "reasons": ["power cap"] if capped else [],
    }


def _power_run() -> dict:
    floor = 150.0
    ceil = {
        "idle": _state(0, 345, 80, False),
        "copy": {**_state(1.0, 1980, 600, False), "TBps": 4.25, "burst_TBps": 4.25},
        "read": {**_state(0.5, 1980, 610, False), "TBps": 4.3},
        "gemm": {**_state(1.6, 1500, 670, True), "TFLOPs": 660.0, "burst_TFLOPs": 690.0},
        "spin": _state(0.5, 1980, floor, False),
        "model": {
            "floor_w": floor,
            "cap_w": 700.0,
            "j_per_byte": 1e-10,
            "j_per_byte_read": 1e-10,
            "j_per_flop": 8e-13,
        },
    }
    rows = []
    for (b, p, s), back_ms, back_w in (((256, 16384, 512), 0.2, 690.0), ((1024, 1024, 128), 0.185, 600.0)):
        nbytes, flops = power.counted(b, p, s)
        rows.append(
            {
                "B": b,
                "P": p,
                "S": s,
                "bytes": nbytes,
                "flops": flops,
                "burst": _state(back_ms * 0.9, 1900, 450, True),
                "call": _state(back_ms, 1500, back_w, back_w > 650),
                "parts": {"mixed": _state(back_ms * 0.95, 1500, back_w, False)},
            }
        )
    return {
        "device": "test",
        "torch": "x",
        "triton": "y",
        "commit": "abc",
        "date": "today",
        "window_s": 1.0,
        "ceilings": ceil,
        "rows": rows,
    }


def test_counted_matches_the_attention_benchmarks_roofline() -> None:
    case = attention.Case.__new__(attention.Case)
    case.B, case.P, case.S = 256, 16384, 512
    case.hq, case.hkv = attention.HQ, attention.HKV  # the grid's heads, as power.counted counts them
    nbytes, flops = power.counted(256, 16384, 512)
    bytes_ms, flops_ms = case.roofline(1.0, 1.0)  # 1 TB/s and 1 TFLOP/s: ms = bytes / 1e9
    assert nbytes / 1e9 == pytest.approx(bytes_ms)
    assert flops / 1e9 == pytest.approx(flops_ms)


def test_bounds_energy_and_power_time() -> None:
    run = _power_run()
    row = run["rows"][0]
    bd = power.bounds(row, run["ceilings"])
    model_mj = (1e-10 * row["bytes"] + 8e-13 * row["flops"]) * 1e3
    assert bd["model_mj"] == pytest.approx(model_mj)
    assert bd["power_ms"] == pytest.approx(model_mj / 550.0)
    assert bd["measured_mj"] == pytest.approx((690 - 150) * 0.2)
    assert bd["memory"] and bd["need"] == pytest.approx(bd["t_star"] / 0.8)


def test_sampler_window_medians_and_reasons() -> None:
    s = power.Sampler.__new__(power.Sampler)
    s.rows = [
        (1.0, ["1980", "300.5", "700.00", "0x0000000000000000", "40"]),
        (2.0, ["1500", "690.0", "700.00", "0x0000000000000004", "55"]),
        (3.0, ["1400", "695.0", "700.00", "0x0000000000000004", "56"]),
        (9.0, ["345", "80.0", "700.00", "0x0000000000000001", "39"]),  # outside the window
        (2.5, ["[N/A]", "690.0", "700.00", "junk", "55"]),  # unreadable fields are skipped
    ]
    w = s.window(0.5, 5.0)
    assert w["samples"] == 4
    assert w["sm_mhz"] == 1500 and w["sm_mhz_min"] == 1400
    assert w["power_w"] == 690.0
    assert w["reasons"] == ["power cap"]


def test_reports_are_written(tmp_path: Path) -> None:
    run = _power_run()
    power.report(run, tmp_path)
    text = (tmp_path / "power.md").read_text()
    assert "| 256 | 16384 | 512 | bytes |" in text and "power cap" in text


def test_attention_report_names_points_over_the_power_limit(tmp_path: Path) -> None:
    (tmp_path / "power.json").write_text(json.dumps(_power_run()))
    rows = []
    for b, p, s, shared in ((256, 16384, 512, 0.19), (1024, 1024, 128, 0.19)):
        bytes_ms = power.counted(b, p, s)[0] / 4.25e9
        flops_ms = power.counted(b, p, s)[1] / 690e9
        rows.append(
            {
                "B": b,
                "P": p,
                "S": s,
                "shared_ms": shared,
                "bytes_ms": bytes_ms,
                "flops_ms": flops_ms,
                "roofline_ms": max(bytes_ms, flops_ms),
            }
        )
    lines = attention_report.power_lines({"rows": rows}, tmp_path)
    text = "\n".join(lines)
    # 540 W x 0.2 ms = 108 mJ in 0.179 ms needs about 750 W: over; 450 W x 0.185 ms in 0.164 ms: under
    over = next(x for x in lines if "more than the 700 W limit" in x)
    assert "B=256, P=16384, S=512" in over and "B=1024, P=1024, S=128" not in over.split(":")[0]
    assert "B=1024, P=1024, S=128: within the limit" in text
    assert attention_report.power_lines({"rows": rows}, tmp_path / "missing") == []
