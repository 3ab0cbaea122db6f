"""Overload over HTTP, live on loopback: the waiting queue's bound and a request's queue deadline are
answered 429 with Retry-After and counted in /metrics, a streamed request dropped from the queue gets
the 429 too (its headers wait for its first output), a request that cannot start in time is refused
by the HTTP process while the engine's loop is held, a stream whose client stops reading has its
requests aborted, and through all of it the engine keeps serving and the KV pool ends empty.

One request runs at a time (max_num_seqs=1): a long streamed "blocker" (the tiny model with a long
context, so that it runs for many seconds however fast the machine) holds the slot while the test fills
the queue behind it, and hanging up on the blocker lets the queue drain.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import engine_checks
import httpx
import openai
import pytest
import uvicorn

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.metrics import PATH_STAGES
from prefixserve.entrypoints.openai.overload_http import QUEUE_DELAY_HEADER, queue_deadline
from prefixserve.entrypoints.openai.server import GracefulServer, ServerThread, build_app, overload_settings
from prefixserve.protocols.errors import APIError
from prefixserve.serving.admission import AdmissionLimits
from prefixserve.serving.overload import OverloadSettings
from tests.conftest import TINY_CONFIG

REFUSAL, FIRST_WRITE = "prefixserve_refusal_seconds", "prefixserve_first_write_seconds"
BLOCKER = {"prompt": "A long ride " * 8, "max_tokens": 16000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def long_config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dummy model with a 16K-token context: room for a blocker that runs for a while."""
    path = tmp_path_factory.mktemp("tiny-long") / "config.json"
    path.write_text(json.dumps({**TINY_CONFIG, "max_position_embeddings": 16384}))
    return path


