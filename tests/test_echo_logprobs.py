"""Echo and prompt logprobs on the default model: equal to a direct fp32 forward (HF transformers on the
same GGUF), exact greedy checks, shared prefixes computed once and counted in cached_tokens; and the
server's answers (official ``openai`` client) for echo, penalties, bias and bad values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.engine.llm_engine import Engine
from prefixserve.entrypoints.openai.server import ServerThread, build_app
from tests.conftest import assert_pool_empty

FEW_SHOT = (
    "Question: What is the capital of France?\nAnswer: Paris\n\n"
    "Question: What is the capital of Japan?\nAnswer: Tokyo\n\n"
    "Question: What is the capital of Italy?\nAnswer: Rome\n\n"
    "Question: What is the capital of Spain?\nAnswer:"
)
CHOICES = [" Madrid", " Lisbon", " Berlin", " Barcelona and Valencia"]


HFRows = list[tuple[torch.Tensor, torch.Tensor]]  # ``hf_logprobs`` of each few-shot prompt


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's logprob given the ones before it ([len-1], from token 1) and each row's log-softmax."""
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], logp[:-1]


@pytest.fixture(scope="module")
def hf_rows(hf_gguf_model: torch.nn.Module, chunked_llm: LLM) -> HFRows:
    """``hf_logprobs`` of each few-shot prompt (``FEW_SHOT`` and a choice), one forward each for the
    module."""
    tok = chunked_llm.get_tokenizer()
    return [hf_logprobs(hf_gguf_model, tok.encode(FEW_SHOT + c, add_special_tokens=False)) for c in CHOICES]


@pytest.fixture(scope="module")
def chunked_llm() -> LLM:
    """Small prefill chunks (40 tokens) so the prompt rows come in several chunks."""
    return LLM(
        dtype="float32",
        device="cpu",
        attention="reference",
        num_kv_blocks=512,
        max_num_batched_tokens=40,
        progress=False,
    )


def test_prompt_logprobs_equal_a_direct_fp32_forward(chunked_llm: LLM, hf_rows: HFRows) -> None:
    tok = chunked_llm.get_tokenizer()
    prompts = [FEW_SHOT + c for c in CHOICES]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    outs = chunked_llm.generate(prompts, params)
    worst = 0.0
    for out, (want, rows) in zip(outs, hf_rows, strict=True):
        ids = out.prompt_token_ids
        assert ids == tok.encode(out.prompt, add_special_tokens=False)
        got = out.prompt_token_logprobs
        assert got[0] is None and out.prompt_top_logprobs[0] == []
        assert len(got) == len(ids)
        diff = (torch.tensor(got[1:]) - want).abs().max().item()
        worst = max(worst, diff)
        for i, top in enumerate(out.prompt_top_logprobs[1:]):
            assert len(top) == 5
            top_ids = [t for t, _ in top]
            ref_vals, _ = rows[i].topk(5)
            assert torch.allclose(torch.tensor([v for _, v in top]), ref_vals, atol=1e-4)
            # the greedy check lm-eval makes is exact: same fp32 values for the token and the top
            if top_ids[0] == ids[i + 1]:
                assert top[0][1] == got[i + 1]
            else:
                assert top[0][1] > got[i + 1]
    assert worst < 1e-4
    assert_pool_empty(chunked_llm)


