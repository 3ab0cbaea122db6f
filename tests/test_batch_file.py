"""OpenAI Batch files: envelope checks with line numbers, whole-line appends, resume after a torn line."""

from __future__ import annotations

import json
from pathlib import Path

from prefixserve.entrypoints.batch_file import (
    BadRow,
    BatchRow,
    ResultWriter,
    error_row,
    finished_keys,
    read_batch,
    result_row,
    row_key,
)


def _line(custom_id: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body or {"prompt": "x"}})


def test_read_batch_turns_bad_lines_into_named_errors(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [
        _line("a"),
        "{not json",
        "",
        json.dumps([1, 2]),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        _line("a"),
        _line("b", url="/v1/moderations"),
        json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "d", "url": "/v1/chat/completions", "body": "hi"}),
        _line("e", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
    ]
    path.write_text("\n".join(lines) + "\n")
    rows = read_batch(path)
    assert [r.line for r in rows] == [1, 2, 4, 5, 6, 7, 8, 9, 10]  # blank line 3 skipped
    good = [r for r in rows if isinstance(r, BatchRow)]
    assert [(r.custom_id, r.url) for r in good] == [("a", "/v1/completions"), ("e", "/v1/chat/completions")]
    bad = {r.line: r for r in rows if isinstance(r, BadRow)}
    assert bad[2].code == "invalid_json" and bad[2].message.startswith("line 2: not valid JSON")
    assert "JSON object" in bad[4].message
    assert "custom_id" in bad[5].message
    assert bad[6].code == "duplicate_custom_id" and "'a'" in bad[6].message
    assert bad[7].code == "invalid_url" and "/v1/moderations" in bad[7].message
    assert "method" in bad[8].message
    assert "'body'" in bad[9].message
    row = error_row(bad[7])
    assert row["custom_id"] == "b" and row["response"] is None and row["error"]["code"] == "invalid_url"


def test_writer_appends_whole_lines_and_resume_cuts_a_torn_tail(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    with ResultWriter(out) as w:
        w.write(result_row("a", 200, {"ok": True}))
        w.write(result_row("b", 400, {"error": {"message": "bad"}}))
        # An unreadable line is known by its line number, not by its (here duplicate) custom_id.
        w.write(error_row(BadRow(7, "a", "duplicate_custom_id", "line 7: custom_id 'a' is a duplicate")))
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_x", "custom_id": "c", "respo')  # a kill mid-line
    assert finished_keys(out) == {("id", "a"), ("id", "b"), ("line", "7")}
    assert out.read_bytes().endswith(b"\n")  # the torn tail is gone
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["a", "b", "a"]
    assert rows[1]["response"]["status_code"] == 400 and rows[0]["error"] is None
    assert rows[0]["id"].startswith("batch_req_") and rows[0]["response"]["request_id"].startswith("req_")
    assert finished_keys(tmp_path / "missing.jsonl") == set()
    # a custom_id that reads like a line number is still a custom_id: the bad line 2 stays to answer
    with ResultWriter(out) as w:
        w.write(result_row("line:2", 200, {"ok": True}))
    keys = finished_keys(out)
    assert ("id", "line:2") in keys and ("line", "2") not in keys
    assert row_key(BadRow(2, None, "invalid_json", "line 2: not valid JSON")) not in keys
