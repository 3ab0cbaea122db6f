"""The OpenAI-compatible server, live on loopback, driven by the official ``openai`` client and httpx.

One server per module (the tiny dummy model, an API key); tests run in order and each leaves the
pool empty. Pinned applications are in test_server_application.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_checks
import httpx
import openai
import pytest

import prefixserve
from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.server import ServerThread, build_app

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM = "You are a terse assistant for a bicycle shop. " * 12  # ~120 tokens: several KV blocks


@pytest.fixture(
    scope="module",
    params=[(False, False), (True, False), (True, True)],
    ids=["sync", "async-scheduling", "engine-process"],
)
def server(tiny_config_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    # async scheduling (on by default under CUDA graphs) delays each step's outputs by one step();
    # engine-process runs the engine in a child process (serve's default on a GPU)
    async_scheduling, own_process = request.param
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        num_kv_blocks=512,
        max_num_seqs=64,
        async_scheduling=async_scheduling,
    )
    with ServerThread(build_app(config, api_key=API_KEY, engine_process=own_process)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def blocks_used(server: ServerThread) -> int:
    return int(server.engine_loop.call(engine_checks.blocks_in_use).result(10))


wait_pool_empty = engine_checks.wait_server_pool_empty


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def greedy_completion(client: openai.OpenAI, prompt: str, max_tokens: int = 24, **kw: Any) -> Any:
    return client.completions.create(
        model="default", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


# ---- the happy paths ---------------------------------------------------------------------------
def test_models_health_and_metrics(server: ServerThread, client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("dummy")
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ping").json() == http.post("/ping").json() == {"status": "ok"}  # vLLM's, for SageMaker
    assert http.get("/version").json() == {"version": prefixserve.__version__}
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'\nversion = "{prefixserve.__version__}"\n' in pyproject  # one version, two places
    text = http.get("/metrics").text
    for name in (
        "prefixserve_requests_total",
        "prefixserve_prompt_tokens_total",
        "prefixserve_generation_tokens_total",
        "prefixserve_prefix_cache_hit_tokens_total",
        "prefixserve_attention_kv_tokens_read_total",
        "prefixserve_attention_kv_tokens_logical_total",
        "prefixserve_num_requests_running",
        "prefixserve_num_requests_waiting",
        "prefixserve_kv_usage_ratio",
        "prefixserve_kv_free_fragmentation",
        "prefixserve_kv_longest_free_run",
        "prefixserve_kv_run_evicted_blocks_total",
        "prefixserve_gpu_memory_reserved_bytes",
        "prefixserve_time_to_first_token_seconds_bucket",
        "prefixserve_inter_token_latency_seconds_bucket",
    ):
        assert name in text, name


def test_completion_and_chat(client: openai.OpenAI, server: ServerThread, http: httpx.Client) -> None:
    out = greedy_completion(client, "The bicycle chain", max_tokens=8)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    chat = client.chat.completions.create(
        model=out.model, messages=[{"role": "user", "content": "Hi!"}], max_completion_tokens=6, temperature=0
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6
    assert metric(http, "prefixserve_time_to_first_token_seconds_count") >= 2
    wait_pool_empty(server)


def test_streaming_equals_non_streamed(client: openai.OpenAI, server: ServerThread) -> None:
    prompt = "Tell me about wheels and spokes"
    full = greedy_completion(client, prompt, max_tokens=32).choices[0].text

    def streamed(**options: bool) -> list[Any]:
        kw = {"model": "default", "prompt": prompt, "max_tokens": 32, "temperature": 0}
        return list(client.completions.create(**kw, stream=True, stream_options=options))

    chunks = streamed(include_usage=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 32
    continuous = streamed(include_usage=True, continuous_usage_stats=True)  # vLLM's: usage on every chunk
    counts = [c.usage.completion_tokens for c in continuous if c.choices]
    assert counts == sorted(counts) and counts[-1] == 32 and counts[0] >= 1
    assert {c.usage.prompt_tokens for c in continuous} == {chunks[-1].usage.prompt_tokens}
    assert "".join(c.choices[0].text for c in continuous if c.choices) == full

    messages = [{"role": "user", "content": "Which tyre pressure?"}]
    chat_full = client.chat.completions.create(
        model="default", messages=messages, max_tokens=24, temperature=0
    )
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat_full.choices[0].message.content
    wait_pool_empty(server)


def test_n_samples(client: openai.OpenAI) -> None:
    out = client.completions.create(model="default", prompt="Gear ratios", n=3, max_tokens=6, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) > 1  # independent samples
    batch = client.completions.create(
        model="default", prompt=["one", "two"], n=2, max_tokens=3, temperature=0
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "x"}], n=3, max_tokens=4, seed=1
    )
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "x"}], n=3, max_tokens=4, seed=1, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]


def test_stop_strings(client: openai.OpenAI) -> None:
    text = greedy_completion(client, "Brakes and levers", max_tokens=24).choices[0].text
    stop = text[8:11]
    assert stop
    out = greedy_completion(client, "Brakes and levers", max_tokens=24, stop=[stop, "\u2603never"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.find(stop)]
    streamed = client.completions.create(
        model="default", prompt="Brakes and levers", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model="default", prompt="Saddle", max_tokens=12, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(99)


def test_logprobs(client: openai.OpenAI) -> None:
    out = greedy_completion(client, "Pedals", max_tokens=5, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Spokes?"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob  # greedy: the chosen token is the top one
    assert bytes(content[0].bytes).decode() == content[0].token


def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI) -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements" (vLLM does so); logprobs=0 gives the sampled token's alone."""
    for k in (0, 1):
        out = client.completions.create(
            model="default", prompt="Chain", max_tokens=8, temperature=1.0, seed=3, logprobs=k
        )
        lp = out.choices[0].logprobs
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == value and len(top) <= k + 1


