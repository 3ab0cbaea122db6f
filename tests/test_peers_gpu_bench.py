"""benchmarks/peers_gpu.py on the CPU: its point builders, FlashInfer's page lists, the agreement check
and the derived columns, so the GPU comparison (issue 104) cannot rot between runs."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # our kernels in Triton's CPU interpreter; set before Triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from benchmarks import peers_gpu as pg
from benchmarks import peers_gpu_batch as pb
from benchmarks.peers_gpu_wheel import scan_includes

SMOKE = {pt["kind"]: pt for pt in pg.points(quick=False, smoke=True, layouts=[])}


@pytest.mark.parametrize("kind", ["plain", "shared", "tree"])
def test_page_lists_describe_the_same_attention(kind: str) -> None:
    """FlashInfer's whole tables and cascade levels hold each sequence's KV, in order."""
    batch = pg.make_batch(SMOKE[kind], torch.device("cpu"))
    tables = batch.meta.block_tables_host
    w = batch.whole
    for s, table in enumerate(tables):
        pages = w.kv_indices[w.kv_indptr[s] : w.kv_indptr[s + 1]].tolist()
        assert pages == list(table)[: len(pages)]
        assert (len(pages) - 1) * 16 + int(w.last_page_len[s]) == batch.meta.seq_lens_host[s]
    assert len(batch.levels) == len(SMOKE[kind]["fanouts"])
    ref = pb.reference(batch)
    assert pb.rel_err(pb.levels_reference(batch), ref) < 1e-5


@pytest.mark.parametrize(("kind", "segments"), [("shared", 1), ("tree", 3)])
def test_our_plan_finds_the_shared_levels(kind: str, segments: int) -> None:
    from prefixserve.attention.triton_backend import TritonBackend

    batch = pg.make_batch(SMOKE[kind], torch.device("cpu"))
    meta = dataclasses.replace(batch.meta, plan=None, stats={})
    TritonBackend().prepare(meta)
    assert meta.stats["shared_segments"] == segments
    assert meta.stats["kv_tokens_read"] == batch.unique_tokens


def test_smoke_point_agrees_and_skips_flashinfer() -> None:
    cols = pg.Columns(None, "not loaded (--smoke)")
    row = pg.measure(SMOKE["tree"], cols, torch.device("cpu"), None)
    assert set(row["agree"]) == {"ours_paged", "ours_shared", "levels_reference"}
    assert all(err < pb.BF16_TOL for err in row["agree"].values())
    assert set(row["errors"]) == {"fi_cascade", "fi_decode", "fi_decode_tc"}
    assert row["ours_over_theirs"] is None and row["target_met"] is None


def test_agreement_catches_a_wrong_output() -> None:
    x = torch.randn(8, 4, 64)
    assert pb.agree(x + 1e-4 * torch.randn_like(x), x)[0]
    assert not pb.agree(x.roll(1, 0), x)[0]
    assert not pb.agree(torch.full_like(x, float("nan")), x)[0]


def test_derived_columns_and_targets() -> None:
    row = {"kind": "plain", "bytes": 10**9, "ours_paged_ms": 1.0, "fi_decode_ms": 1.2}
    row["fi_decode_tc_ms"] = 1.02
    pg._derive(row, copy_tbps=4.0)
    assert row["fi_decode_best_ms"] == 1.02 and row["roofline_ms"] == pytest.approx(0.25)
    assert row["ours_paged_TBps"] == pytest.approx(1.0) and row["target_met"]
    row = {"kind": "shared", "bytes": 10**9, "ours_shared_ms": 1.1, "fi_cascade_ms": 1.0, "fi_decode_ms": 3.0}
    pg._derive(row, copy_tbps=None)
    assert row["ours_over_theirs"] == pytest.approx(1.1) and row["target_met"] is False
    assert row["ours_over_fi_decode"] == pytest.approx(1.1 / 3.0)


def test_grid_covers_the_issue() -> None:
    full = pg.points(quick=False, smoke=False, layouts=list(pg.LAYOUTS))
    kinds = [pt["kind"] for pt in full]
    assert (kinds.count("plain"), kinds.count("shared"), kinds.count("tree")) == (30, 18, 4)
    for pt in full:  # shared levels hold whole pages
        assert all(ln % 16 == 0 for ln in pt["lengths"][:-1])
    assert len(pg.points(quick=True, smoke=False, layouts=["8b"])) == 5


def test_report_writes_from_a_saved_result(tmp_path: Path) -> None:
    row = {"kind": "tree", "B": 256, "lengths": ["2048", "512", "(64, 512)"], "layout": "8b", "bytes": 10**9}
    row |= {"ours_shared_ms": 0.5, "fi_cascade_ms": 0.6, "errors": {}, "agree": {"fi_cascade": 3e-3}}
    pg._derive(row, copy_tbps=4.0)
    info = {"device": "H200", "torch": "2", "commit": "abc", "date": "today", "complete": True}
    failed = {"kind": "plain", "layout": "70b", "fanouts": [1], "error": "OOM"}
    pg.report({**info, "rows": [row, failed]}, tmp_path)
    text = (tmp_path / "peers_gpu.md").read_text()
    assert "| tree | 8b | 256 |" in text and "0.833" in text and "OOM" in text


def test_include_scan_follows_quoted_and_angled_includes(tmp_path: Path) -> None:
    (tmp_path / "inc").mkdir()
    (tmp_path / "a.cu").write_text('#include "b.cuh"\n#include <inc/c.h>\n#include <cuda_runtime.h>\n')
    (tmp_path / "b.cuh").write_text("#if 0\n#  include <inc/d.h>\n#endif\n")
    (tmp_path / "inc" / "c.h").write_text("")
    (tmp_path / "inc" / "d.h").write_text("")
    found = {p.name for p in scan_includes([tmp_path / "a.cu"], [tmp_path])}
    assert found == {"b.cuh", "c.h", "d.h"}
