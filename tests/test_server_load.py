"""A bounded load test on loopback: 32 concurrent streaming clients sharing a ~1,000-token system prompt.

Some clients hang up early. Nothing may answer 5xx, every completed stream must be well-formed, and
the KV pool must be empty at the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.server import ServerThread, build_app

CLIENTS = 32
SYSTEM = " ".join(f"Rule {i}: answer about item {i * 7 % 13} politely and briefly." for i in range(80))


@pytest.fixture(scope="module")
def server(tiny_config_path: Path) -> Iterator[ServerThread]:
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=2048, max_num_seqs=64
    )
    with ServerThread(build_app(config)) as srv:
        yield srv


async def _one(
    http: httpx.AsyncClient, rng: random.Random, client: int, turn: int, hang_up: bool
) -> tuple[int, dict[str, Any] | None]:
    """One streamed chat; returns (status, summary) with summary None when we hung up on purpose."""
    body = {
        "model": "default",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Client {client}, question {turn}: what about item {rng.randint(0, 99)}?",
            },
        ],
        "max_tokens": rng.randint(4, 16),
        "temperature": rng.choice([0.0, 0.7]),
        "seed": rng.randint(0, 1000),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, {"error": response.text}
        events = []
        async for line in response.aiter_lines():
            if not line:
                continue
            events.append(line)
            if hang_up and len(events) >= 2:
                return 200, None
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert all(f is None for f in finish[:-1]) and finish[-1] in ("stop", "length")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and 0 < usage["completion_tokens"] <= body["max_tokens"]
    return 200, {"text": text, "usage": usage}


async def _client(url: str, client: int) -> list[tuple[int, dict[str, Any] | None]]:
    """One client's 2 to 5 turns, one after another (~110 requests over the 32 clients: more turns
    repeat the same path). ``verify=False``: plain HTTP, and no TLS context to build (~40 ms of CPU a
    client)."""
    rng = random.Random(client)
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=120, verify=False) as http:
        for turn in range(rng.randint(2, 5)):
            hang_up = client % 4 == 3 and turn == 1
            results.append(await _one(http, rng, client, turn, hang_up))
    return results


async def _run(url: str) -> list[tuple[int, dict[str, Any] | None]]:
    per_client = await asyncio.gather(*(_client(url, c) for c in range(CLIENTS)))
    return [r for results in per_client for r in results]


def test_concurrent_streaming_clients(server: ServerThread) -> None:
    start = time.monotonic()
    results = asyncio.run(asyncio.wait_for(_run(server.url), timeout=150))
    elapsed = time.monotonic() - start
    statuses = [status for status, _ in results]
    assert all(s < 500 for s in statuses), [r for r in results if r[0] >= 500][:3]
    assert all(s == 200 for s in statuses), [r for r in results if r[0] != 200][:3]
    done = [summary for _, summary in results if summary is not None]
    assert len(done) == len(results) - CLIENTS // 4
    cached = [d["usage"]["prompt_tokens_details"]["cached_tokens"] for d in done]
    assert sum(c >= 900 for c in cached) >= len(done) // 2  # the shared system prompt is computed ~once

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        used, live = server.engine_loop.call(lambda e: (e.pool.num_used, len(e.requests))).result(10)
        if used == 0 and live == 0:
            break
        time.sleep(0.05)
    assert (used, live) == (0, 0), f"{used} blocks, {live} requests left after the load"
    server.engine_loop.call(lambda e: e.pool.check_integrity()).result(10)
    print(f"\n{len(results)} requests from {CLIENTS} clients in {elapsed:.1f}s")


def test_one_completions_request_may_hold_many_prompts(tiny_config_path: Path) -> None:
    """Many questions on one document as one request (vLLM caps none): 150 prompts (past the 64
    prompts and 128 choices once capped, ~10 times the running rows) answer 150 choices; past the
    cap, a 400 naming the prompt."""
    from prefixserve.protocols.openai.request_models import MAX_PROMPTS
    from prefixserve.serving.admission import AdmissionLimits
    from prefixserve.serving.overload import OverloadSettings

    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=512, max_num_seqs=16)
    overload = OverloadSettings(AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=0))
    document = list(range(5, 69))
    prompts = [[*document, 100 + q] for q in range(150)]
    app = build_app(config, overload=overload)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120, verify=False) as h:
        got = h.post("/v1/completions", json={"prompt": prompts, "max_tokens": 2})
        assert got.status_code == 200, got.text
        body = got.json()
        assert [c["index"] for c in body["choices"]] == list(range(150))
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 149 * 64  # the document once
        over = h.post("/v1/completions", json={"prompt": [[5, 6]] * (MAX_PROMPTS + 1), "max_tokens": 1})
        assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
