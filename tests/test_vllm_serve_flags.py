"""A ``vllm serve`` command line runs here as it is: the model named first, ``--seed``,
``--gpu-memory-utilization``, ``--enable-prefix-caching``, ``--generation-config`` /
``--override-generation-config`` (the model's sampling defaults, for requests that set none), the
listener's TLS, root path and log options, and the periodic stats line (``--disable-log-stats``)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.entrypoints.args import engine_config_from_args
from prefixserve.entrypoints.cli import build_parser
from prefixserve.entrypoints.generation_config import sampling_defaults
from prefixserve.entrypoints.openai.server import ServerThread, build_app
from prefixserve.entrypoints.serve_args import uvicorn_options
from prefixserve.kv import cache as kv_cache
from prefixserve.model.config import ModelConfig
from prefixserve.serving.stats_log import busy, log_stats, stats_line

GENERATION = {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2}


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def tuned_model(tiny_config_path: Path, tmp_path: Path) -> str:
    """The tiny dummy model with a generation_config.json beside its config (greedy, 5 tokens)."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "config.json").write_text(tiny_config_path.read_text())
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return f"dummy:{folder / 'config.json'}"


# ---- the command line ------------------------------------------------------------------------------
def test_a_vllm_command_line_reaches_the_config() -> None:
    args = serve_args(
        "dummy:llama-3.1-8b",
        "--gpu-memory-utilization", "0.5",
        "--enable-prefix-caching",
        "--seed", "7",
        "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0.2, "max_new_tokens": 9}',
        "--trust-remote-code",
        "--uvicorn-log-level", "warning",
        "--disable-uvicorn-access-log",
        "--root-path", "/api",
        "--disable-log-stats",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert config.model == "dummy:llama-3.1-8b" and config.seed == 7
    assert config.gpu_memory_utilization == 0.5 and config.kv_memory_fraction is None
    assert config.enable_prefix_caching and config.generation_config == "vllm"
    assert config.override_generation_config == {"temperature": 0.2, "max_new_tokens": 9}
    assert args.disable_log_stats and not args.enable_log_requests
    listener = uvicorn_options(args)
    assert listener["log_level"] == "warning" and listener["access_log"] is False
    assert listener["root_path"] == "/api" and listener["ssl_keyfile"] is None
    plain = engine_config_from_args(serve_args())
    assert plain.model is None and plain.seed == 0 and plain.enable_prefix_caching
    assert plain.generation_config == "auto" and plain.override_generation_config == {}
    assert uvicorn_options(serve_args())["access_log"] is True


def test_contradictions_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="two models"):
        engine_config_from_args(serve_args("a.gguf", "--model", "b.gguf"))
    assert engine_config_from_args(serve_args("x.gguf", "--model", "x.gguf")).model == "x.gguf"
    with pytest.raises(ValueError, match="contradict"):
        engine_config_from_args(serve_args("--no-prefix-caching", "--enable-prefix-caching"))
    assert not engine_config_from_args(serve_args("--no-enable-prefix-caching")).enable_prefix_caching
    with pytest.raises(ValueError, match="not both"):
        engine_config_from_args(serve_args("--gpu-memory-utilization", "0.5", "--kv-memory-fraction", "0.5"))
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        uvicorn_options(serve_args("--ssl-keyfile", "key.pem"))
    with pytest.raises(SystemExit):
        serve_args("--override-generation-config", "[1]")


