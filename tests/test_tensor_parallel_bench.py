"""``benchmarks/tensor_parallel.py``'s result files: each part keeps the run that wrote it, and
``--merge`` takes parts of another file with their runs (no GPU, no measuring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import tensor_parallel as tp
from benchmarks.tensor_parallel import markdown
from benchmarks.tensor_parallel_files import merge_cells, stamp_cells

GRID_ROW = {
    "B": 256, "P": 16384, "tp": 2, "max_batched_tokens": 1024, "auto_tok_s": 5238.0,
    "sharing_off_tok_s": 1850.0, "ceiling_tok_s": 7098.0, "auto_preemptions": 0,
    "sharing_off_preemptions": 2, "ceiling_preemptions": 0,
}  # fmt: skip
COMPARE_ROW = {"B": 256, "P": 1024, "tp1_tok_s": 24669.0, "tp2_tok_s": 39970.0, "tp2_nccl_tok_s": 31183.0}


def _file(
    path: Path, commit: str, device: str = "GPU-X", date: str = "2026-11-26 00:00 UTC", **parts: object
) -> Path:
    """A result file as a run before per-part runs wrote it: one run's keys at the top."""
    info = {"device": device, "gpus": 2, "torch": "2.x", "commit": commit, "date": date}
    payload = {**info, "model": "dummy:llama-3.1-70b", "compare_model": "dummy:llama-3.1-8b", "own": 64}
    payload.update({"gen": 128, "tensor_parallel_size": 2, "grid": [], "compare": [], "allreduce": {}})
    payload.update(parts)
    path.write_text(json.dumps(payload))
    return path


def test_merge_keeps_each_parts_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _file(out / "tensor_parallel.json", "aaaaaaa", compare=[COMPARE_ROW])
    other = _file(tmp_path / "other.json", "bbbbbbb", grid=[GRID_ROW], compare=[{"B": 1}])
    tp.main(["--parts", "grid", "--merge", str(other), "--out", str(out)])
    merged = json.loads((out / "tensor_parallel.json").read_text())
    cells = {f"{m}_commit": "bbbbbbb" for m in ("auto", "sharing_off", "ceiling")}  # each cell its run's
    assert merged["grid"] == [{**GRID_ROW, **cells}]
    assert merged["compare"] == [{**COMPARE_ROW, "commit": "aaaaaaa"}]  # compare not taken
    assert merged["runs"]["grid"]["commit"] == "bbbbbbb"
    assert merged["runs"]["compare"]["commit"] == "aaaaaaa"
    md = (out / "tensor_parallel.md").read_text()
    grid_part, compare_part = md.split("TP=1 vs TP=2")
    assert "| bbbbbbb / bbbbbbb / bbbbbbb |" in grid_part and "| aaaaaaa |" in compare_part
    assert "| 2.83x |" in grid_part and "| 1024 | 0 / 2 / 0 |" in grid_part  # step tokens, preemptions


def _result(commit: str, on: float, off: float) -> dict:
    cells = [(b, p) for b in (64, 256) for p in (1024, 16384)]
    rows = [{"B": b, "P": p, "auto_tok_s": on, "sharing_off_tok_s": off} for b, p in cells]
    run = {"device": "GPU", "gpus": 2, "torch": "t", "commit": commit, "date": "d"}
    return {"grid": rows, "runs": {"grid": run}}


def test_a_cell_merge_takes_only_the_named_cells_and_keeps_each_commit() -> None:
    payload, newer = _result("old", 100.0, 50.0), _result("new", 120.0, 40.0)
    stamp_cells(payload)
    stamp_cells(newer)
    merge_cells(payload, newer, {256}, {16384}, ["auto"])
    cells = {(r["B"], r["P"]): r for r in payload["grid"]}
    assert cells[256, 16384]["auto_tok_s"] == 120.0 and cells[256, 16384]["auto_commit"] == "new"
    assert cells[256, 16384]["sharing_off_tok_s"] == 50.0 and cells[256, 16384]["sharing_off_commit"] == "old"
    assert all(cells[k]["auto_commit"] == "old" for k in cells if k != (256, 16384))
    payload.update(tensor_parallel_size=2, own=64, gen=128, model="m", compare=[], allreduce={})
    assert "| 256 | 16384 | 120 | 50 |" in markdown(payload) and "new / old / -" in markdown(payload)


def _grid_file(path: Path, device: str, date: str, row: dict, power: dict | None = None) -> Path:
    """A result file whose grid part names its run (``runs``), with that run's power ceilings."""
    run = {"device": device, "gpus": 2, "torch": "2.x", "commit": "ccccccc", "date": date}
    return _file(path, "ccccccc", device, date, grid=[row], runs={"grid": run}, power=power or {})


