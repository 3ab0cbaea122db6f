"""``benchmarks/tensor_parallel.py``'s result files: each part keeps the run that wrote it, and
``--merge`` takes parts of another file with their runs (no GPU, no measuring)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import tensor_parallel as tp

GRID_ROW = {
    "B": 256, "P": 16384, "tp": 2, "max_batched_tokens": 1024, "auto_tok_s": 5238.0,
    "sharing_off_tok_s": 1850.0, "ceiling_tok_s": 7098.0, "auto_preemptions": 0,
    "sharing_off_preemptions": 2, "ceiling_preemptions": 0,
}  # fmt: skip
COMPARE_ROW = {"B": 256, "P": 1024, "tp1_tok_s": 24669.0, "tp2_tok_s": 39970.0, "tp2_nccl_tok_s": 31183.0}


def _file(path: Path, commit: str, **parts: object) -> Path:
    """A result file as a run before per-part runs wrote it: one run's keys at the top."""
    info = {"device": "GPU-X", "gpus": 2, "torch": "2.x", "commit": commit, "date": "2026-11-26 00:00 UTC"}
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
    assert merged["grid"] == [GRID_ROW] and merged["compare"] == [COMPARE_ROW]  # compare not taken
    assert merged["runs"]["grid"]["commit"] == "bbbbbbb"
    assert merged["runs"]["compare"]["commit"] == "aaaaaaa"
    md = (out / "tensor_parallel.md").read_text()
    grid_part, compare_part = md.split("TP=1 vs TP=2")
    assert "commit bbbbbbb" in grid_part and "commit aaaaaaa" in compare_part
    assert "| 2.83x |" in grid_part and "| 1024 | 0 / 2 / 0 |" in grid_part  # step tokens, preemptions
