"""The server's cheap streaming path: hand-written chunk JSON, several events per body write, and the
HTTP parser / event loop choice (httptools and uvloop where importable, h11 and asyncio otherwise)."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai import server as server_mod
from prefixserve.entrypoints.openai.answering import stream_events
from prefixserve.entrypoints.openai.server import ServerThread, build_app, http_options
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.protocols.openai import format as fmt


def _state(chat: bool, n: int = 1, include_usage: bool = True) -> fmt.StreamState:
    return fmt.StreamState("chatcmpl-1", 'model "x"', chat, n, str, [], False, include_usage)


def _out(rid: str, texts: list[str], finished: bool) -> RequestOutput:
    outs = [CompletionOutput(i, t, [1] * len(t), "length" if finished else None) for i, t in enumerate(texts)]
    return RequestOutput(rid, None, [5, 6], outs, finished)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("finish", [None, "stop"])
@pytest.mark.parametrize("delta", ["", 'héllo "q" \\ \n\t\u2028 \U0001f600'])
def test_plain_chunk_is_the_dict_chunk(chat: bool, finish: str | None, delta: str) -> None:
    s = _state(chat)
    if chat:
        choice: dict[str, Any] = {"index": 3, "delta": {"content": delta} if delta else {}}
    else:
        choice = {"index": 3, "text": delta}
    choice.update(logprobs=None, finish_reason=finish)
    fast = s._plain_chunk(3, delta, finish)
    assert fast == s.chunk([choice])
    payload = json.loads(fast.removeprefix("data: "))
    assert payload["id"] == "chatcmpl-1" and payload["model"] == 'model "x"' and payload["usage"] is None
    assert payload["choices"] == [choice] and fast.endswith("\n\n")


def _drain(state: fmt.StreamState, ids: list[str], outputs: list[RequestOutput]) -> list[str]:
    """The writes ``stream_events`` makes when all of ``outputs`` are queued at once."""

    async def run() -> list[str]:
        sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
        for o in outputs:
            sink.put_nowait(o)
        loop = SimpleNamespace(abort=lambda _rid: None)
        return [w async for w in stream_events(SimpleNamespace(loop=loop), ids, sink, state)]  # type: ignore[arg-type]

    return asyncio.run(run())


def test_one_write_per_wakeup_holds_every_event() -> None:
    ids = ["r-0", "r-1"]
    outputs = [
        _out("r-0", ["ab", "c"], False),
        _out("r-1", ["d", "ef"], True),
        _out("r-0", ["abx", "cy"], True),
    ]
    writes = _drain(_state(True, n=2), ids, outputs)
    assert len(writes) == 1  # the role chunks go with everything queued (coalesced): one write
    events = [e for w in writes for e in w.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [p["choices"][0]["delta"] for p in payloads[:2]] == [{"role": "assistant", "content": ""}] * 2
    texts: dict[int, str] = {}
    for p in payloads[2:-1]:
        (c,) = p["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
        assert c["finish_reason"] == "length"
    assert texts == {0: "abx", 1: "cy", 2: "d", 3: "ef"}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 8


@pytest.fixture(scope="module")
def h11_server(tiny_config_path: Path) -> Iterator[ServerThread]:
    """A server started as where httptools and uvloop are missing."""
    real = importlib.util.find_spec

    def no_c_http(name: str, *args: Any) -> Any:
        return None if name in ("httptools", "uvloop") else real(name, *args)

    patch = pytest.MonkeyPatch()
    patch.setattr(server_mod.importlib.util, "find_spec", no_c_http)
    try:
        assert http_options() == {"http": "h11", "loop": "asyncio"}
        config = EngineConfig(
            model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, max_num_seqs=16
        )
        srv = ServerThread(build_app(config))
        assert srv.server.config.http == "h11" and srv.server.config.loop == "asyncio"
    finally:
        patch.undo()
    with srv:
        yield srv


def test_picks_c_http_when_importable() -> None:
    options = http_options()
    assert options["http"] == ("httptools" if importlib.util.find_spec("httptools") else "h11")
    assert options["loop"] == ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio")


def _stream_n(url: str) -> tuple[list[str], list[str], int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    body: dict[str, Any] = dict(
        model="default", messages=[{"role": "user", "content": "x"}], n=3, max_tokens=6
    )
    full = client.chat.completions.create(**body, seed=3)
    stream = client.chat.completions.create(
        **body, seed=3, stream=True, stream_options={"include_usage": True}
    )
    texts, usage = ["", "", ""], 0
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return texts, [c.message.content or "" for c in sorted(full.choices, key=lambda c: c.index)], usage


def test_multi_event_writes_parse_with_openai_on_h11(h11_server: ServerThread) -> None:
    texts, expected, usage = _stream_n(h11_server.url)
    assert texts == expected and usage == 18


def test_multi_event_writes_parse_with_openai_default(tiny_config_path: Path) -> None:
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, max_num_seqs=16)
    with ServerThread(build_app(config)) as srv:
        texts, expected, usage = _stream_n(srv.url)
    assert texts == expected and usage == 18


def test_a_stream_whose_reader_is_behind_gets_one_output_in_flight(tiny_config_path) -> None:
    """Backpressure (``StreamSink``): while a streamed request's reader has not taken its last output,
    the engine builds no more for it; once the reader resumes, the next output carries every token
    since, and the stream ends with the same tokens as an unstreamed request."""
    import asyncio
    import time

    from prefixserve import LLM, SamplingParams
    from prefixserve.serving.engine_thread import EngineLoop, StreamSink

    llm = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, progress=False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)[0].outputs[0].token_ids
    loop_thread = EngineLoop(llm.engine)
    loop_thread.start()

    async def run() -> tuple[list, list[int]]:
        sink = StreamSink()
        await loop_thread.add("s", None, params, sink, prompt_token_ids=[5, 6, 7, 8], stream=True)
        deadline = time.monotonic() + 30
        while sink.qsize() == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the engine runs on; the reader does not read
        held = [sink.get_nowait() for _ in range(sink.qsize())]
        last = held[-1]
        while not last.finished:
            sink.resume()
            last = await asyncio.wait_for(sink.get(), 30)
        return held, last.outputs[0].token_ids

    try:
        held, tokens = asyncio.run(run())
    finally:
        loop_thread.stop()
    # one output in flight while the reader was away (plus the final one, if it ended meanwhile)
    assert not held[0].finished and len(held[0].outputs[0].token_ids) < 24
    assert len(held) == 1 or (len(held) == 2 and held[1].finished)
    assert tokens == expected


@pytest.mark.parametrize("n", [1, 2])
def test_stream_interval_spaces_progress_outputs(tiny_config_path, n: int) -> None:
    """``stream_interval=K``: the first token goes out at once, then an output every K tokens per
    sample, and the final one; the tokens are those of an unstreamed request."""
    from prefixserve import LLM, SamplingParams

    params = SamplingParams(n=n, max_tokens=11, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    plain = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, progress=False)
    expected = [c.token_ids for c in plain.generate(prompt, params)[0].outputs]
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, progress=False, stream_interval=4
    )
    engine = llm.engine
    engine.add_request("s", None, params, prompt_token_ids=[5, 6, 7, 8], stream=True)
    seen = []
    while engine.has_unfinished():
        seen += [(len(o.outputs[0].token_ids), o.finished) for o in engine.step()]
    last = seen[-1]
    assert last == (11, True)
    progress = [t for t, done in seen if not done]
    assert progress[0] == 1 and all(b - a >= 4 for a, b in itertools.pairwise(progress))
    assert len(progress) >= 2  # it does stream
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
    out = llm.generate(prompt, params)[0]
    assert [c.token_ids for c in out.outputs] == expected


def test_continuous_usage_rides_on_every_chunk_of_its_choice() -> None:
    """vLLM's continuous_usage_stats: a chunk carries its own choice's tokens so far (n=2 here)."""
    s = fmt.StreamState("chatcmpl-1", "m", True, 2, str, [], False, True, continuous_usage=True)
    outs = [CompletionOutput(0, "ab", [1, 2], None), CompletionOutput(1, "xyz", [3, 4, 5], None)]
    chunks = [
        json.loads(c.removeprefix("data: "))
        for c in s.update(0, RequestOutput("r", None, [5, 6], outs, False))
    ]
    assert [(c["choices"][0]["index"], c["usage"]) for c in chunks] == [
        (0, {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}),
        (1, {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}),
    ]
    plain = fmt.StreamState("chatcmpl-1", "m", True, 2, str, [], False, True)
    first = plain.update(0, RequestOutput("r", None, [5, 6], outs, False))[0]
    assert json.loads(first.removeprefix("data: "))["usage"] is None
