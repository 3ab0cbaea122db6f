"""The engine in its own process (``engine_process.py``): outputs cross as deltas and come back whole,
and a child that dies fails its requests, turns /health to 503 and refuses new ones. (The whole
server suite also runs against it: the ``engine-process`` variant of test_server.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import engine_checks
import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.server import ServerThread, build_app
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.serving.engine_process import OutputDecoder, OutputEncoder, wants_engine_process

_step = st.tuples(
    st.text(max_size=3),  # text appended
    st.booleans(),  # the text is cut back instead (a stop string found late)
    st.lists(st.integers(0, 99), max_size=3),  # tokens appended
)


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(st.lists(_step, min_size=2, max_size=2), min_size=1, max_size=8),
    logprobs=st.booleans(),
)
def test_deltas_rebuild_every_cumulative_output(steps, logprobs: bool) -> None:
    encoder, decoder = OutputEncoder(), OutputDecoder()
    texts, tokens = ["", ""], [[], []]
    prompt_ids = [7, 8, 9]
    for n, step in enumerate(steps):
        finished = n == len(steps) - 1
        outs = []
        for i, (add, cut, ids) in enumerate(step):
            texts[i] = texts[i][: len(texts[i]) // 2] if cut else texts[i] + add
            tokens[i] = tokens[i] + ids
            lps = [-float(t) for t in tokens[i]] if logprobs else None
            tops = [[(t, -1.0)] for t in tokens[i]] if logprobs else None
            reason = "length" if finished else None
            outs.append(CompletionOutput(i, texts[i], list(tokens[i]), reason, None, lps, tops))
        error = "why it ended" if finished and logprobs else None  # the engine's reason travels too
        times = {"arrival_time": 1.0}
        prompt_lp = ([None, -1.5, -0.25], [[], [(8, -1.5)], [(1, -0.1)]], [None, 1, 2]) if logprobs else ()
        sent = RequestOutput(
            "r", "p", prompt_ids, outs, finished, 3, 0, 0, 0, times, *prompt_lp[:2], error=error
        )
        if prompt_lp:
            sent.prompt_logprob_ranks = prompt_lp[2]  # the prompt's ranks travel with its logprobs
        if finished and logprobs:
            sent.embedding = [0.5, -0.25, float(n)]  # an embedding request's vector travels at its end
        got = decoder.decode(pickle_round_trip(encoder.encode(sent)))
        assert got == sent
    assert not encoder._sent and not decoder._state  # a finished request is forgotten on both sides


def pickle_round_trip(wire):
    import pickle

    return pickle.loads(pickle.dumps(wire))


def test_an_aborted_request_in_flight_is_dropped_not_an_error() -> None:
    encoder, decoder = OutputEncoder(), OutputDecoder()
    first = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [5])], False)
    decoder.decode(encoder.encode(first))
    decoder.forget("r")  # the server aborted it while the next output was on its way
    later = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [5, 6])], False)
    assert decoder.decode(encoder.encode(later)) is None


def test_a_first_output_after_an_abort_leaves_no_state() -> None:
    """Aborted unreported (client gone) while its first output was on its way: the output's head must
    not rebuild the request's state, which no final output would ever clear."""
    encoder, decoder = OutputEncoder(), OutputDecoder()
    first = RequestOutput("gone", None, list(range(8192)), [CompletionOutput(0, "a", [5])], False)
    other = RequestOutput("live", None, [1], [CompletionOutput(0, "b", [6])], False)
    wires = [encoder.encode(first), encoder.encode(other)]
    decoder.forget("gone")  # the server side aborted it (report=False) before the reader got here
    outs = decoder.decode_live(wires, {"live"})
    assert [o.request_id for o in outs] == ["live"]
    assert set(decoder._state) == {"live"}


def test_auto_runs_the_engine_apart_only_on_a_gpu() -> None:
    from types import SimpleNamespace as Config  # EngineConfig refuses cuda on a machine without one

    assert wants_engine_process("auto", Config(device="cpu")) is False
    assert wants_engine_process("auto", Config(device="cuda:1")) is True
    assert wants_engine_process("on", Config(device="cpu")) is True
    assert wants_engine_process("off", Config(device="cuda")) is False


