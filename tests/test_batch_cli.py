"""``prefixserve batch``: --analyze without the model, and kill -9 at random points, then resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefixserve.entrypoints.cli import main
from tests.conftest import TINY_CONFIG


def _write_input(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]
    lines = []
    for g in range(rows // 4):
        system = " ".join(rng.choice(words) for _ in range(50))
        for m in range(4):
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"item {m} of set {g}"},
                ],
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            lines.append(
                {"custom_id": f"g{g}-m{m}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
    rng.shuffle(lines)
    text = [json.dumps(x) for x in lines]
    text.insert(len(text) // 2, '{"custom_id": "torn", "method": "PO')  # a bad line stays an error row
    path.write_text("\n".join(text) + "\n")


def _tiny(tmp_path: Path) -> str:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY_CONFIG))
    return f"dummy:{cfg}"


def test_analyze_prints_the_plan_without_running(tmp_path: Path, capsys) -> None:
    src = tmp_path / "in.jsonl"
    _write_input(src, 16)
    report = tmp_path / "plan.json"
    assert main(["batch", str(src), "--analyze", "--model", _tiny(tmp_path), "--json", str(report)]) == 0
    shown = capsys.readouterr().out
    assert "planned saving" in shown and "first level optimum saving" in shown
    data = json.loads(report.read_text())
    assert data["requests"] == 16 and data["groups"] == 4 and data["unreadable_rows"] == 1
    assert 0.5 < data["planned_saving"] <= data["first_level_optimum_saving"] <= data["optimal_saving"]
    assert main(["batch", str(tmp_path / "missing.jsonl"), "--analyze"]) == 2
    assert main(["batch", str(src), "--model", _tiny(tmp_path)]) == 2  # no -o


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _run(args: list[str], out: Path, kill_at_line: int | None = None) -> int | None:
    """Run the command: in this process (its exit status), or with ``kill_at_line`` as a process of its
    own (``python -m prefixserve``), SIGKILLed once the output has that many lines."""
    if kill_at_line is None:
        return main(["batch", *args, "-o", str(out)])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixserve", "batch", *args, "-o", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while proc.poll() is None and _lines(out) < kill_at_line and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return None


ROWS = 40  # and the bad line: the two kills land within the first 24 rows (plus a step's worth)


def test_kill_at_random_points_then_resume_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """Killed twice, each time a random number of rows (1 to 12) past where the last run stopped,
    then resumed: 40 rows leave room after both kills (more rows only add steps to the runs)."""
    src, ref, out = tmp_path / "in.jsonl", tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    _write_input(src, ROWS)
    args = [str(src), "--model", _tiny(tmp_path), "--no-progress", "--max-num-seqs", "8"]
    assert _run(args, ref) == 0
    rng = random.Random(1)
    done = []
    for _ in range(2):  # each run is killed a random number of rows past where the last one stopped
        _run(args, out, kill_at_line=_lines(out) + rng.randint(1, 12))
        done.append(_lines(out))
        for line in out.read_text().splitlines()[:-1]:
            json.loads(line)  # every line but a torn tail is whole
    assert 0 < done[0] < done[-1] < ROWS + 1  # the kills landed mid-run
    assert _run(args, out) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    keys = [r["custom_id"] if r["error"] is None else r["error"]["message"].split(":")[0] for r in rows]
    assert len(keys) == len(set(keys)) == ROWS + 1  # every row exactly once, the bad line included
    want = {r["custom_id"]: r for r in map(json.loads, ref.read_text().splitlines()) if r["error"] is None}
    got = {r["custom_id"]: r for r in rows if r["error"] is None}
    assert got.keys() == want.keys()
    for cid, row in got.items():  # greedy: the same answers, however often the run was killed
        assert row["response"]["body"]["choices"] == want[cid]["response"]["body"]["choices"]


def test_embedding_rows_answer_as_the_python_api_embeds(tmp_path: Path) -> None:
    """``/v1/embeddings`` rows of a batch file: the vectors ``LLM.embed`` gives the same inputs."""
    from prefixserve import LLM

    model = _tiny(tmp_path)
    doc = "one long shared instruction to embed with " * 4
    inputs = [[doc + f"passage {i}", f"short {i}"] for i in range(4)]
    rows = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
        for i, text in enumerate(inputs)
    ]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}})
    rows.append(  # vLLM's scoring rows over the same embeddings
        {
            "custom_id": "s",
            "method": "POST",
            "url": "/v1/score",
            "body": {"text_1": inputs[0][0], "text_2": inputs[1]},
        }
    )
    rows.append(
        {
            "custom_id": "r",
            "method": "POST",
            "url": "/v1/rerank",
            "body": {"query": inputs[0][0], "documents": inputs[1]},
        }
    )
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run([str(src), "--model", model, "--device", "cpu"], out) == 0
    answered = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert answered["bad"]["response"]["status_code"] == 400
    llm = LLM(model=model, device="cpu", progress=False)
    for i, text in enumerate(inputs):
        body = answered[f"e{i}"]["response"]["body"]
        assert answered[f"e{i}"]["response"]["status_code"] == 200
        want = [o.outputs.embedding for o in llm.embed(text)]
        got = [d["embedding"] for d in body["data"]]
        assert len(got) == len(want) == 2
        for g, w in zip(got, want, strict=True):
            assert max(abs(a - b) for a, b in zip(g, w, strict=True)) < 1e-5
    first, second = (llm.embed(text) for text in (inputs[0][:1], inputs[1]))
    cosines = [
        sum(a * b for a, b in zip(first[0].outputs.embedding, o.outputs.embedding, strict=True))
        for o in second
    ]
    scores = [d["score"] for d in answered["s"]["response"]["body"]["data"]]
    assert max(abs(a - b) for a, b in zip(scores, cosines, strict=True)) < 1e-5
    ranked = answered["r"]["response"]["body"]["results"]
    assert [r["index"] for r in ranked] == sorted(range(2), key=lambda i: -cosines[i])
    assert sum(row["response"]["body"]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
               for row in answered.values() if row["response"]["status_code"] == 200) > 0  # fmt: skip
