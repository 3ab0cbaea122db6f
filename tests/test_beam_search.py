"""Beam search: the search's bookkeeping against vLLM's algorithm written out plainly (random
synthetic models, early stop included), the engine's search against one driven by HF transformers'
fp32 forward of the default model, the same outputs with sharing on, no blocks left held, and the
server's ``use_beam_search`` answers (completions, chats, streamed) and refusals."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve import LLM
from prefixserve.sampling.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from tests.conftest import assert_pool_empty

# token id sequences -> the log-softmax of each one's next token (float64)
Model = Callable[[list[list[int]]], list[torch.Tensor]]


def synthetic_model(vocab: int, seed: int) -> Model:
    """A deterministic random next-token distribution for every token sequence."""

    def one(tokens: list[int]) -> torch.Tensor:
        digest = hashlib.sha256(f"{seed}:{tokens}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return (torch.randn(vocab, generator=gen, dtype=torch.float64) * 2).log_softmax(-1)

    def logprobs(batch: list[list[int]]) -> list[torch.Tensor]:
        return [one(tokens) for tokens in batch]

    return logprobs


def top(logp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, ids = logp.topk(min(k, logp.numel()))
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def reference_search(
    model: Model, prompt: list[int], width: int, max_tokens: int, stops: set[int], penalty: float
) -> list[tuple[list[int], float]]:
    """vLLM's beam search as its ``LLM.beam_search`` runs it: max_tokens rounds, each beam's 2W best
    tokens, every stop candidate finished, the W best of the rest by score; then the W best of all."""

    def score(tokens: list[int], cum: float) -> float:
        length = len(tokens) - (tokens[-1] in stops and len(tokens) > len(prompt))
        return cum / length**penalty

    beams: list[tuple[list[int], float]] = [(prompt, 0.0)]
    completed: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        grown = []
        for (tokens, cum), logp in zip(beams, model([tokens for tokens, _ in beams]), strict=True):
            for token, lp in top(logp, 2 * width):
                child = ([*tokens, token], cum + lp)
                (completed if token in stops else grown).append(child)
        grown.sort(key=lambda b: score(*b), reverse=True)
        beams = grown[:width]
    completed += beams
    completed.sort(key=lambda b: score(*b), reverse=True)
    return [(tokens[len(prompt) :], cum) for tokens, cum in completed[:width]]


def run_search(model: Model, prompts: list[list[int]], params: BeamSearchParams, eos: set[int]) -> list[Any]:
    search = BeamSearch(prompts, params, eos, [params.max_tokens or 1] * len(prompts))
    steps = 0
    while not search.done:
        logps = model([tokens for _, tokens in search.pending()])
        search.advance([top(logp, 2 * params.beam_width) for logp in logps])
        steps += 1
    return search.results()


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(3, 9),
    seed=st.integers(0, 10**6),
    width=st.integers(1, 4),
    max_tokens=st.integers(1, 7),
    penalty=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
    stop_ids=st.lists(st.integers(0, 2), max_size=2, unique=True),
)
def test_the_search_equals_vllms_algorithm_run_to_max_tokens(
    vocab: int, seed: int, width: int, max_tokens: int, penalty: float, stop_ids: list[int]
) -> None:
    """Random models, widths, lengths and length penalties: the same beams, in the same order, with the
    same cumulative logprobs, though the search may stop early."""
    model = synthetic_model(vocab, seed)
    prompts = [[5, 3, 7], [1]]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty)
    got = run_search(model, prompts, params, set(stop_ids))
    for prompt, beams in zip(prompts, got, strict=True):
        want = reference_search(model, prompt, width, max_tokens, set(stop_ids), penalty)
        assert [(b.output_token_ids, b.cum_logprob) for b in beams] == want
        for b in beams:
            assert b.tokens[: len(prompt)] == prompt
            ended = bool(b.output_token_ids) and b.output_token_ids[-1] in stop_ids
            assert b.finish_reason == ("stop" if ended else "length")


def test_stop_token_ids_end_beams_and_ignore_eos_does_not_stop_them() -> None:
    model = synthetic_model(5, 11)
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True, stop_token_ids=[3])
    (beams,) = run_search(model, [[1, 2]], params, eos={0})
    want = reference_search(model, [1, 2], 2, 6, {3}, 1.0)
    assert [(b.output_token_ids, b.cum_logprob) for b in beams] == want
    assert all(b.stop_reason == (3 if b.finish_reason == "stop" else None) for b in beams)


def test_bad_params_name_the_field() -> None:
    for kwargs, field in [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": MAX_BEAM_WIDTH + 1}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "temperature": 0.5}, "temperature"),
        ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty"),
        ({"beam_width": 2, "stop_token_ids": [-1]}, "stop_token_ids"),
    ]:
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**kwargs)


# ---- the engine ---------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "Question: What is 2 + 2?\nAnswer:"]


def hf_model_fn(model: torch.nn.Module) -> Model:
    """HF's forward of whole sequences: a search round's beams (all of one length) in one batch, no
    padding."""

    def logprobs(batch: list[list[int]]) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(model(torch.tensor(batch)).logits[:, -1].double().log_softmax(-1))

    return logprobs


def test_the_engines_search_equals_one_on_hf_transformers_forward(
    default_llm: LLM, hf_gguf_model: torch.nn.Module
) -> None:
    """The default model in fp32: the same beams as a search whose every step is a direct HF forward
    of the whole sequence, cumulative logprobs within fp32 noise; no block stays held."""
    tok = default_llm.get_tokenizer()
    # 6 rounds: beams that end on EOS (after 1 and 3 tokens) and beams cut by length, as 8 gave
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outs = default_llm.beam_search(PROMPTS, params)
    eos = set(default_llm.engine.eos_ids)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        want = reference_search(hf_model_fn(hf_gguf_model), ids, 3, 6, eos, 1.0)
        assert len(out.sequences) == 3
        assert [s.output_token_ids for s in out.sequences] == [w[0] for w in want]
        for seq, (_, cum) in zip(out.sequences, want, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=2e-4)
            assert seq.tokens[: len(ids)] == ids
            assert seq.text == tok.decode(seq.output_token_ids[: -1 if seq.finish_reason == "stop" else None])
            assert set(seq.logprobs[0]) >= {seq.output_token_ids[0]} and len(seq.logprobs[0]) == 6
    assert_pool_empty(default_llm)


def test_sharing_on_gives_the_same_beams(default_llm: LLM) -> None:
    """The shared-prefix (cascade) kernels under beam search's batches: the same beams as the reference
    attention."""
    params = BeamSearchParams(beam_width=4, max_tokens=4, length_penalty=0.5)
    want = default_llm.beam_search(PROMPTS, params)
    shared = LLM(dtype="float32", device="cpu", attention="cascade", num_kv_blocks=1024, progress=False)
    got = shared.beam_search(PROMPTS, params)
    for a, b in zip(got, want, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx(
            [s.cum_logprob for s in b.sequences], abs=2e-4
        )
    assert_pool_empty(shared)
    shared.shutdown()


def test_bad_prompts_are_refused_with_a_clear_error(default_llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="no prompts"):
        default_llm.beam_search([], params)
    with pytest.raises(ValueError, match="max_tokens"):
        default_llm.beam_search("hi", BeamSearchParams(beam_width=2, max_tokens=10**6))
    with pytest.raises(TypeError, match="prompt"):
        default_llm.beam_search([{"text": "hi"}], params)
    assert_pool_empty(default_llm)


# ---- the server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_config_path: Path) -> LLM:
    """The tiny server's model (dummy weights are seeded) in this process."""
    return LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=512, progress=False)