def test_vllm_tool_and_request_log_flags_are_taken() -> None:
    args = serve_args(
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--enable-log-requests", "--max-log-len", "9",
    )  # fmt: skip
    assert args.enable_log_requests and args.max_log_len == 9 and args.tool_call_parser == "hermes"
    assert not serve_args("--disable-log-requests").enable_log_requests
    assert serve_args("--tool-call-parser", "llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):  # a format the reader does not take is refused, naming the choices
        serve_args("--tool-call-parser", "mistral")
    with pytest.raises(ValueError, match="max-log-len"):
        uvicorn_options(serve_args("--max-log-len", "-1"))


def test_each_queued_request_is_logged_with_its_prompt_cut(
    tiny_config_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64)
    with caplog.at_level(logging.INFO, logger="prefixserve.requests"):
        with ServerThread(build_app(config, log_requests=True, max_log_len=4)) as srv:
            body = {"prompt": ["the cat sat on the mat", [5, 6, 7, 8, 9, 10]], "max_tokens": 2, "seed": 3}
            assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
        with ServerThread(build_app(config)) as quiet:
            assert httpx.post(f"{quiet.url}/v1/completions", json=body, timeout=60).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixserve.requests"]
    assert len(lines) == 2, lines  # one per prompt, none from the server without the flag
    assert (
        "prompt: 'the '" in lines[0]
        and "seed=3" in lines[0]
        and lines[0].startswith("received request cmpl-")
    )
    assert "prompt: None, prompt_token_ids: [5, 6, 7, 8] (6 tokens)" in lines[1]


# ---- the generation config -------------------------------------------------------------------------
def test_the_model_folders_generation_config_sets_the_defaults(tuned_model: str, tmp_path: Path) -> None:
    config = EngineConfig(model=tuned_model)
    assert sampling_defaults(config) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    config.generation_config = "vllm"
    assert sampling_defaults(config) == {}
    config.override_generation_config = {"top_k": 4}
    assert sampling_defaults(config) == {"top_k": 4}
    config.generation_config = "auto"
    config.override_generation_config = {"max_new_tokens": 3}
    assert sampling_defaults(config) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 3}
    config.override_generation_config = {"max_tokens": 3}
    with pytest.raises(ValueError, match=r"unknown keys \['max_tokens'\]"):
        sampling_defaults(config)
    config.override_generation_config = {"temperature": -1}
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults(config)
    config.override_generation_config = {}
    config.generation_config = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"generation_config\.json"):
        sampling_defaults(config)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{")
    config.generation_config = str(tmp_path / "broken")
    with pytest.raises(ValueError, match="not a JSON file"):
        sampling_defaults(config)


def test_llm_samples_with_the_defaults_when_given_no_params(tuned_model: str) -> None:
    llm = LLM(model=tuned_model, device="cpu", num_kv_blocks=64, progress=False)
    assert llm.get_default_sampling_params().max_tokens == 5
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    plain = llm.generate(prompt)[0].outputs[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0].token_ids
    assert plain == greedy and len(plain) <= 5
    vllm = LLM(model=tuned_model, device="cpu", num_kv_blocks=64, progress=False, generation_config="vllm")
    assert vllm.get_default_sampling_params() == SamplingParams()


def test_requests_that_set_nothing_take_the_model_defaults(tuned_model: str) -> None:
    config = EngineConfig(model=tuned_model, device="cpu", num_kv_blocks=128)
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:

        def complete(**body: object) -> dict:
            r = http.post("/v1/completions", json={"prompt": "the cat sat on", "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            return r.json()

        first, again = complete(), complete()
        assert first["usage"]["completion_tokens"] == 5  # max_new_tokens, not OpenAI's 16
        assert first["choices"][0]["text"] == again["choices"][0]["text"]  # temperature 0
        assert complete(temperature=0)["choices"][0]["text"] == first["choices"][0]["text"]
        assert complete(max_tokens=2)["usage"]["completion_tokens"] == 2  # a request's own value wins
        chat = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5


# ---- memory --------------------------------------------------------------------------------------
def test_gpu_memory_utilization_counts_everything_the_gpu_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    model = ModelConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64,
    )  # fmt: skip
    per_block = kv_cache.bytes_per_block(model, 16, torch.bfloat16)
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 60 * gib)  # 20 of 80 GiB in use
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    gpu = torch.device("cuda")
    blocks = kv_cache.blocks_for_budget(model, 16, torch.bfloat16, gpu, 0.85, reserve=gib, utilization=0.5)
    assert blocks == (40 * gib - 20 * gib - gib) // per_block
    with pytest.raises(ValueError, match="already in use"):
        kv_cache.blocks_for_budget(model, 16, torch.bfloat16, gpu, 0.85, reserve=gib, utilization=0.2)
    assert EngineConfig(device="cpu", gpu_memory_utilization=0.05).memory_fraction == 0.05


# ---- the listener ----------------------------------------------------------------------------------
def test_https_with_the_given_key_and_certificate(tiny_config_path: Path, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    args = serve_args("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api")
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64)
    with ServerThread(build_app(config), listener=uvicorn_options(args)) as srv:
        assert srv.url.startswith("https://")
        with httpx.Client(base_url=srv.url, verify=False, timeout=60) as http:
            assert http.get("/health").json() == {"status": "ok"}
            assert http.get("/openapi.json").status_code == 404  # served as ever behind the root path
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https", "http", 1) + "/health", timeout=5)


def test_the_stats_line_says_what_moved_and_an_idle_server_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    before = {"prompt_tokens_computed_total": 100, "generation_tokens_total": 50, "steps_total": 3}
    now = {
        "prompt_tokens_computed_total": 1100, "generation_tokens_total": 250, "steps_total": 9,
        "num_running": 4, "num_waiting": 1, "kv_blocks_used": 25, "kv_blocks_total": 100,
        "prefix_cache_hit_tokens_total": 300, "prompt_tokens_total": 400,
        "attention_kv_tokens_read_total": 1000, "attention_kv_tokens_logical_total": 4000,
    }  # fmt: skip
    line = stats_line(before, now, 2.0)
    assert "prompt throughput: 500.0 tokens/s" in line and "generation throughput: 100.0 tokens/s" in line
    assert "running: 4 reqs, waiting: 1 reqs" in line and "KV cache usage: 25.0%" in line
    assert "prefix cache hit rate: 75.0%" in line and "KV reads saved by sharing: 75.0%" in line
    assert busy(before, now) and not busy(now, now | {"num_running": 0, "num_waiting": 0})

    idle = {**now, "num_running": 0, "num_waiting": 0}
    states = iter([before, now, idle, idle, idle, idle])

    async def run() -> None:
        task = asyncio.create_task(log_stats(lambda: next(states, idle), interval=0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="prefixserve.stats"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixserve.stats"]
    assert len(lines) == 2, lines  # the busy interval, then one line as it went idle, then quiet
    assert "running: 4 reqs" in lines[0] and "running: 0 reqs" in lines[1]


def test_a_speculating_server_streams_what_it_answers_whole(tiny_config_path: Path) -> None:
    """Several tokens a step reach a stream in order; the stream's text is the whole answer's."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, speculative_config=spec
    )
    body = {"prompt": [5, 6, 7, 8, 9] * 8, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()
        chunks = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(chunks) == whole["choices"][0]["text"] and whole["usage"]["completion_tokens"] == 40
        metrics = http.get("/metrics").text
        assert "prefixserve_spec_decode_draft_tokens_total" in metrics