def test_shared_prefix_is_computed_once_and_counted(chunked_llm: LLM) -> None:
    """A second round of the same few-shot context takes its cached blocks and their kept prompt
    logprobs (cached_tokens > 0, the same values), and a request without prompt logprobs is
    unaffected."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    first = chunked_llm.generate(FEW_SHOT + CHOICES[0], params)[0]
    again = chunked_llm.generate(FEW_SHOT + CHOICES[1], params)[0]
    bs = chunked_llm.engine.config.block_size
    shared = 0
    while first.prompt_token_ids[shared] == again.prompt_token_ids[shared]:
        shared += 1
    assert again.num_cached_tokens == (shared // bs) * bs - 1 > 0
    assert again.prompt_token_logprobs[:shared] == first.prompt_token_logprobs[:shared]
    assert again.prompt_top_logprobs[:shared] == first.prompt_top_logprobs[:shared]
    full = chunked_llm.generate(FEW_SHOT + CHOICES[1], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert full.prompt_logprobs is None and full.num_cached_tokens > 0
    assert_pool_empty(chunked_llm)


# ---- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    config = EngineConfig(
        dtype="float32", device="cpu", attention="reference", num_kv_blocks=512, max_num_batched_tokens=48
    )
    with ServerThread(build_app(engine=Engine(config, progress=False))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    """One client for the module's raw requests (``httpx.post`` makes a client, its TLS context with
    it, each call: ~60 ms of CPU)."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_echo_returns_every_prompt_token_logprob(
    client: openai.OpenAI, hf_rows: HFRows, chunked_llm: LLM
) -> None:
    """lm-eval's request: token-id prompts, max_tokens 1, logprobs 1, echo; and max_tokens 0."""
    tok = chunked_llm.get_tokenizer()
    id_prompts = [tok.encode(FEW_SHOT + c, add_special_tokens=False) for c in CHOICES]
    for max_tokens in (1, 0):
        res = client.completions.create(
            model="default", prompt=id_prompts, max_tokens=max_tokens, logprobs=1, echo=True, temperature=0
        )
        assert res.usage.prompt_tokens_details.cached_tokens > 0  # the shared few-shot context
        choices = sorted(res.choices, key=lambda c: c.index)
        for choice, ids, (want, _) in zip(choices, id_prompts, hf_rows, strict=True):
            lp = choice.logprobs
            n = len(ids) + max_tokens
            assert (
                len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
            )
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert (torch.tensor(lp.token_logprobs[1 : len(ids)]) - want).abs().max().item() < 1e-4
            assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
            assert choice.text.startswith(tok.decode(ids))
            assert lp.text_offset[: len(ids)] == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        if max_tokens == 0:
            assert res.usage.completion_tokens == 0
            assert [c.text for c in res.choices] == [tok.decode(ids) for ids in id_prompts]
    text = client.completions.create(
        model="default", prompt="Hello there", max_tokens=3, echo=True, temperature=0
    )
    assert text.choices[0].text.startswith("Hello there") and text.choices[0].logprobs is None


def test_penalties_and_bias_over_http(client: openai.OpenAI, chunked_llm: LLM) -> None:
    """The requests that do not wait for another's answer go at once (their steps shared)."""
    prompt = "The capital of France is"

    def base_then_banned() -> tuple[Any, Any]:
        # the greedy first token, then banned by a -100 bias: two tokens each show it
        base = client.completions.create(
            model="default", prompt=prompt, max_tokens=2, temperature=0, logprobs=0
        )
        first = chunked_llm.get_tokenizer().encode(
            base.choices[0].logprobs.tokens[0], add_special_tokens=False
        )[0]
        banned = client.completions.create(
            model="default", prompt=prompt, max_tokens=2, temperature=0, logit_bias={str(first): -100},
            logprobs=0,
        )  # fmt: skip
        return base, banned

    create = client.completions.create
    with ThreadPoolExecutor(5) as pool:
        chain = pool.submit(base_then_banned)
        forced_ = pool.submit(
            client.chat.completions.create,
            model="default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=1.0,
            seed=1,
            logit_bias={"1234": 100},
        )
        rep_ = pool.submit(
            create,
            model="default",
            prompt="la la la la la la la la",
            max_tokens=8,
            temperature=0,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            extra_body={"repetition_penalty": 1.2},
        )
        plain_ = pool.submit(
            create, model="default", prompt="la la la la la la la la", max_tokens=8, temperature=0
        )
        best_ = pool.submit(
            create, model="default", prompt=prompt, max_tokens=6, n=2, best_of=4, temperature=1.0, seed=2
        )
        (base, banned), forced, rep, plain, best = (f.result() for f in (chain, forced_, rep_, plain_, best_))
    assert base.choices[0].logprobs.tokens[0] not in banned.choices[0].logprobs.tokens[:1]
    want = chunked_llm.get_tokenizer().decode([1234] * 5)
    assert forced.choices[0].message.content == want
    assert rep.choices[0].text != plain.choices[0].text
    assert sorted(c.index for c in best.choices) == [0, 1]


