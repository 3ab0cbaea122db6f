"""Embeddings (``PoolingParams``, ``LLM.embed``, ``/v1/embeddings``): equal to a direct fp32 forward
(HF transformers on the same GGUF), unchanged by prefix sharing and chunked prefill, shared prefixes
computed once; the server's answers through the official ``openai`` client, and its refusals."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixserve import LLM, PoolingParams, SamplingParams
from tests.conftest import assert_pool_empty

DOC = (
    "Prefix sharing lets many requests read one copy of a long context. The engine keeps each block "
    "of keys and values once and every request that starts with the same tokens points at it. "
) * 3
PASSAGES = [DOC + q for q in ("Who keeps the blocks?", "What is shared?", "Why is it fast?")] + ["Hello."]


HFEmbedding = Callable[[list[int], str], torch.Tensor]  # (prompt ids, pooling) -> the reference


@pytest.fixture(scope="module")
def hf_embedding(hf_gguf_model: torch.nn.Module) -> HFEmbedding:
    """The reference: HF's final (normed) hidden states of the whole prompt, pooled and normalized.
    Each prompt's forward is made once for the module: the tests embed the same passages again, and
    pooled both ways."""
    states: dict[tuple[int, ...], torch.Tensor] = {}

    def embed(ids: list[int], pooling: str) -> torch.Tensor:
        if tuple(ids) not in states:
            with torch.no_grad():
                states[tuple(ids)] = hf_gguf_model.model(torch.tensor([ids])).last_hidden_state[0].double()
        hidden = states[tuple(ids)]
        vector = hidden[-1] if pooling == "last" else hidden.mean(0)
        return torch.nn.functional.normalize(vector, dim=0)

    return embed


@pytest.fixture(scope="module")
def chunked_llm() -> LLM:
    """Prefill chunks of 40 tokens, so the prompts come in several chunks, not block-aligned."""
    return LLM(
        dtype="float32", device="cpu", attention="reference", num_kv_blocks=512,
        max_num_batched_tokens=40, progress=False,
    )  # fmt: skip


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_a_direct_fp32_forward(
    chunked_llm: LLM, hf_embedding: HFEmbedding, pooling: str
) -> None:
    params = PoolingParams(pooling=pooling)
    first = chunked_llm.embed(PASSAGES, params)
    again = chunked_llm.embed(PASSAGES, params)  # the document's blocks from the prefix cache now
    for out in again:  # all but the last token's block from the cache: the whole prompt was seen
        assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 16 * 16, out.num_cached_tokens
    for out in first + again:
        ids = out.prompt_token_ids
        want = hf_embedding(ids, pooling)
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 2e-5, (pooling, out.num_cached_tokens)
        assert abs(got.norm().item() - 1.0) < 1e-5
    assert_pool_empty(chunked_llm)


def test_requests_sharing_a_prefix_compute_it_once(chunked_llm: LLM) -> None:
    outs = chunked_llm.embed([DOC + f"Question {i}?" for i in range(6)], PoolingParams(pooling="last"))
    cached = [o.num_cached_tokens for o in outs]
    assert sum(c > 0 for c in cached) >= 5, cached  # one computes the document, the rest wait and share


def test_unnormalized_and_truncated(chunked_llm: LLM, hf_embedding: HFEmbedding) -> None:
    raw = chunked_llm.embed(PASSAGES[0], PoolingParams(normalize=False))[0]
    assert abs(torch.tensor(raw.outputs.embedding).norm().item() - 1.0) > 1e-3
    cut = chunked_llm.embed(PASSAGES[0], PoolingParams(pooling="mean", truncate_prompt_tokens=9))[0]
    assert len(cut.prompt_token_ids) == 9
    want = hf_embedding(cut.prompt_token_ids, "mean")
    assert (torch.tensor(cut.outputs.embedding, dtype=torch.float64) - want).abs().max().item() < 2e-5


def test_llm_score_is_the_cosine_of_the_hf_embeddings(chunked_llm: LLM, hf_embedding: HFEmbedding) -> None:
    """vLLM's ``LLM.score``: one text against many, and pair by pair; each score the cosine of the two
    reference embeddings."""
    query = "Who keeps the blocks of keys and values?"
    many = chunked_llm.score(query, PASSAGES)
    pairwise = chunked_llm.score(PASSAGES[:2], [PASSAGES[1], query], PoolingParams(pooling="mean"))
    tok = chunked_llm.get_tokenizer()
    for outs, first, second, pooling in (
        (many, [query] * 4, PASSAGES, "last"),
        (pairwise, PASSAGES[:2], [PASSAGES[1], query], "mean"),
    ):
        assert len(outs) == len(first)
        for out, a, b in zip(outs, first, second, strict=True):
            ids_a, ids_b = tok.encode(a), tok.encode(b)
            assert out.prompt_token_ids == ids_a + ids_b and out.finished
            want = hf_embedding(ids_a, pooling) @ hf_embedding(ids_b, pooling)
            assert abs(out.outputs.score - want.item()) < 1e-5, (out.outputs.score, want.item())
    assert (
        abs(
            pairwise[0].outputs.score
            - chunked_llm.score(PASSAGES[0], PASSAGES[1], PoolingParams(pooling="mean"))[0].outputs.score
        )
        < 1e-9
    )
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        chunked_llm.score(PASSAGES[:2], PASSAGES[:3])
    assert_pool_empty(chunked_llm)


def test_bad_requests_are_refused_and_leave_nothing(chunked_llm: LLM) -> None:
    engine = chunked_llm.engine
    with pytest.raises(ValueError, match="takes no sampling params"):
        engine.add_request("x", "hi", SamplingParams(), pooling=PoolingParams())
    with pytest.raises(ValueError, match="PML"):
        engine.add_request("x", '<prompt schema="s">hi</prompt>', pooling=PoolingParams())
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams(pooling="max")
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    too_long = {"prompt_token_ids": [5] * (engine.max_model_len + 1)}
    with pytest.raises(ValueError):
        chunked_llm.embed([PASSAGES[0], too_long])
    assert_pool_empty(chunked_llm)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_mean_pooling_over_chunks_and_kept_block_sums(tiny_config_path: Path, budget: int) -> None:
    """Random prompts sharing prefixes of several lengths (block-aligned or not), in chunks of
    ``budget`` tokens: mean pooling with the kept per-block sums equals it with no prefix cache."""
    gen = torch.Generator().manual_seed(budget)
    heads = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (5, 16, 37, 64)]
    prompts = [
        {"prompt_token_ids": head + torch.randint(3, 400, (tail,), generator=gen).tolist()}
        for head in heads
        for tail in (1, 9, 23)
    ]
    common = dict(
        model=f"dummy:{tiny_config_path}", device="cpu", dtype="float32", num_kv_blocks=256,
        max_num_batched_tokens=budget, progress=False,
    )  # fmt: skip
    shared = LLM(**common)
    plain = LLM(**common, enable_prefix_caching=False)
    params = PoolingParams(pooling="mean", normalize=False)
    want = [o.outputs.embedding for o in plain.embed(prompts, params)]
    for _ in range(2):  # the second time, most of every prompt from the kept sums
        outs = shared.embed(prompts, params)
        for out, ref in zip(outs, want, strict=True):
            assert np.allclose(out.outputs.embedding, ref, atol=1e-5), out.num_cached_tokens
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert_pool_empty(shared)


# ---- the server ---------------------------------------------------------------------------------
def test_server_embeddings_through_the_openai_client(tiny_openai, tiny_server) -> None:
    import openai

    inputs = ["a shared instruction: first passage", "a shared instruction: second passage"]
    got = tiny_openai.embeddings.create(model="default", input=inputs)
    assert [d.index for d in got.data] == [0, 1]
    assert len(got.data[0].embedding) == 64  # the tiny model's hidden size
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    # the same vectors as the engine's own, as base64 fp32 (what the client decodes by default)
    raw = tiny_openai.embeddings.with_raw_response.create(
        model="default", input=inputs, encoding_format="base64"
    )
    encoded = raw.http_response.json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(encoded), dtype="<f4"), got.data[0].embedding)
    ids = tiny_openai.embeddings.create(model="default", input=[[5, 6, 7], [5, 6, 8]], dimensions=64)
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 6
    mean = tiny_openai.embeddings.create(model="default", input=inputs[0], extra_body={"pooling": "mean"})
    assert not np.allclose(mean.data[0].embedding, got.data[0].embedding)
    for bad, field in (
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [{"text": "x"}]}, "input"),
        ({"input": "x", "dimensions": 32}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": [1] * 5000}, "input"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            tiny_openai.post("/embeddings", body={"model": "default", **bad}, cast_to=object)
        assert err.value.body["param"] == field, (bad, err.value.body)
    with pytest.raises(openai.NotFoundError):
        tiny_openai.embeddings.create(model="other", input="x")
    # the server still serves after the refusals
    assert len(tiny_openai.embeddings.create(model="default", input="still here").data) == 1
    context = tiny_openai.models.list().data[0].max_model_len  # an embedding may fill it, not pass it
    full = tiny_openai.embeddings.create(model="default", input=[[5] * context])
    assert full.usage.prompt_tokens == context
    with pytest.raises(openai.BadRequestError):
        tiny_openai.embeddings.create(model="default", input=[[5] * (context + 1)])


def test_mean_requests_wait_for_sums_not_just_cached_blocks(tiny_config_path: Path) -> None:
    """Blocks cached by other requests (no sums kept): mean requests arriving together still compute
    the shared document once (one computes, the rest wait for its sums), not once each."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", dtype="float32", num_kv_blocks=256, progress=False
    )
    doc = list(range(100, 180))
    prompts = [{"prompt_token_ids": [*doc, 7 + i, 9]} for i in range(5)]
    llm.embed(prompts, PoolingParams(pooling="last"))  # the document's blocks cached, no sums kept
    outs = llm.embed(prompts, PoolingParams(pooling="mean"))
    assert sum(o.num_cached_tokens > 0 for o in outs) == 4, [o.num_cached_tokens for o in outs]
    assert_pool_empty(llm)