def post(server: Any, path: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_completions_with_beam_search_answer_the_n_best_beams(tiny_server: Any, tiny_llm: LLM) -> None:
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = tiny_llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(3, max_tokens=5))
    body = {"prompt": prompts, "n": 3, "max_tokens": 5, "use_beam_search": True, "logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    r = post(tiny_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for c in choices:
        beam = want[c["index"] // 3].sequences[c["index"] % 3]
        assert c["token_ids"] == beam.output_token_ids
        assert c["text"] == beam.text
        assert c["finish_reason"] == beam.finish_reason
        lps = c["logprobs"]["token_logprobs"]
        assert sum(lps) == pytest.approx(beam.cum_logprob, abs=1e-4)
        assert all(len(t) >= 2 for t in c["logprobs"]["top_logprobs"])
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 6
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)

    stream = post(tiny_server, "/v1/completions", {**body, "stream": True, "return_token_ids": False})
    assert stream.status_code == 200, stream.text
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in choices}


def test_chat_with_beam_search(tiny_server: Any, tiny_openai: Any) -> None:
    ask = {
        "model": "default",
        "messages": [{"role": "user", "content": "hello"}],
        "n": 2,
        "max_tokens": 4,
        "extra_body": {"use_beam_search": True, "length_penalty": 0.0},
    }
    chat = tiny_openai.chat.completions.create(**ask)
    assert len(chat.choices) == 2
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)
    assert chat.usage.completion_tokens >= 2
    streamed = tiny_openai.chat.completions.create(**ask, stream=True)
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert texts == {c.index: c.message.content for c in chat.choices}
    assert finish == {c.index: c.finish_reason for c in chat.choices}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"stop": ["x"]}, "stop"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"n": MAX_BEAM_WIDTH + 1}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"echo": True, "max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"thinking_token_budget": 0}, "thinking_token_budget"),
    ],
)
def test_what_beam_search_cannot_honour_is_a_400_naming_it(
    tiny_server: Any, extra: dict[str, Any], param: str
) -> None:
    body = {"prompt": "hello", "n": 2, "max_tokens": 3, "use_beam_search": True, **extra}
    r = post(tiny_server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_length_penalty_without_beam_search_is_refused(tiny_server: Any) -> None:
    r = post(tiny_server, "/v1/completions", {"prompt": "hello", "length_penalty": 2.0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "length_penalty"


def test_a_batch_row_with_beam_search_is_a_400_row_and_the_others_run(tiny_llm: LLM) -> None:
    from prefixserve.entrypoints.batch_file import BatchRow
    from prefixserve.entrypoints.batch_runner import run_rows

    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    rows = [
        BatchRow(1, "beam", "/v1/completions", {**body, "n": 2, "use_beam_search": True}),
        BatchRow(2, "plain", "/v1/completions", body),
    ]
    out = {row["custom_id"]: row for row in run_rows(tiny_llm.engine, rows)}
    assert out["beam"]["response"]["status_code"] == 400
    assert out["beam"]["response"]["body"]["error"]["param"] == "use_beam_search"
    assert out["plain"]["response"]["status_code"] == 200
    assert_pool_empty(tiny_llm)


@pytest.mark.gpu
def test_on_a_gpu_the_sharing_kernels_and_graphs_give_the_reference_beams(tiny_config_path: Path) -> None:
    """fp32 on CUDA: the engine's own kernels (shared-prefix attention, decode graphs) find the same
    beams as the reference attention; a long shared prompt makes the beams' batches share it."""
    prompt = list(range(3, 603))
    prompts = [{"prompt_token_ids": [*prompt, 7, 8]}, {"prompt_token_ids": [*prompt, 9]}]
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    found = []
    for attention in ("reference", "auto"):
        llm = LLM(model=f"dummy:{tiny_config_path}", dtype="float32", device="cuda", attention=attention,
                  num_kv_blocks=2048, progress=False)  # fmt: skip
        found.append(llm.beam_search(prompts, params))
        assert_pool_empty(llm)
        llm.shutdown()
    for a, b in zip(*found, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        want = [s.cum_logprob for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx(want, abs=1e-4)


def test_echo_of_a_truncated_prompt_answers_the_kept_tokens(tiny_server: Any) -> None:
    """As a sampled answer: echo puts the kept tokens' text first, so the logprobs' offsets hold."""
    body = {"prompt": "hello world again and again", "max_tokens": 2, "echo": True, "logprobs": 0,
            "truncate_prompt_tokens": 3, "temperature": 0, "n": 1}  # fmt: skip
    sampled = post(tiny_server, "/v1/completions", body).json()["choices"][0]
    beam = post(tiny_server, "/v1/completions", {**body, "use_beam_search": True}).json()["choices"][0]
    kept = len(sampled["text"]) - sum(map(len, sampled["logprobs"]["tokens"][3:]))
    assert beam["text"][:kept] == sampled["text"][:kept]
    lp = beam["logprobs"]
    assert [beam["text"][o : o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"], strict=True)] == lp[
        "tokens"
    ]


def test_a_client_that_leaves_stops_the_search(tiny_server: Any) -> None:
    """Each step is shorter than the disconnect poll: the search itself checks between steps."""
    import time

    import httpx

    body = {"prompt": [5, 6, 7], "n": 4, "max_tokens": 1500, "ignore_eos": True, "use_beam_search": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=1.0)
    time.sleep(1.5)
    added = tiny_server.engine_loop.snapshot.get("requests_total", 0.0)
    time.sleep(1.0)
    assert tiny_server.engine_loop.snapshot.get("requests_total", 0.0) == added  # no step queued since