def test_echo_streams_as_it_answers_whole(http: httpx.Client) -> None:
    """vLLM streams echo: each choice's first chunk leads with its prompt's text (and logprobs, the
    first token's null), so the chunks join to the non-streamed choice, logprobs and all."""
    body = {"prompt": [FEW_SHOT, "The sky is"], "max_tokens": 4, "echo": True, "logprobs": 2, "n": 2,
            "temperature": 0}  # fmt: skip
    whole = http.post("/v1/completions", json=body).json()["choices"]
    r = http.post("/v1/completions", json={**body, "stream": True})
    joined: dict[int, dict] = {}
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            got = joined.setdefault(c["index"], {"text": "", "logprobs": {k: [] for k in c["logprobs"]}})
            got["text"] += c["text"]
            for key, values in c["logprobs"].items():
                got["logprobs"][key] += values
            got["finish_reason"] = c["finish_reason"]
    assert sorted(joined) == [c["index"] for c in whole] == [0, 1, 2, 3]
    for c in whole:
        assert c["text"].startswith(body["prompt"][c["index"] // 2])
        assert joined[c["index"]] == {k: c[k] for k in ("text", "logprobs", "finish_reason")}


BAD_VALUES = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"4900000": 1}}, "logit_bias"),
    ({"n": 3, "best_of": 2, "temperature": 1.0}, "best_of"),
    ({"best_of": 3, "stream": True, "temperature": 1.0}, "best_of"),
    ({"echo": True, "stream": True, "max_tokens": 0}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21, "echo": True}, "logprobs"),
]


def _bad_then_ok(http: httpx.Client, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """A bad value's answer, then a good request's after it (the server keeps serving)."""
    bad = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
    return bad, http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})


@pytest.fixture(scope="module")
def bad_value_answers(http: httpx.Client) -> dict[str, Future[tuple[httpx.Response, httpx.Response]]]:
    """Each case's two answers, the cases sent at once: the good requests' steps shared."""
    with ThreadPoolExecutor(len(BAD_VALUES)) as pool:
        return {json.dumps(body): pool.submit(_bad_then_ok, http, body) for body, _ in BAD_VALUES}


@pytest.mark.parametrize(("body", "field"), BAD_VALUES)
def test_bad_values_are_400_naming_the_field(
    bad_value_answers: dict[str, Future[tuple[httpx.Response, httpx.Response]]], body: dict, field: str
) -> None:
    r, ok = bad_value_answers[json.dumps(body)].result()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_tokenize_detokenize_and_tokenizer_info(http: httpx.Client, chunked_llm: LLM) -> None:
    """vLLM's shapes; lm-eval's remote tokenizer reads eos_token and chat_template."""
    tok = chunked_llm.get_tokenizer()
    text = "Question: What is the capital of Spain?"
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0 and body["token_strs"] is None
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert strs.json()["token_strs"] == tok.convert_ids_to_tokens(strs.json()["tokens"])
    chat = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": chat})
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    # messages are rendered as the chat route renders them: developer turns, tool turns, tools
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    for extra in (
        {"messages": [{"role": "developer", "content": "Be nice."}, *chat]},
        {"messages": [*chat, {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
        {"messages": chat, "tools": tools},
    ):
        counted = http.post("/tokenize", json=extra).json()["count"]
        asked = http.post("/v1/chat/completions", json={**extra, "max_tokens": 1})
        assert counted == asked.json()["usage"]["prompt_tokens"], extra
    other = http.post("/tokenize", json={"prompt": text, "model": "other"})
    assert other.status_code == 404
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    for path, bad, field in [
        ("/tokenize", {"add_special_tokens": False}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        r = http.post(path, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text)
