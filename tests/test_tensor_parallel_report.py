"""The tensor-parallel benchmark's result file: grid cells of several runs keep their own commits."""

from __future__ import annotations

from benchmarks.tensor_parallel import _merge_cells, _stamp_cells, markdown


def _result(commit: str, on: float, off: float) -> dict:
    cells = [(b, p) for b in (64, 256) for p in (1024, 16384)]
    rows = [{"B": b, "P": p, "auto_tok_s": on, "sharing_off_tok_s": off} for b, p in cells]
    run = {"device": "GPU", "gpus": 2, "torch": "t", "commit": commit, "date": "d"}
    return {"grid": rows, "runs": {"grid": run}}


def test_a_cell_merge_takes_only_the_named_cells_and_keeps_each_commit() -> None:
    payload, newer = _result("old", 100.0, 50.0), _result("new", 120.0, 40.0)
    _stamp_cells(payload)
    _stamp_cells(newer)
    _merge_cells(payload, newer, {256}, {16384}, ["auto"])
    cells = {(r["B"], r["P"]): r for r in payload["grid"]}
    assert cells[256, 16384]["auto_tok_s"] == 120.0 and cells[256, 16384]["auto_commit"] == "new"
    assert cells[256, 16384]["sharing_off_tok_s"] == 50.0 and cells[256, 16384]["sharing_off_commit"] == "old"
    assert all(cells[k]["auto_commit"] == "old" for k in cells if k != (256, 16384))
    payload.update(tensor_parallel_size=2, own=64, gen=128, model="m", compare=[], allreduce={})
    assert "| 256 | 16384 | 120 | 50 |" in markdown(payload) and "new / old / -" in markdown(payload)
