"""Long text prompts are tokenized off the engine thread, so a new request does not stall running streams.

Found by ``benchmarks/serving.py --device cuda``: with an 8K-token system prompt, each arriving chat was
encoded on the engine thread (about 8-17 ms a request, 36 ms for a 16K-token document), during which no
step ran: every running stream stalled for that long, and a burst of 256 questions about one 16K-token
document spent seconds tokenizing one prompt after another before and between steps. Here the
tokenizer's ``encode`` is made slow for one marked prompt; a stream already running must keep flowing
while that prompt is tokenized.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.server import ServerThread, build_app

SLOW_S = 1.5
MARK = "SLOW-TO-TOKENIZE"


@pytest.fixture(scope="module")
def server(tiny_config_path: Path) -> Iterator[ServerThread]:
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=512, max_num_seqs=8)
    with ServerThread(build_app(config)) as srv:
        tok = srv.app.state.server.tokenizer
        assert tok is srv.engine_loop.engine.tokenizer
        encode = tok.encode

        def slow_encode(text: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(text, str) and MARK in text:
                time.sleep(SLOW_S)  # a long prompt; the real tokenizer releases the GIL too
            return encode(text, *args, **kwargs)

        tok.encode = slow_encode
        try:
            yield srv
        finally:
            del tok.encode


def test_running_stream_keeps_flowing_while_a_long_prompt_is_tokenized(server: ServerThread) -> None:
    gaps: list[float] = []
    started = threading.Event()
    body = {
        "model": "default",
        "prompt": [11, 12, 13, 14],
        "max_tokens": 1500,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }

    def stream_a() -> None:
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            last = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if len(gaps) == 20:
                    started.set()
                if len(gaps) >= 20 and done.is_set():
                    return  # hang up: the server aborts A

    done = threading.Event()
    a = threading.Thread(target=stream_a)
    a.start()
    assert started.wait(30), "stream A did not start"
    before = len(gaps)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post(
            "/v1/completions",
            json={"model": "default", "prompt": f"{MARK} tell me more", "max_tokens": 2, "temperature": 0.0},
        )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    during = gaps[before:]
    done.set()
    a.join(30)
    assert during, "stream A stopped before B was answered"
    # B's prompt took SLOW_S to tokenize; on the engine thread, A would have waited that long for a token
    assert max(during) < SLOW_S / 2, f"stream A stalled {max(during):.2f} s while B was tokenized"
    deadline = time.monotonic() + 15
    while server.engine_loop.call(lambda e: e.pool.num_used).result(10) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine_loop.call(lambda e: e.pool.num_used).result(10) == 0


def test_offline_generate_tokenizes_text_prompts_in_one_batch(default_llm, monkeypatch) -> None:
    """``LLM.generate`` encodes its text prompts with one batch call (all cores with a fast tokenizer),
    not one ``encode`` each; the outputs and the reported prompts are those of per-prompt encoding."""
    from prefixserve import SamplingParams

    texts = ["The capital of France is", "Once upon a time", "2 + 2 ="]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    tok = default_llm.engine.tokenizer
    expected = [
        default_llm.generate({"prompt_token_ids": tok.encode(t, add_special_tokens=False)}, params)[0]
        for t in texts
    ]
    calls = []
    encode = type(tok).encode

    def counted(self, *args, **kwargs):
        calls.append(args)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(type(tok), "encode", counted)
    outs = default_llm.generate(texts, params)
    assert not calls  # no per-prompt encode: the batch call did it
    assert [o.prompt for o in outs] == texts
    assert [o.prompt_token_ids for o in outs] == [e.prompt_token_ids for e in expected]
    assert [o.outputs[0].token_ids for o in outs] == [e.outputs[0].token_ids for e in expected]