def _merge_cell_args(other: Path, out: Path) -> list[str]:
    """--merge of the grid cell B=256, P=16K from ``other`` into ``out``'s file."""
    return [
        "--parts",
        "grid",
        "--batches",
        "256",
        "--prefixes",
        "16384",
        "--merge",
        str(other),
        "--out",
        str(out),
    ]


def test_a_merge_refuses_cells_of_another_kind_of_machine(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _grid_file(out / "tensor_parallel.json", "GPU-H200", "2026-11-27 10:00 UTC", {**GRID_ROW, "B": 64})
    before = (out / "tensor_parallel.json").read_text()
    other = _grid_file(tmp_path / "other.json", "GPU-H100", "2026-11-27 11:00 UTC", GRID_ROW)
    with pytest.raises(SystemExit, match="ran on GPU-H100 x 2, this file's on GPU-H200 x 2"):
        tp.main(_merge_cell_args(other, out))
    assert (out / "tensor_parallel.json").read_text() == before  # nothing written


def test_a_cell_merge_takes_the_power_ceilings_only_with_measured_boards(tmp_path: Path) -> None:
    """A merged file's ceilings describe its own --power run: cells merged without boards leave this
    file's ceilings (and its later run date) in place."""
    out = tmp_path / "out"
    out.mkdir()
    model = {"j_per_byte_read": 100e-12, "j_per_flop": 1e-12, "floor_w": 150.0, "cap_w": 700.0}
    mine = {"commit": "mine", "device": "GPU", "ceilings": {"model": model}}
    _grid_file(out / "tensor_parallel.json", "GPU", "2026-11-27 12:00 UTC", {**GRID_ROW, "B": 64}, mine)
    theirs = {"commit": "theirs", "device": "GPU", "ceilings": {"model": model}}
    other = _grid_file(tmp_path / "o.json", "GPU", "2026-11-27 11:00 UTC", GRID_ROW, theirs)
    args = _merge_cell_args(other, out)
    tp.main(args)
    merged = json.loads((out / "tensor_parallel.json").read_text())
    assert [r["B"] for r in merged["grid"]] == [64, 256]
    assert merged["power"]["commit"] == "mine" and merged["runs"]["grid"]["date"] == "2026-11-27 12:00 UTC"
    boards = {**GRID_ROW, "auto_boards": [_board(690, 1500)] * 2}
    _grid_file(other, "GPU", "2026-11-27 13:00 UTC", boards, theirs)
    tp.main(args)
    merged = json.loads((out / "tensor_parallel.json").read_text())
    assert merged["power"]["commit"] == "theirs" and merged["runs"]["grid"]["date"] == "2026-11-27 13:00 UTC"


def _board(watts: float, mhz: float) -> dict:
    state = {"samples": 50, "sm_mhz": mhz, "sm_mhz_min": mhz - 100, "power_w": watts, "limit_w": 700.0}
    return {**state, "reasons": []}


def test_the_power_section_shows_each_board_and_the_models_step() -> None:
    model = {"j_per_byte_read": 100e-12, "j_per_flop": 1e-12, "floor_w": 150.0, "cap_w": 700.0}
    row = {**GRID_ROW, "auto_boards": [{**_board(695, 1500), "reasons": ["power cap"]}] * 2}
    row["sharing_off_boards"] = [{**_board(640, 1980), "reasons": []}] * 2
    payload = {"tensor_parallel_size": 2, "own": 64, "gen": 128, "model": "dummy:llama-3.1-70b"}
    payload.update(compare=[], allreduce={}, grid=[row], runs={})
    payload["power"] = {"commit": "ccccccc", "device": "GPU-X", "ceilings": {"model": model}}
    md = markdown(payload)
    on = next(line for line in md.splitlines() if line.startswith("| 256 | 16384 | on |"))
    # one rank of the 70B at B=256, P=16K, 128 own tokens a sequence: 23.3 TFLOP and 77.6 GB,
    # (100 pJ x 77.6 GB + 1 pJ x 23.3 TFLOP) / 550 W = 56.5 ms; the step 256 / 5238 tok/s = 48.9 ms
    assert "| 48.9 | 695 / 695 | 1500 (1400) / 1500 (1400) | power cap | 23.3 | 77.6 | 56.5 | 0.86x |" in on
    off = next(line for line in md.splitlines() if line.startswith("| 256 | 16384 | off |"))
    # no throttle reason, and no count: what L2 serves of the off step's KV reads is not known
    assert off.endswith("| 640 / 640 | 1980 (1880) / 1980 (1880) | - | - | - | - | - |")
    assert "3x on/off needs the sharing-on step at 46.1 ms or less" in md  # 256 / 1850 / 3
    del payload["power"]
    assert "Power during" not in markdown(payload)  # cells without a run's ceilings: no section


def test_step_work_counts_a_rank_of_a_small_model_by_hand() -> None:
    from benchmarks.harness.step_work import capped_step_ms, decode_step_work

    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg.update(head_dim=2, intermediate_size=16, vocab_size=10)
    # a layer: q 8x8, k and v 8x4 each, o 8x8, gate, up and down 8x16 each = 576; lm_head 80
    params = (2 * 576 + 80) / 2
    dense = decode_step_work(cfg, 2, batch=3, prefix=5, own=2, attention=False)
    assert dense == {"flops": 2 * 3 * params, "bytes": 2 * params}
    full = decode_step_work(cfg, 2, batch=3, prefix=5, own=2)
    # 4 x B x the rank's q heads x dim x keys x layers
    assert full["flops"] == dense["flops"] + 4 * 3 * 2 * 2 * (5 + 2) * 2
    assert full["bytes"] == dense["bytes"] + 4 * 2 * 1 * 2 * (5 + 3 * 2)  # prefix once, each own part once
    # four ranks over two KV heads: each rank holds one head's replica
    kv_bytes = decode_step_work(cfg, 4, 3, 5, 2)["bytes"] - decode_step_work(cfg, 4, 3, 5, 2, False)["bytes"]
    assert kv_bytes == 4 * 2 * 2 * 11
    model = {"j_per_byte_read": 1.0, "j_per_flop": 0.0, "floor_w": 100.0, "cap_w": 600.0}
    assert capped_step_ms({"flops": 7.0, "bytes": 1.0}, model) == 1e3 / 500


def test_the_compare_shows_each_runs_boards() -> None:
    row = {**COMPARE_ROW, "tp1_boards": [{**_board(690, 1600), "reasons": ["power cap"]}, _board(80, 345)]}
    row["tp2_boards"] = [{**_board(610, 1980), "reasons": []}] * 2
    payload = {"tensor_parallel_size": 2, "own": 64, "gen": 128, "model": "m", "compare_model": "c"}
    payload.update(grid=[], allreduce={}, compare=[row], runs={})
    md = markdown(payload)
    assert "| 256 | TP=1 | 690 / 80 | 1600 (1500) / 345 (245) | power cap |" in md
    assert "| 256 | TP=2 | 610 / 610 | 1980 (1880) / 1980 (1880) | - |" in md
    assert "| 256 | NCCL |" not in md  # a run without boards: no line


def test_a_compare_merge_takes_the_named_rows_each_with_its_commit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    old_rows = [{**COMPARE_ROW, "B": 64}, COMPARE_ROW]
    _file(out / "tensor_parallel.json", "aaaaaaa", compare=old_rows)
    other = _file(
        tmp_path / "other.json",
        "bbbbbbb",
        compare=[{**COMPARE_ROW, "B": 64}, {**COMPARE_ROW, "tp2_tok_s": 1.0}],
    )
    tp.main(["--parts", "compare", "--batches", "256", "--merge", str(other), "--out", str(out)])
    merged = json.loads((out / "tensor_parallel.json").read_text())["compare"]
    assert [(r["B"], r["commit"], r["tp2_tok_s"]) for r in merged] == [
        (64, "aaaaaaa", 39970.0),
        (256, "bbbbbbb", 1.0),
    ]


def test_repeated_compare_rows_are_the_median_runs(tmp_path: Path, monkeypatch) -> None:
    """``--repeats 3``: TP=1 and TP=2 run three times in turn (NCCL once); a cell is the median run,
    with its GPU idle, and the markdown lists every run and each pair's ratio."""
    made: list[tuple[int, bool]] = []
    tok_s = {(1, False): [100.0, 120.0, 110.0], (2, True): [200.0, 190.0, 230.0], (2, False): [150.0]}

    def fake(run: tuple, env: dict) -> dict:
        key = (run[5], run[6])  # ranks, peer all-reduce
        made.append(key)
        value = tok_s[key][sum(k == key for k in made) - 1]
        return {"tok_s": value, "host_overhead_frac": value / 1e4, "decode_window": (0.0, 1.0)}

    monkeypatch.setattr(tp, "_measure_elsewhere", fake)
    args = ["--parts", "compare", "--batches", "4", "--compare-prefix", "16", "--repeats", "3"]
    tp.main([*args, "--device", "cpu", "--out", str(tmp_path)])
    assert made == [(1, False), (2, True), (2, False), (1, False), (2, True), (1, False), (2, True)]
    (row,) = json.loads((tmp_path / "tensor_parallel.json").read_text())["compare"]
    assert (row["tp1_tok_s"], row["tp2_tok_s"], row["tp2_nccl_tok_s"]) == (110.0, 200.0, 150.0)
    assert row["tp1_host_overhead_frac"] == 110.0 / 1e4 and "tp2_nccl_tok_s_runs" not in row
    assert row["tp2_tok_s_runs"] == [200.0, 190.0, 230.0]
    md = (tmp_path / "tensor_parallel.md").read_text()
    assert "| 4 | 16 | 100 / 120 / 110 | 200 / 190 / 230 | 2.000 / 1.583 / 2.091 | 1.82x |" in md