def one_at_a_time(config_path: Path) -> EngineConfig:
    return EngineConfig(model=f"dummy:{config_path}", device="cpu", num_kv_blocks=1280, max_num_seqs=1)


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def server(long_config_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    overload = OverloadSettings(AdmissionLimits(max_waiting_requests=2, max_waiting_tokens=0))
    app = build_app(one_at_a_time(long_config_path), engine_process=request.param, overload=overload)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def wait_until(done: Any, timeout: float = 20.0, what: str = "") -> None:
    """The engine's counters reach /metrics after its step (or, in its own process, its next send):
    poll ``done()`` until it holds."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done(), what


def wait_metric(http: httpx.Client, name: str, value: float, timeout: float = 20.0) -> None:
    wait_until(lambda: metric(http, name) == value, timeout, name)


def wait_metric_above(http: httpx.Client, name: str, timeout: float = 20.0) -> None:
    start, deadline = metric(http, name), time.monotonic() + timeout
    while metric(http, name) == start and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(http, name) > start, name


def wait_pool_empty(server: ServerThread, timeout: float = 30.0) -> None:
    engine_checks.wait_server_pool_empty(server, timeout)


@contextmanager
def blocker(http: httpx.Client) -> Iterator[None]:
    """A long stream holding the only running slot until the block ends (then the client hangs up)."""
    with http.stream("POST", "/v1/completions", json=BLOCKER) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a dropped iterator closes the response (a hang-up)
        next(lines)
        yield
        assert metric(http, "prefixserve_num_requests_running") == 1, "the blocker ended too early"


def refused_total(http: httpx.Client, reason: str) -> float:
    return metric(http, f'prefixserve_requests_refused_total{{reason="{reason}"}}')


def assert_429(response: httpx.Response, code: str) -> dict[str, Any]:
    assert response.status_code == 429, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == code, error
    return error  # type: ignore[no-any-return]


def test_the_queue_bound_refuses_with_429_counts_it_and_the_engine_keeps_serving(
    server: ServerThread, http: httpx.Client
) -> None:
    refused = refused_total(http, "queue_requests")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    with concurrent.futures.ThreadPoolExecutor(2) as pool, blocker(http):  # the blocker goes first
        body = {"prompt": "Waiting in line", "max_tokens": 4}
        waiting = [pool.submit(http.post, "/v1/completions", json=body) for _ in range(2)]
        wait_metric(http, "prefixserve_num_requests_waiting", 2)
        response = http.post("/v1/completions", json=body)
        error = assert_429(response, "queue_full")
        assert "2 requests are waiting" in error["message"]
        with pytest.raises(openai.RateLimitError) as sdk:  # what the official client sees
            client.completions.create(model="default", prompt="me too", max_tokens=4)
        assert int(sdk.value.response.headers["retry-after"]) >= 1
        wait_metric(http, 'prefixserve_requests_refused_total{reason="queue_requests"}', refused + 2)
        assert metric(http, "prefixserve_max_waiting_requests") == 2
    # the blocker's client hung up: the queue drains and every queued request is served
    assert [f.result().status_code for f in waiting] == [200, 200]
    again = http.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 3})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    wait_pool_empty(server)


def test_a_request_past_its_queue_deadline_is_refused_with_429_before_it_runs(
    server: ServerThread, http: httpx.Client
) -> None:
    # one long stream hung up early first, as the tests before this one leave it: a sequence that ended
    # short of its max_tokens caps how long the slot schedule expects the next blocker to run, so the
    # requests below are admitted on a short estimate and dropped at their deadline (without it, the
    # blocker's 16,000 tokens refuse them at arrival: run alone, this test failed)
    with http.stream("POST", "/v1/completions", json=BLOCKER) as early:
        next(early.iter_lines())
    wait_pool_empty(server)
    late_name = "prefixserve_requests_dropped_deadline_total"
    dropped, estimated = metric(http, late_name), refused_total(http, "deadline")
    with blocker(http):
        wait_metric_above(http, "prefixserve_generation_tokens_total")  # a snapshot after its prefill
        refusals, first_writes = metric(http, f"{REFUSAL}_count"), metric(http, f"{FIRST_WRITE}_count")
        computed = metric(http, "prefixserve_prompt_tokens_computed_total")
        body = {"prompt": list(range(5000, 5040)), "max_tokens": 4}
        # 1.5 s: the arrival check admits an estimate within DEADLINE_MARGIN (0.6) of the time left, and
        # the capped estimate is however long the early stream ran before its hang-up was seen (0.4 s on
        # a loaded CI machine, which refused a 0.5 s deadline at arrival); the blocker runs far longer
        started = time.monotonic()
        response = http.post("/v1/completions", json=body, headers={QUEUE_DELAY_HEADER: "1.5"})
        assert time.monotonic() - started >= 1.5, response.text
        assert "queue deadline" in assert_429(response, "queue_timeout")["message"]
        # streamed: the status waits for the first output, so the client gets the 429 too, not a 200
        stream_body = {**body, "prompt": list(range(6000, 6040)), "stream": True}
        with http.stream(
            "POST", "/v1/completions", json=stream_body, headers={QUEUE_DELAY_HEADER: "0.3"}
        ) as streamed:
            streamed.read()
            assert_429(streamed, "queue_timeout")
        # the streamed one, with the shorter deadline, may instead be refused at its arrival by the
        # deadline estimate where a loaded machine decodes the blocker slower than the estimate's cap
        # (either is a refusal before it runs); the unstreamed one waited its 1.5 s (above)
        wait_until(
            lambda: metric(http, late_name) + refused_total(http, "deadline") == dropped + estimated + 2
        )
        both_dropped = metric(http, late_name) == dropped + 2
        assert both_dropped or metric(http, late_name) == dropped + 1
        # both 429s timed from their route's start; the streamed one's from its (final) first output
        wait_metric(http, f"{REFUSAL}_count", refusals + 2)
        assert not both_dropped or metric(http, f"{FIRST_WRITE}_count") == first_writes + 1
        # neither prompt ran (the blocker only decodes meanwhile)
        assert metric(http, "prefixserve_prompt_tokens_computed_total") == computed
        assert metric(http, "prefixserve_num_requests_waiting") == 0
    wait_pool_empty(server)
    # served well within a generous deadline
    ok = http.post("/v1/completions", json=body, headers={QUEUE_DELAY_HEADER: "60"})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 40
    wait_pool_empty(server)


def test_a_streamed_chat_is_timed_through_each_stage_outside_the_engine(
    server: ServerThread, http: httpx.Client
) -> None:
    """intake, to the engine, its first token back, the first write: one observation each, all on
    the one monotonic clock (a stage cannot take longer than the whole request did)."""
    stages = [f"prefixserve_{name}" for name, _ in PATH_STAGES.values() if name != "refusal_seconds"]
    before = {name: (metric(http, f"{name}_count"), metric(http, f"{name}_sum")) for name in stages}
    started = time.monotonic()
    body = {"messages": [{"role": "user", "content": "Where does the time go?"}], "max_tokens": 3}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    took = time.monotonic() - started
    assert '"assistant"' in chunks[0]
    for name in stages:
        wait_metric(http, f"{name}_count", before[name][0] + 1)
        assert 0 <= metric(http, f"{name}_sum") - before[name][1] <= took, name
    wait_pool_empty(server)


def test_a_request_that_cannot_start_in_time_is_refused_at_arrival_while_the_engine_is_held(
    server: ServerThread, http: httpx.Client, tmp_path: Path
) -> None:
    loop = server.engine_loop
    refused = refused_total(http, "deadline")
    at_http = metric(http, "prefixserve_requests_refused_http_total")
    held, go = tmp_path / "held", tmp_path / "go"
    body = {"prompt": "Waiting in line", "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(2) as pool, blocker(http):
        first = pool.submit(http.post, "/v1/completions", json=body)
        wait_metric(http, "prefixserve_num_requests_waiting", 1)
        hold = loop.call(functools.partial(engine_checks.hold, held=str(held), go=str(go)))
        while not held.exists():
            time.sleep(0.01)
        # the engine's loop is held between two steps; what it published last says one request waits
        state = loop.queue_state
        assert state is not None and state.waiting == 1
        # ... with drain rates a short CPU run cannot measure: one request starts every 4 s
        gate = server.app.state.arrival_gate
        measured = state._replace(taken=time.monotonic(), request_rate=0.25)
        gate.loop = argparse.Namespace(queue_state=measured)
        try:
            late = http.post("/v1/completions", json=body, headers={QUEUE_DELAY_HEADER: "2"})
            assert "would wait about" in assert_429(late, "queue_timeout")["message"]
            second = pool.submit(http.post, "/v1/completions", json=body)  # no deadline: to the engine
            assert refused_total(http, "deadline") == refused + 1
            assert metric(http, "prefixserve_requests_refused_http_total") == at_http + 1
            assert not hold.done() and not second.done()  # decided here, the engine still held
        finally:
            gate.loop = loop
            go.touch()
        hold.result(30)
    # the blocker's client hung up: the engine serves the others
    assert [f.result().status_code for f in (first, second)] == [200, 200]
    wait_pool_empty(server)
    assert loop.queue_state is not None and loop.queue_state.waiting == 0


def test_a_streamed_client_that_leaves_while_queued_is_aborted(
    server: ServerThread, http: httpx.Client
) -> None:
    aborted = metric(http, "prefixserve_requests_aborted_total")
    with blocker(http):
        body = {"prompt": "Climb " * 20, "max_tokens": 8, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=1.0) as impatient,
            pytest.raises(httpx.ReadTimeout),
            impatient.stream("POST", "/v1/completions", json=body),
        ):
            pass
        wait_metric(http, "prefixserve_requests_aborted_total", aborted + 1)
        assert metric(http, "prefixserve_num_requests_waiting") == 0
    wait_pool_empty(server)


def test_a_bad_queue_delay_header_is_a_400_naming_it(http: httpx.Client) -> None:
    for value in ("soon", "0", "-1", "nan", "inf"):
        response = http.post("/v1/completions", json={"prompt": "x"}, headers={QUEUE_DELAY_HEADER: value})
        assert response.status_code == 400, value
        assert response.json()["error"]["param"] == QUEUE_DELAY_HEADER


def test_the_deadline_is_the_smaller_of_the_flag_and_the_header() -> None:
    class Fake:
        def __init__(self, headers: dict[str, str]) -> None:
            self.headers = headers

    def delay(server: float | None, header: str | None) -> float | None:
        before = time.monotonic()
        deadline = queue_deadline(Fake({} if header is None else {QUEUE_DELAY_HEADER: header}), server)  # type: ignore[arg-type]
        return None if deadline is None else round(deadline - before, 1)

    assert delay(None, None) is None
    assert delay(5.0, None) == 5.0
    assert delay(None, "2.5") == 2.5
    assert delay(5.0, "2.5") == 2.5 and delay(1.0, "2.5") == 1.0
    with pytest.raises(APIError):
        delay(5.0, "-3")


def test_serve_flags_make_the_overload_settings() -> None:
    def parse(**kw: Any) -> OverloadSettings:
        base = {
            "max_waiting_requests": None,
            "max_waiting_tokens": None,
            "max_queue_delay": None,
            "stream_stall_timeout": 60.0,
        }
        return overload_settings(argparse.Namespace(**{**base, **kw}))

    assert parse() == OverloadSettings()
    settings = parse(
        max_waiting_requests=0, max_waiting_tokens=5000, max_queue_delay=2.0, stream_stall_timeout=0
    )
    assert settings.limits == AdmissionLimits(0, 5000)
    assert (settings.max_queue_delay, settings.stream_stall_timeout) == (2.0, None)
    for bad in ({"max_waiting_requests": -1}, {"max_queue_delay": 0.0}, {"stream_stall_timeout": -2.0}):
        with pytest.raises(ValueError):
            parse(**bad)


def test_a_prompt_past_the_context_is_a_400_whatever_the_queue_holds(long_config_path: Path) -> None:
    """The queue's token bound would refuse a 20,000-token prompt with a 429 to retry whenever anything
    waits; a prompt no context can hold is refused as the idle server refuses it: a 400."""
    overload = OverloadSettings(AdmissionLimits(max_waiting_requests=2, max_waiting_tokens=64))
    app = build_app(one_at_a_time(long_config_path), overload=overload)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        with concurrent.futures.ThreadPoolExecutor(2) as pool, blocker(http):
            body = {"prompt": list(range(300, 340)), "max_tokens": 4}
            queued = pool.submit(http.post, "/v1/completions", json=body)
            wait_metric(http, "prefixserve_num_requests_waiting", 1)
            past = http.post("/v1/completions", json={"prompt": [7] * 20000, "max_tokens": 4})
            assert past.status_code == 400, past.text
            assert past.json()["error"]["code"] == "context_length_exceeded"
            room = http.post("/v1/completions", json={**body, "max_tokens": 16380})
            assert room.status_code == 400 and room.json()["error"]["param"] == "max_tokens"
            assert_429(http.post("/v1/completions", json={**body, "prompt": [7] * 100}), "queue_full")
            short = {**body, "prompt": list(range(400, 410))}  # under the token bound: it waits too
            second = pool.submit(http.post, "/v1/completions", json=short)  # the request bound is reached
            wait_metric(http, "prefixserve_num_requests_waiting", 2)
            past = http.post("/v1/completions", json={"prompt": [7] * 20000, "max_tokens": 4})
            assert past.status_code == 400 and past.json()["error"]["code"] == "context_length_exceeded"
            assert (
                "2 requests are waiting"
                in assert_429(http.post("/v1/completions", json=body), "queue_full")["message"]
            )
        # the blocker's client hung up: the queue drained
        assert queued.result().status_code == second.result().status_code == 200
        wait_pool_empty(srv)


# ---- a client that stops reading -----------------------------------------------------------------
@contextmanager
def small_buffer_server(app: Any) -> Iterator[str]:
    """A live server whose sockets have a small send buffer (accepted sockets inherit it from the
    listener), so that a client that reads nothing blocks the server's writes after a few KB."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    server = GracefulServer(uvicorn.Config(app, log_level="warning", lifespan="on"), grace_s=1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_stream_whose_client_stops_reading_is_aborted_and_frees_its_kv(long_config_path: Path) -> None:
    config = EngineConfig(model=f"dummy:{long_config_path}", device="cpu", num_kv_blocks=4200, max_num_seqs=8)
    app = build_app(config, overload=OverloadSettings(stream_stall_timeout=1.0))
    loop = app.state.engine_loop
    with small_buffer_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({**BLOCKER, "n": 4, "logprobs": 5}).encode()
        reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((host, int(port)))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        reader.sendall(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:  # ... and never reads
            wait_metric(http, "prefixserve_streams_stalled_total", 1, timeout=120)
            wait_metric(http, "prefixserve_requests_aborted_total", 1)
            assert loop.call(engine_checks.blocks_in_use).result(10) == 0  # freed, the client still there
            assert metric(http, "prefixserve_generation_tokens_total") < 4 * BLOCKER["max_tokens"]
            ok = http.post("/v1/completions", json={"prompt": "next", "max_tokens": 3})
            assert ok.status_code == 200
        finally:
            reader.close()
        assert loop.call(engine_checks.live_requests_after_integrity_check).result(10) == 0
