"""Offline batches on a local Ray cluster: 2 replicas of the tiny dummy model on the CPU (what is
checked is the sharding, the streaming back and the resume, not the model).

The driver shards rows by prefix-sharing group; output lines must equal the single-process run's
(greedy), and a rerun resumes. Ray Data's ``map_batches`` with the processor class too."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prefixserve import LLM
from prefixserve.config import EngineConfig
from tests.conftest import wait_ray_idle

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray(ray_cluster):
    """The session's local Ray (2 CPUs); this module's actors are gone when it ends."""
    yield ray_cluster
    wait_ray_idle()


def _input(path: Path) -> None:
    rng = random.Random(0)
    topics = ["the ocean", "volcanoes", "old maps"]
    rows = []
    for t, topic in enumerate(topics):
        system = f"You are a patient teacher. Every answer is about {topic}, in plain words. " * 3
        for q in range(3):
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Tell me fact number {q + 1}."},
                ],
                "max_tokens": 6,
                "temperature": 0,
            }
            rows.append(
                {"custom_id": f"t{t}q{q}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
    rng.shuffle(rows)
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/moderations", "body": {}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _choices(path: Path) -> dict[str, list]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["custom_id"]: (r["response"] or {}).get("body", {}).get("choices") for r in rows}


def test_ray_replicas_match_one_process_and_resume(local_ray, tiny_config_path: Path, tmp_path: Path) -> None:
    from prefixserve.ray_scaleout.ray_batch import run_batch_file_ray

    src, one, many = tmp_path / "in.jsonl", tmp_path / "one.jsonl", tmp_path / "ray.jsonl"
    _input(src)
    model = f"dummy:{tiny_config_path}"
    LLM(model=model, dtype="float32", device="cpu", num_kv_blocks=512, progress=False).batch(
        src, one, progress=False
    )
    config = EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=512)
    summary = run_batch_file_ray(config, src, many, replicas=2, progress=False)
    assert summary["replicas"] == 2 and summary["rows_written"] == 10 and summary["error_rows"] == 1
    assert _choices(many) == _choices(one)
    again = run_batch_file_ray(config, src, many, replicas=2, progress=False)
    assert again["rows_written"] == 0 and again["rows_skipped"] == 10


def test_ray_data_map_batches(local_ray, tiny_config_path: Path) -> None:
    from prefixserve.ray_scaleout.ray_batch import PrefixserveProcessor

    head = "Answer with one word. The question is about colours: "
    prompts = [head + q for q in ("sky?", "grass?", "snow?", "coal?")]
    ds = ray.data.from_items([{"prompt": p} for p in prompts])
    engine = {"model": f"dummy:{tiny_config_path}", "dtype": "float32", "device": "cpu", "num_kv_blocks": 256}
    # one actor takes both batches of two (its engine reused for the second): a second actor would only
    # repeat the first's start (a Ray worker importing the engine: ~5 s of the 2-core CI machine)
    out = ds.map_batches(
        PrefixserveProcessor,
        fn_constructor_kwargs={"max_tokens": 4, **engine},
        concurrency=1,
        batch_size=2,
    ).take_all()
    assert sorted(r["prompt"] for r in out) == sorted(prompts)
    direct = LLM(**engine, progress=False)
    want = {p: o.outputs[0].text for p, o in zip(prompts, direct.generate(prompts, _greedy(4)), strict=True)}
    assert {r["prompt"]: r["generated_text"] for r in out} == want


def _greedy(n: int):
    from prefixserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0)