@pytest.mark.parametrize("kind", ["last", "mean", "echo"])
def test_a_decoding_request_on_the_prefix_holds_no_one_back(tiny_config_path: Path, kind: str) -> None:
    """A request still generating after computing a shared prefix keeps no row results: requests
    that need them (mean pooling, prompt logprobs) start at once, not when it finishes."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", dtype="float32", num_kv_blocks=256, progress=False
    )
    engine, doc = llm.engine, list(range(100, 180))
    long = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)
    engine.add_request("gen", None, long, prompt_token_ids=[*doc, 5, 6])
    engine.step(), engine.step()
    if kind == "echo":
        scored = SamplingParams(max_tokens=1, prompt_logprobs=1)
        engine.add_request("m", None, scored, prompt_token_ids=[*doc, 7, 8])
    else:
        engine.add_request("m", None, prompt_token_ids=[*doc, 7, 8], pooling=PoolingParams(pooling=kind))
    steps = 1
    while not any(o.request_id == "m" and o.finished for o in engine.step()):
        steps += 1
    assert steps <= 3, f"{kind} waited {steps} steps for the generating request"
    engine.abort("gen")
    engine.step()
    assert_pool_empty(llm)


def test_an_embedding_aborted_by_a_failed_step_is_an_error_not_a_null(tiny_server, monkeypatch) -> None:
    import httpx

    from prefixserve.engine import Engine

    step, armed = Engine.step, [0]

    def failing(self: Engine):  # one step with an embedding request in it raises
        if armed[0] and any("pooling" in r.rules for r in self.requests.values()):
            armed[0] -= 1
            raise RuntimeError("injected step failure")
        return step(self)

    monkeypatch.setattr(Engine, "step", failing)
    for fmt in ("float", "base64"):
        armed[0] = 1
        r = httpx.post(
            f"{tiny_server.url}/v1/embeddings",
            json={"input": "hello world", "encoding_format": fmt},
            timeout=60,
        )
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", (fmt, r.text[:200])
    ok = httpx.post(f"{tiny_server.url}/v1/embeddings", json={"input": "hello"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64


def test_score_and_rerank_are_cosines_of_the_embeddings(tiny_server) -> None:
    import httpx

    url = tiny_server.url

    def embed(texts: list[str]) -> np.ndarray:
        data = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60).json()["data"]
        return np.asarray([d["embedding"] for d in data])

    query, docs = "where do the trains go", ["the harbour line", "a recipe for bread", "the harbour line"]
    q, d = embed([query]), embed(docs)
    want = (d @ q[0]).tolist()
    score = httpx.post(f"{url}/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [s["index"] for s in score["data"]] == [0, 1, 2] and score["object"] == "list"
    assert np.allclose([s["score"] for s in score["data"]], want, atol=1e-5)
    assert score["id"].startswith("score-") and score["usage"]["prompt_tokens"] > 0
    pairs = httpx.post(f"{url}/v1/score", json={"text_1": docs[:2], "text_2": [query, docs[1]]}, timeout=60)
    assert np.allclose([s["score"] for s in pairs.json()["data"]], [want[0], 1.0], atol=1e-5)
    ranked = httpx.post(
        f"{url}/v1/rerank",
        json={"query": query, "documents": [{"text": t} for t in docs], "top_n": 2},
        timeout=60,
    ).json()
    # the best two by score; docs 0 and 2 are the same text, so which of them ranks first is float noise
    order = [r["index"] for r in ranked["results"]]
    assert len(order) == 2 and np.allclose(
        [want[i] for i in order], sorted(want, reverse=True)[:2], atol=1e-5
    )
    assert ranked["results"][0]["document"]["text"] == docs[order[0]]
    assert np.allclose([r["relevance_score"] for r in ranked["results"]], [want[i] for i in order], atol=1e-5)
    for path, bad, field in (
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/score", {"text_2": "a"}, "text_1"),
        ("/rerank", {"query": "q", "documents": "not a list"}, "documents"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/rerank", {"query": "q", "documents": ["x " * 3000]}, "documents"),
    ):
        r = httpx.post(f"{url}{path}", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, bad, r.text[:200])
    assert httpx.post(f"{url}/rerank", json={"query": "q", "documents": ["a"]}, timeout=60).status_code == 200


def test_chat_messages_embed_as_their_rendered_chat(tiny_server, default_tokenizer) -> None:
    """vLLM's chat embeddings: ``messages`` rendered by the chat template (no generation prompt
    unless asked), embedded as that one text would be."""
    import httpx

    from prefixserve.model.loader import default_gguf_path, tokenizer_for

    tok = tokenizer_for(str(default_gguf_path()), progress=False)[1]
    messages = [{"role": "system", "content": "Represent the query."}, {"role": "user", "content": "trains"}]
    url = f"{tiny_server.url}/v1/embeddings"
    for generation_prompt in (False, True):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        chat = httpx.post(
            url, json={"messages": messages, "add_generation_prompt": generation_prompt}, timeout=60
        )
        plain = httpx.post(url, json={"input": text}, timeout=60)
        assert chat.status_code == plain.status_code == 200, chat.text[:200]
        assert np.allclose(
            chat.json()["data"][0]["embedding"], plain.json()["data"][0]["embedding"], atol=1e-6
        )
        assert chat.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    bad = httpx.post(url, json={"messages": "not a list"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_embedding_may_fill_the_whole_context(tiny_config_path: Path, async_scheduling: bool) -> None:
    """An embedding generates nothing, so its prompt may be as long as the context (vLLM's rule); one
    token longer is refused. The same prompt embeds as in an engine with room to spare."""

    def llm(context: int) -> LLM:
        return LLM(
            f"dummy:{tiny_config_path}", dtype="float32", device="cpu", num_kv_blocks=64, progress=False,
            max_model_len=context, async_scheduling=async_scheduling,
        )  # fmt: skip

    full = {"prompt_token_ids": [(7 * i) % 200 + 3 for i in range(48)]}
    tight, roomy = llm(48), llm(96)
    (got,) = tight.embed([full])
    (want,) = roomy.embed([full])
    torch.testing.assert_close(torch.tensor(got.outputs.embedding), torch.tensor(want.outputs.embedding))
    with pytest.raises(ValueError, match="over the context length of 48"):
        tight.embed([{"prompt_token_ids": full["prompt_token_ids"] + [5]}])
    assert_pool_empty(tight)