def test_nulls_take_the_defaults(http: httpx.Client) -> None:
    """OpenAI's spec marks these fields nullable, and clients send the unset ones as null."""
    nulls = {"n": None, "stream": None, "stream_options": None, "temperature": None, "seed": None}
    body = {"prompt": "Gears", "max_tokens": 3, "echo": None, "logprobs": None, **nulls}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    chat = {"messages": MSG, "max_tokens": 2, "logprobs": None, "tools": None, "tool_choice": None, **nulls}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


def test_cached_tokens_on_repeated_system_prompt(client: openai.OpenAI, server: ServerThread) -> None:
    system = f"Session {uuid.uuid4().hex}. " + SYSTEM
    cached = []
    for question in ("How do I fix a flat?", "How do I oil a chain?"):
        out = client.chat.completions.create(
            model="default",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=2,
            temperature=0,
        )
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] >= 64
    wait_pool_empty(server)


# ---- refusals ----------------------------------------------------------------------------------
TOO_LONG = [5] * 2100  # the tiny model's context is 2048
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
BAD_INPUTS: list[tuple[str, str, Any, int, str]] = [
    # (id, route, body (dict -> JSON, bytes -> raw), status, words in the message)
    ("malformed-json", C, b'{"prompt": "hi", ', 400, "not valid JSON"),
    ("not-an-object", C, b"[1, 2]", 400, "JSON object"),
    ("missing-prompt", C, {"model": "default"}, 400, "'prompt' is a required field"),
    ("missing-messages", CH, {"max_tokens": 3}, 400, "'messages' is a required field"),
    ("missing-role", CH, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("wrong-type-temp", C, {"prompt": "hi", "temperature": "hot"}, 400, "'temperature'"),
    ("wrong-type-max", C, {"prompt": "hi", "max_tokens": "10"}, 400, "'max_tokens'"),
    ("wrong-type-prompt", C, {"prompt": 5}, 400, "'prompt' must be"),
    ("wrong-type-messages", CH, {"messages": "hi"}, 400, "'messages'"),
    ("wrong-type-stop", C, {"prompt": "hi", "stop": 3}, 400, "'stop' must be"),
    ("unknown-model", C, {"prompt": "hi", "model": "gpt-9"}, 404, "'gpt-9' does not exist"),
    ("too-long-ids", C, {"prompt": TOO_LONG}, 400, "over the context length"),
    ("too-long-text", C, {"prompt": "bike " * 2100}, 400, "over the context length"),
    ("max-tokens-fit", C, {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens=5000 does not fit"),
    ("max-tokens-zero", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("n-zero", C, {"prompt": "hi", "n": 0}, 400, "n must be"),
    ("n-huge", CH, {"messages": MSG, "n": 1000}, 400, "n must be"),
    ("temp-negative", C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature must be >= 0"),
    ("top-p-zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("top-p-big", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("many-stops", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop strings"),
    ("invalid-utf8", C, b'{"prompt": "caf\xc3\x28"}', 400, "not valid UTF-8"),
    ("lone-surrogate", C, b'{"prompt": "\\ud800"}', 400, "surrogate"),
    ("unknown-app", C, {"prompt": "hi", "application": "nope"}, 400, "unknown application 'nope'"),
    ("unknown-app-chat", CH, {"messages": MSG, "application": "nope"}, 400, "unknown application 'nope'"),
    ("top-logprobs", CH, {"messages": MSG, "top_logprobs": 2}, 400, "logprobs"),
    ("big-logprobs", C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs must be"),
    ("empty-prompt", C, {"prompt": ""}, 400, "prompt is empty"),
    ("bad-token-id", C, {"prompt": [10**9]}, 400, "token ids must be in"),
    (
        "stream-options-alone",
        C,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream=true",
    ),
    ("min-over-max", C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 9}, 400, "min_tokens must be <="),
    (
        "completion-tokens-zero",
        CH,
        {"messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("empty-tools", CH, {"messages": MSG, "tools": []}, 400, "tools must not be empty"),
    (
        "image-part",
        CH,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "of type 'image_url' is not supported",
    ),
]


def assert_error(response: httpx.Response, status: int, words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    return error


def test_reset_prefix_cache_in_every_engine_mode(http: httpx.Client, server: ServerThread) -> None:
    body = {"prompt": f"Session {uuid.uuid4().hex}. " + SYSTEM, "max_tokens": 2, "temperature": 0}

    def cached_tokens() -> int:
        usage = http.post("/v1/completions", json=body).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens() == 0 and cached_tokens() >= 64
    wait_pool_empty(server)
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["reset"] is True, r.text
    assert cached_tokens() == 0
    wait_pool_empty(server)


@pytest.mark.parametrize(
    ("route", "body", "status", "words"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_refused_and_server_keeps_serving(
    http: httpx.Client, route: str, body: Any, status: int, words: str
) -> None:
    kwargs = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    assert_error(http.post(route, **kwargs), status, words)
    ok = http.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_error_params_name_the_field(http: httpx.Client) -> None:
    assert (
        assert_error(http.post("/v1/completions", json={"prompt": "x", "top_p": 2}), 400, "top_p")["param"]
        == "top_p"
    )
    err = assert_error(http.post("/v1/completions", json={"prompt": TOO_LONG}), 400, "context length")
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    err = assert_error(
        http.post("/v1/completions", json={"prompt": "x", "model": "m"}), 404, "does not exist"
    )
    assert (err["param"], err["code"]) == ("model", "model_not_found")
    # a limit sent as max_completion_tokens that the context cannot hold is named as it was sent
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, "max_completion_tokens=")
    assert err["param"] == "max_completion_tokens" and "max_tokens=" not in err["message"]


def test_body_too_large_routes_and_methods(http: httpx.Client) -> None:
    huge = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    assert_error(http.post("/v1/completions", content=huge), 413, "over the limit")
    deep = b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(http.post("/v1/completions", content=deep), 400, "nested too deeply")
    assert_error(http.get("/v1/nope"), 404, "no route")
    assert_error(http.get("/v1/completions"), 405, "not allowed")
    assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_api_key_required(server: ServerThread) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert_error(anon.post("/v1/completions", json=body), 401, "missing API key")
        assert_error(anon.get("/v1/models"), 401, "API key")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(anon.post("/v1/chat/completions", json=body, headers=wrong), 401, "incorrect API key")
        assert anon.get("/health").status_code == 200
        assert anon.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="hi", max_tokens=1)
    # Anthropic's clients send the key as x-api-key; its errors come in Anthropic's shape
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "hi"}]
    assert claude.messages.create(model="default", max_tokens=1, messages=ask).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as err:
        claude.with_options(api_key="wrong").messages.create(model="default", max_tokens=1, messages=ask)
    assert err.value.body["error"]["type"] == "authentication_error"
    both = {"Authorization": "Bearer some-other-token", "x-api-key": API_KEY}  # either one matching will do
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert anon.post("/v1/completions", json=body, headers=both).status_code == 200


# ---- disconnects and tenancy -------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server: ServerThread, http: httpx.Client) -> None:
    aborted = metric(http, "prefixserve_requests_aborted_total")
    body = {"prompt": "A long ride " * 40, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert blocks_used(server) > 0
    wait_pool_empty(server, timeout=10)
    assert metric(http, "prefixserve_requests_aborted_total") == aborted + 1
    assert metric(http, "prefixserve_kv_blocks_used") == 0


def test_disconnect_while_waiting_non_streamed(server: ServerThread) -> None:
    body = {"prompt": "Climb " * 40, "max_tokens": 1800, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=1.0) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post("/v1/completions", json=body)
    wait_pool_empty(server, timeout=10)


def test_cache_salt_isolates_tenants(http: httpx.Client, server: ServerThread) -> None:
    prompt = f"Tenant document {uuid.uuid4().hex}: " + "frame geometry and fork rake. " * 20

    def cached(salt: str | None) -> int:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("alice") == 0
    assert cached("bob") == 0  # same prompt, other salt: nothing shared
    assert cached(None) == 0
    assert cached("alice") > 0
    assert cached("bob") > 0
    wait_pool_empty(server)


def test_sse_wire_format(http: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert all(p["usage"] is None for p in payloads[:-1])
