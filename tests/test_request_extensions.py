"""vLLM's request extensions, honoured or refused, never dropped: ``allowed_token_ids``, ``bad_words``,
``skip_special_tokens``, ``truncate_prompt_tokens``, ``add_special_tokens``, ``return_tokens_as_token_ids``,
``continue_final_message``, ``chat_template_kwargs`` and a chat's ``echo``; sampling fields under
``use_beam_search``, ``priority`` and a request's ``chat_template`` are 400s naming the field.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from tests.conftest import assert_pool_empty
from tests.test_prompt_tokens import BOS, bos_model  # noqa: F401  (a fixture)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def llm(tiny_config_path: Path) -> LLM:
    return LLM(f"dummy:{tiny_config_path}", dtype="float32", device="cpu", num_kv_blocks=128, progress=False)


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("allowed_token_ids", [], "non-empty"),
        ("allowed_token_ids", [3, -1], "allowed_token_ids"),
        ("truncate_prompt_tokens", 0, "truncate_prompt_tokens"),
        ("truncate_prompt_tokens", -2, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_allowed_token_ids_pick_only_among_them(llm: LLM) -> None:
    allowed = [7, 300, 4000]
    sampled = llm.generate(
        {"prompt_token_ids": PROMPT}, params(allowed_token_ids=allowed, temperature=1.0, seed=3)
    )
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed)
    # greedy among them is greedy with every other token far behind (a +100 bias shifts them alike)
    want = llm.generate({"prompt_token_ids": PROMPT}, params(logit_bias=dict.fromkeys(allowed, 100.0)))
    got = llm.generate({"prompt_token_ids": PROMPT}, params(allowed_token_ids=allowed))
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="allowed_token_ids names token id 99999999"):
        llm.generate({"prompt_token_ids": PROMPT}, params(allowed_token_ids=[1, 99999999]))


def pairs(ids: list[int]) -> set[tuple[int, int]]:
    return set(itertools.pairwise(ids))


@pytest.mark.usefixtures("default_tokenizer")  # " blue" and " sky" are one token each in it
@pytest.mark.parametrize("launch_ahead", [False, True])
def test_bad_words_never_appear_whole(tiny_config_path: Path, launch_ahead: bool) -> None:
    """A two-token word: its second token is banned right after its first, also when the first is
    still on the device as the step after it is launched; a one-token word is banned everywhere."""
    llm = LLM(
        f"dummy:{tiny_config_path}",
        dtype="float32",
        device="cpu",
        num_kv_blocks=128,
        progress=False,
        async_scheduling=launch_ahead,
    )
    tok = llm.get_tokenizer()
    blue, sky = tok.encode(" blue sky", add_special_tokens=False)
    mixed = params(allowed_token_ids=[blue, sky], temperature=1.0, seed=11, max_tokens=40, n=3)
    free = [c.token_ids for c in llm.generate({"prompt_token_ids": PROMPT}, mixed)[0].outputs]
    assert any((blue, sky) in pairs(ids) for ids in free)  # without the ban the word comes up
    mixed.bad_words = [" blue sky"]
    banned = llm.generate({"prompt_token_ids": PROMPT}, mixed)[0].outputs
    assert all((blue, sky) not in pairs(c.token_ids) for c in banned)
    assert all(" blue sky" not in c.text for c in banned) and any(blue in c.token_ids for c in banned)
    mixed.bad_words = [" sky"]  # the same object, other words: each request encodes its own
    assert all(
        set(c.token_ids) == {blue} for c in llm.generate({"prompt_token_ids": PROMPT}, mixed)[0].outputs
    )
    one = params(allowed_token_ids=[blue, sky], temperature=1.0, seed=11, max_tokens=12, bad_words=["blue"])
    assert set(llm.generate({"prompt_token_ids": PROMPT}, one)[0].outputs[0].token_ids) == {sky}
    assert_pool_empty(llm)


def test_truncate_prompt_tokens_keeps_the_last_ones(llm: LLM) -> None:
    want = llm.generate({"prompt_token_ids": PROMPT[-12:]}, GREEDY)[0]
    got = llm.generate({"prompt_token_ids": PROMPT}, params(truncate_prompt_tokens=12))[0]
    assert list(got.prompt_token_ids) == PROMPT[-12:]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    short = llm.generate({"prompt_token_ids": PROMPT[:5]}, params(truncate_prompt_tokens=12))[0]
    assert list(short.prompt_token_ids) == PROMPT[:5]  # shorter prompts stay whole
    text = llm.generate("one two three four five six seven eight nine ten", params(truncate_prompt_tokens=3))[
        0
    ]
    assert len(text.prompt_token_ids) == 3 and text.prompt is None  # the text no longer says the prompt
    room = llm.engine.max_model_len - 8
    long = llm.generate({"prompt_token_ids": [5] * (room + 50)}, params(truncate_prompt_tokens=-1))[0]
    assert len(long.prompt_token_ids) == room  # -1: as many as leave room for max_tokens
    with pytest.raises(ValueError, match="truncate_prompt_tokens cannot be combined"):
        llm.generate(
            {"prompt_token_ids": PROMPT, "positions": list(range(40))}, params(truncate_prompt_tokens=4)
        )


def test_skip_special_tokens_false_keeps_them_in_the_text(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    special = tok.convert_tokens_to_ids(tok.all_special_tokens[-1])
    forced = {"allowed_token_ids": [special], "max_tokens": 2}
    skipped = llm.generate({"prompt_token_ids": PROMPT}, params(**forced))[0].outputs[0]
    kept = llm.generate({"prompt_token_ids": PROMPT}, params(**forced, skip_special_tokens=False))[0].outputs[
        0
    ]
    assert skipped.token_ids == kept.token_ids == [special, special]
    assert skipped.text == "" and kept.text == tok.decode([special, special]) != ""


def test_continue_final_message_leaves_the_last_turn_open(llm: LLM) -> None:
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    text = llm.render_chat(chat, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("My answer is")
    closed = llm.render_chat(chat, add_generation_prompt=False)
    assert not closed.endswith("My answer is") and closed.startswith(text)
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt=False"):
        llm.chat(chat, GREEDY, continue_final_message=True)
    out = llm.chat(chat, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == text


# ---- over HTTP ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(tiny_config_path: Path) -> Iterator[httpx.Client]:
    from prefixserve.entrypoints.openai.server import ServerThread, build_app  # the server's packages

    config = EngineConfig(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        device="cpu",
        num_kv_blocks=128,
        system_prompts={"desk": "Be brief."},
    )
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client


COMPLETION = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
RESPONSE = {"input": "Hi", "max_output_tokens": 3}
PML_CHAT = '<prompt schema="s"><m/> Hi</prompt>'  # a Prompt Cache conversation: no template


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/completions", {"use_beam_search": True, "top_k": 5}, "top_k"),
        ("/v1/completions", {"priority": 2}, "priority"),
        ("/v1/completions", {"bad_words": ["  "]}, "bad_words"),
        ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
        (
            "/v1/chat/completions",
            {"echo": True, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "echo",
        ),
        ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": '<prompt schema="s"><m/> Hi</prompt>'}],
                "documents": [{"a": 1}],
            },
            "documents",
        ),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"truncate_prompt_tokens": 4, "application": "desk"}, "truncate_prompt_tokens"),
        # fields OpenAI or vLLM define that this server does not do (protocol.NOT_DONE)
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        (
            "/v1/chat/completions",
            {"web_search_options": {"search_context_size": "low"}},
            "web_search_options",
        ),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ("/v1/completions", {"logits_processors": ["x"]}, "logits_processors"),
        ("/v1/completions", {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
        ("/v1/completions", {"truncation_side": "right"}, "truncation_side"),
        ("/v1/completions", {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ("/v1/completions", {"return_token_ids": True, "stream": True}, "return_token_ids"),
        ("/v1/responses", {"moderation": {"mode": "block"}}, "moderation"),
        (
            "/v1/responses",
            {"previous_input_messages": [{"role": "user", "content": "x"}]},
            "previous_input_messages",
        ),
    ],
)
def test_what_is_not_done_is_refused_by_name(http: httpx.Client, route: str, extra: dict, param: str) -> None:
    base = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/responses": RESPONSE}[route]
    r = http.post(route, json=base | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    # defaults (and their spellings) are no refusal
    ok = base | {"use_beam_search": False, "priority": 0, "functions": None, "modalities": ["text"]}
    assert http.post(route, json=ok | {"bad_words": [], "truncation_side": "left"}).status_code == 200


def test_return_token_ids_answer_the_ids_the_engine_ran(http: httpx.Client) -> None:
    chat = http.post(
        "/v1/chat/completions", json=CHAT | {"return_token_ids": True, "n": 2, "ignore_eos": True}
    ).json()
    rendered = http.post("/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    assert chat["prompt_token_ids"] == rendered
    assert [len(c["token_ids"]) for c in chat["choices"]] == [3, 3]  # max_tokens 3, ignore_eos
    prompts = {"prompt": ["Hello there", "Once upon"], "n": 2, "return_token_ids": True}
    cmpl = http.post("/v1/completions", json=COMPLETION | prompts).json()
    for choice in cmpl["choices"]:
        text = http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
        assert text == choice["text"] and len(choice["token_ids"]) == 6
        prompt = prompts["prompt"][choice["index"] // 2]
        assert choice["prompt_token_ids"] == http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    plain = http.post("/v1/completions", json=COMPLETION).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain


def test_extensions_reach_the_engine(http: httpx.Client) -> None:
    allowed = [7, 300, 4000]
    body = COMPLETION | {"allowed_token_ids": allowed, "temperature": 1.0, "seed": 1, "logprobs": 1}
    out = http.post("/v1/completions", json=body | {"return_tokens_as_token_ids": True}).json()
    tokens = out["choices"][0]["logprobs"]["tokens"]
    assert tokens and all(t in {f"token_id:{a}" for a in allowed} for t in tokens), tokens
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    too_long = COMPLETION | {"prompt": [9] * (context + 50)}  # past the context: a 400 unless cut first
    assert http.post("/v1/completions", json=too_long).status_code == 400
    cut = http.post("/v1/completions", json=too_long | {"truncate_prompt_tokens": 50}).json()
    assert cut["usage"]["prompt_tokens"] == 50
    long_text = COMPLETION | {"prompt": "a b " * context, "truncate_prompt_tokens": -1}
    text = http.post("/v1/completions", json=long_text)
    assert text.status_code == 200 and text.json()["usage"]["prompt_tokens"] + 6 == context
    scoring = http.post("/v1/completions", json=COMPLETION | {"echo": True, "max_tokens": 0, "min_tokens": 2})
    assert scoring.status_code == 400 and "max_tokens (0" in scoring.json()["error"]["message"]  # as sent
    short = http.post("/v1/completions", json=COMPLETION | {"truncate_prompt_tokens": 5}).json()
    assert short["usage"]["prompt_tokens"] == 5
    whole = http.post("/v1/completions", json=COMPLETION | {"prompt": PROMPT[-5:]}).json()
    assert short["choices"][0]["text"] == whole["choices"][0]["text"]
    chat = CHAT | {"messages": [*CHAT["messages"], {"role": "assistant", "content": "Hello"}]}
    opened = chat | {"add_generation_prompt": False, "continue_final_message": True}
    assert http.post("/v1/chat/completions", json=opened).status_code == 200
    banned = COMPLETION | {"allowed_token_ids": allowed, "bad_words": [" blue", "the"], "temperature": 1.0}
    assert http.post("/v1/completions", json=banned).status_code == 200
    kwargs = CHAT | {"chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "doc"}]}
    assert http.post("/v1/chat/completions", json=kwargs).status_code == 200


def test_prompt_logprobs_in_vllm_shape(http: httpx.Client) -> None:
    """Per prompt token (the first: null): its own logprob and rank, and the k top ones ranked 1..k;
    the logprobs are the echo's, and a token among the top has the rank of its place there."""
    body = COMPLETION | {"prompt": PROMPT[:12], "max_tokens": 1}
    got = http.post("/v1/completions", json=body | {"prompt_logprobs": 3}).json()
    echo = http.post("/v1/completions", json=body | {"echo": True, "logprobs": 1}).json()
    entries = got["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 12
    echoed = echo["choices"][0]["logprobs"]["token_logprobs"][:12]
    for i, entry in enumerate(entries[1:], start=1):
        own = entry[str(PROMPT[i])]
        assert own["logprob"] == pytest.approx(echoed[i], abs=1e-5)
        ranks = {v["rank"] for v in entry.values()}
        assert {1, 2, 3} <= ranks and len(entry) <= 4  # the top 3, and the prompt's own token
    chat = http.post("/v1/chat/completions", json=CHAT | {"prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    streamed = http.post("/v1/completions", json=body | {"prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_echo_and_prompt_logprobs_answer_for_the_clients_prompt(http: httpx.Client) -> None:
    """Behind an application's pinned prompt, echo's text and logprobs and prompt_logprobs cover what
    the client sent, not the pinned prompt the engine put in front."""
    for prompt in ("Do you sell tires?", PROMPT[:7]):
        body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 1}
        out = http.post("/v1/completions", json=body | {"application": "desk"}).json()["choices"][0]
        alone = http.post("/v1/completions", json=body).json()["choices"][0]
        lp = out["logprobs"]
        text = out["text"]
        assert "".join(lp["tokens"]) == text and all(o <= len(text) for o in lp["text_offset"])
        n = len(alone["prompt_logprobs"])
        assert len(out["prompt_logprobs"]) == n and alone["prompt_logprobs"][0] is None
        assert out["prompt_logprobs"][0] is not None  # its first token follows the pinned prompt
        assert lp["tokens"][:n] == alone["logprobs"]["tokens"][:n]


def test_tokenize_renders_chats_under_the_same_rules(http: httpx.Client) -> None:
    chat = {"messages": CHAT["messages"]}
    assert (
        http.post("/tokenize", json=chat | {"chat_template_kwargs": {"enable_thinking": False}}).status_code
        == 200
    )
    for extra, param in (
        ({"chat_template_kwargs": {"chat_template": "{{ 'X' }}"}}, "chat_template_kwargs"),
        ({"chat_template": "{{ 'X' }}"}, "chat_template"),
        ({"continue_final_message": True}, "continue_final_message"),
    ):
        r = http.post("/tokenize", json=chat | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_logprob_ranks_count_the_tokens_above(llm: LLM) -> None:
    greedy = llm.generate({"prompt_token_ids": PROMPT[:6]}, params(max_tokens=6))[0].outputs[0].token_ids
    prompt = PROMPT[:6] + greedy  # its last six tokens are the model's first choices: rank 1
    out = llm.generate({"prompt_token_ids": prompt}, params(max_tokens=1, prompt_logprobs=20))[0]
    assert out.prompt_logprob_ranks is not None and out.prompt_logprob_ranks[0] is None
    assert out.prompt_logprob_ranks[6:] == [1] * 6 and min(out.prompt_logprob_ranks[1:6]) > 1
    tops, ranks = out.prompt_top_logprobs[1:], out.prompt_logprob_ranks[1:]
    for token, top, rank in zip(prompt[1:], tops, ranks, strict=True):
        ids = [t for t, _ in top]
        assert rank == ids.index(token) + 1 if token in ids else rank > 20  # its place among the top 20


def test_a_chat_echo_leads_with_the_open_assistant_message(http: httpx.Client) -> None:
    chat = CHAT | {
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Well, "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "temperature": 0,
    }
    plain = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json=chat | {"echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Well, " + plain
    with http.stream("POST", "/v1/chat/completions", json=chat | {"echo": True, "stream": True}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    deltas = [json.loads(ln)["choices"][0]["delta"] for ln in lines]
    assert deltas[0] == {"role": "assistant", "content": "Well, "}
    assert "".join(d.get("content") or "" for d in deltas) == "Well, " + plain
    user_last = CHAT | {"echo": True, "temperature": 0}  # the last message is the user's: nothing echoed

    def content(body: dict) -> str:
        return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    assert content(user_last) == content(CHAT | {"temperature": 0})


def test_a_batch_file_encodes_as_the_server_does(bos_model: Path, tmp_path: Path) -> None:  # noqa: F811
    llm = LLM(f"dummy:{bos_model}", dtype="float32", device="cpu", num_kv_blocks=128, progress=False)
    body = {"prompt": "Hello world", "max_tokens": 1}
    rows = [
        {"custom_id": key, "method": "POST", "url": "/v1/completions", "body": body | extra}
        for key, extra in (
            ("a", {}),
            ("b", {"add_special_tokens": False}),
            ("c", {"truncate_prompt_tokens": 1}),
        )
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    llm.batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    used = {a["custom_id"]: a["response"]["body"]["usage"]["prompt_tokens"] for a in answers}
    assert used["a"] == used["b"] + 1 and used["c"] == 1


def test_add_special_tokens_false_leaves_the_bos_out(bos_model: Path) -> None:  # noqa: F811
    from prefixserve.entrypoints.openai.server import ServerThread, build_app

    config = EngineConfig(model=f"dummy:{bos_model}", dtype="float32", device="cpu", num_kv_blocks=128)
    body = {"prompt": "Hello world", "max_tokens": 1, "logprobs": 0, "echo": True}
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        with_bos = client.post("/v1/completions", json=body).json()
        without = client.post("/v1/completions", json=body | {"add_special_tokens": False}).json()
    assert with_bos["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1
    assert (
        with_bos["choices"][0]["logprobs"]["tokens"][0]
        == "<s>"
        != without["choices"][0]["logprobs"]["tokens"][0]
    )


@pytest.mark.gpu
def test_gpu_allowed_ids_bad_words_and_truncation_under_graphs(tiny_config_path: Path) -> None:
    """On CUDA (decode graphs, launch-ahead): allowed_token_ids and bad_words hold, greedy with allowed
    ids equals the +100 bias, and a truncated prompt answers as its tail does."""
    llm = LLM(f"dummy:{tiny_config_path}", dtype="float32", device="cuda", num_kv_blocks=256, progress=False)
    tok = llm.get_tokenizer()
    word = next(w for w in (" blue sky", "ab", " ab") if len(tok.encode(w, add_special_tokens=False)) == 2)
    first, second = tok.encode(word, add_special_tokens=False)
    mixed = params(allowed_token_ids=[first, second], temperature=1.0, seed=11, max_tokens=40, n=4)
    free = [c.token_ids for c in llm.generate({"prompt_token_ids": PROMPT}, mixed)[0].outputs]
    assert any((first, second) in pairs(ids) for ids in free)
    mixed.bad_words = [word]
    banned = [c.token_ids for c in llm.generate({"prompt_token_ids": PROMPT}, mixed)[0].outputs]
    assert all((first, second) not in pairs(ids) and set(ids) <= {first, second} for ids in banned)
    allowed = [7, 30, 90]
    want = llm.generate({"prompt_token_ids": PROMPT}, params(logit_bias=dict.fromkeys(allowed, 100.0)))
    got = llm.generate({"prompt_token_ids": PROMPT}, params(allowed_token_ids=allowed))
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    greedy = llm.generate({"prompt_token_ids": PROMPT[:6]}, params(max_tokens=6))[0].outputs[0].token_ids
    scored = llm.generate({"prompt_token_ids": PROMPT[:6] + greedy}, params(max_tokens=1, prompt_logprobs=5))
    assert scored[0].prompt_logprob_ranks[6:] == [1] * 6  # the model's own choices rank first
    tail = llm.generate({"prompt_token_ids": PROMPT[-9:]}, GREEDY)[0].outputs[0].token_ids
    assert (
        llm.generate({"prompt_token_ids": PROMPT}, params(truncate_prompt_tokens=9))[0].outputs[0].token_ids
        == tail
    )
    assert_pool_empty(llm)


def test_a_client_names_its_request(http: httpx.Client) -> None:
    """vLLM's ``request_id`` field and ``X-Request-Id`` header (which wins) name the answer; the header
    comes back; two requests named alike run side by side; a name with spaces is a 400."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    got = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "request_id": "batch-7"})
    assert got.json()["id"] == "cmpl-batch-7" and "x-request-id" not in got.headers
    named = {"X-Request-Id": "trace-1"}
    got = http.post("/v1/chat/completions", json=chat | {"request_id": "b"}, headers=named)
    assert got.json()["id"] == "chatcmpl-trace-1" and got.headers["x-request-id"] == "trace-1"
    with http.stream("POST", "/v1/chat/completions", json=chat | {"stream": True, "request_id": "s1"}) as r:
        ids = {json.loads(ln[6:])["id"] for ln in r.iter_lines() if ln.startswith("data: {")}
    assert ids == {"chatcmpl-s1"}
    with ThreadPoolExecutor(4) as pool:  # the engine's own ids stay unique
        dup = chat | {"request_id": "dup"}
        same = list(pool.map(lambda _: http.post("/v1/chat/completions", json=dup), range(4)))
    assert [r.status_code for r in same] == [200] * 4 and {r.json()["id"] for r in same} == {"chatcmpl-dup"}
    bad = http.post("/v1/completions", json={"prompt": "hi", "request_id": "has space"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    assert http.get("/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"
    spaced = http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "a b"}
    )
    assert spaced.status_code == 200 and spaced.headers["x-request-id"] == "a b"  # a header's: echoed only
    assert spaced.json()["id"].startswith("cmpl-") and "a b" not in spaced.json()["id"]