@pytest.fixture(scope="module")
def server(tiny_config_path: Path) -> Iterator[ServerThread]:
    """A server of the tiny model with its engine in a process of its own (async scheduling on), for
    the module's two tests of a live engine process: one process start (~5 CPU-seconds) for both.
    The second kills it."""
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, async_scheduling=True
    )
    with ServerThread(build_app(config, engine_process=True)) as srv:
        yield srv


def test_counters_before_a_call_answer_cover_what_came_before(server: ServerThread) -> None:
    """An abort, then a call: the call's answer comes after counters that include the abort (with
    async scheduling the aborted request's launch is still in flight, so the engine is not idle).
    Sent from this thread's own event loop, as a process of its own would be (each stream is
    answered on the loop it was added from); the server is idle meanwhile."""
    import asyncio

    from prefixserve.sampling.params import SamplingParams
    from prefixserve.serving.engine_thread import StreamSink

    loop = server.engine_loop

    async def run() -> None:
        sink = StreamSink()
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        await loop.add("a", None, params, sink, prompt_token_ids=[1, 2, 3], stream=True)
        await asyncio.wait_for(sink.get(), 30)  # it runs
        loop.abort("a")
        await loop.run(engine_checks.blocks_in_use)
        assert loop.snapshot["requests_aborted_total"] == 1

    asyncio.run(run())


def test_a_dead_engine_process_fails_its_requests_and_the_health_check(server: ServerThread) -> None:
    """Last of the module's tests on ``server``: it kills its engine process mid-stream."""
    srv = server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
    assert httpx.get(f"{srv.url}/health").status_code == 200
    ended: list[object] = []

    def long_stream() -> None:
        try:
            stream = client.completions.create(
                model="default",
                prompt=[1, 2, 3],
                max_tokens=2000,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            ended.append([c.choices[0].finish_reason for c in stream if c.choices][-1])
        except Exception as exc:  # the stream may also break off
            ended.append(exc)

    before = srv.engine_loop.snapshot.get("generation_tokens_total", 0)  # the test before's tokens
    reader = threading.Thread(target=long_stream)
    reader.start()
    deadline = time.monotonic() + 60
    while srv.engine_loop.snapshot.get("generation_tokens_total", 0) < before + 5:
        assert time.monotonic() < deadline and not ended, ended
        time.sleep(0.05)
    srv.engine_loop._process.kill()
    reader.join(60)
    assert not reader.is_alive()
    assert ended and isinstance(ended[0], openai.APIError), ended  # the stream's error event
    deadline = time.monotonic() + 10
    while httpx.get(f"{srv.url}/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{srv.url}/health").status_code == 503
    try:
        client.completions.create(model="default", prompt=[1, 2], max_tokens=2)
        raise AssertionError("a dead engine took a request")
    except openai.APIStatusError as exc:
        assert exc.status_code == 503 and "engine process is not running" in str(exc)


def test_commands_never_wait_on_a_child_that_reads_nothing() -> None:
    """The server's side queues commands for a writer thread: a child busy in a long step or a GC pass
    fills the pipe's buffer, and a send on the event loop would stop every stream until it reads.
    Commands still reach it whole and in order once it reads; a broken pipe refuses the next ones."""
    import pickle
    import queue

    from prefixserve.serving.engine_process import EngineProcess

    reading = threading.Event()
    got: list[object] = []

    class StalledPipe:
        def send_bytes(self, data: bytes) -> None:
            reading.wait(10)
            got.append(pickle.loads(data))
            if got[-1] == ("break",):
                raise BrokenPipeError

    ep = object.__new__(EngineProcess)  # the writer's parts only: no child process
    ep._lock, ep._closed, ep._write_failed = threading.Lock(), False, False
    ep._outbox, ep._conn = queue.SimpleQueue(), StalledPipe()
    ep._writer = threading.Thread(target=ep._write, daemon=True)
    ep._writer.start()
    began = time.perf_counter()
    prompt = list(range(4096))
    assert all(ep._put(("add", f"r{i}", prompt)) for i in range(200))
    assert time.perf_counter() - began < 2.0  # queued, not sent: nothing waited on the child
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        ep._put(("call", 1, lambda engine: engine))  # unpicklable: the caller hears it at once
    reading.set()
    assert ep._put(("break",))
    ep._writer.join(10)
    assert [g[1] for g in got[:200]] == [f"r{i}" for i in range(200)] and got[0][2] == prompt
    assert ep._write_failed and not ep._put(("abort", "r0", False))  # the pipe broke: refused
