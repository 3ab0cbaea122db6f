"""vLLM's serving flags. ``--served-model-name``: the names a model is served under (answers carry
the first; requests may name any of them, or ``default``; ``/v1/models`` lists a card per name;
batch rows answer the same). ``--chat-template``: the template every chat is rendered with (a file or
the template itself; a broken one refused at start); ``--trust-request-chat-template``: a request's
own template renders its chat."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest

from prefixserve import LLM
from prefixserve.config import EngineConfig
from prefixserve.entrypoints.args import add_engine_args, engine_config_from_args
from prefixserve.entrypoints.openai.server import ServerThread, build_app


def test_the_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--served-model-name", "acme/tiny", "tiny"]))
    assert config.served_model_name == ("acme/tiny", "tiny")
    assert engine_config_from_args(parser.parse_args([])).served_model_name == ()
    with pytest.raises(ValueError, match="served_model_name"):
        EngineConfig(served_model_name=("ok", " "))


def test_a_model_answers_to_each_served_name(tiny_config_path: Path, tmp_path: Path) -> None:
    names = ("acme/tiny-chat", "tiny")
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, served_model_name=names
    )
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        cards = http.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == list(names) and {c["root"] for c in cards} == {names[0]}
        for asked in (*names, "default"):
            got = http.post("/v1/completions", json={"model": asked, "prompt": "hi", "max_tokens": 1})
            assert got.status_code == 200 and got.json()["model"] == names[0], got.text
        assert http.get("/v1/models/tiny").json()["id"] == "tiny"
        wrong = http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi", "max_tokens": 1})
        assert wrong.status_code == 404 and "'acme/tiny-chat', 'tiny'" in wrong.json()["error"]["message"]
    llm = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, served_model_name=names,
              progress=False)  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    row = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
           "body": {"model": "tiny", "prompt": "hi", "max_tokens": 1}}  # fmt: skip
    src.write_text(json.dumps(row) + "\n")
    llm.batch(src, out, progress=False)
    answer = json.loads(out.read_text())["response"]
    assert answer["status_code"] == 200 and answer["body"]["model"] == names[0]


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


def test_chats_render_with_the_servers_template(tiny_config_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert (
        engine_config_from_args(parser.parse_args(["--chat-template", str(path)])).chat_template == TEMPLATE
    )
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    for given in (str(path), TEMPLATE):
        llm = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, chat_template=given,
                  progress=False)  # fmt: skip
        rendered = llm.render_chat([{"role": "user", "content": "hi"}])
        assert rendered == "<user>hi<assistant>"
    loops = "{% for m in messages %}{{ m['content'] }}{% if loop.first %}{% break %}{% endif %}{% endfor %}"
    assert LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, chat_template=loops,
               progress=False).render_chat([{"role": "user", "content": "hi"}]) == "hi"  # fmt: skip
    with pytest.raises(ValueError, match="does not parse"):
        LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, chat_template="{% for %}",
            progress=False)  # fmt: skip
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, chat_template=TEMPLATE
    )
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        got = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        tok = llm.get_tokenizer()
        assert got["tokens"] == tok.encode("<user>hi<assistant>", add_special_tokens=False)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == got["count"]


def test_a_requests_template_renders_its_chat_only_where_the_server_trusts_it(tiny_config_path: Path) -> None:
    """vLLM's --trust-request-chat-template: off, a chat sending chat_template is a 400 naming it; on,
    that template renders the chat (tokenize, chat completions, ``LLM.chat``'s ``chat_template``)."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--trust-request-chat-template"])
    assert engine_config_from_args(args).trust_request_chat_template
    assert not engine_config_from_args(parser.parse_args([])).trust_request_chat_template
    messages = [{"role": "user", "content": "hi"}]
    chat = {"messages": messages, "max_tokens": 1, "chat_template": TEMPLATE, "return_token_ids": True}
    for trusted in (False, True):
        config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64,
                              trust_request_chat_template=trusted)  # fmt: skip
        with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            answer = http.post("/v1/chat/completions", json=chat)
            tokens = http.post("/tokenize", json={"messages": messages, "chat_template": TEMPLATE})
            if not trusted:
                assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template"
                assert "--trust-request-chat-template" in answer.json()["error"]["message"]
                assert tokens.status_code == 400
                continue
            llm = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, progress=False)
            want = llm.get_tokenizer().encode("<user>hi<assistant>", add_special_tokens=False)
            assert answer.status_code == 200, answer.text
            assert answer.json()["prompt_token_ids"] == want
            assert tokens.json()["tokens"] == want
            plain = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
            assert plain != want  # without it, the model's own template
            pml = [{"role": "user", "content": '<prompt schema="s"><m/> Hi</prompt>'}]
            untemplated = http.post("/v1/chat/completions", json={**chat, "messages": pml})
            assert untemplated.status_code == 400 and untemplated.json()["error"]["param"] == "chat_template"
    assert llm.render_chat(messages, chat_template=TEMPLATE) == "<user>hi<assistant>"
    out = llm.chat(messages, chat_template=TEMPLATE)[0]
    assert out.prompt == "<user>hi<assistant>"
    # vLLM's LLM.chat(tools=...): the template renders them
    with_tools = "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}" + TEMPLATE
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    assert (
        llm.chat(messages, chat_template=with_tools, tools=tools)[0].prompt == "[weather]<user>hi<assistant>"
    )


def test_browser_origins_only_where_allowed(tiny_config_path: Path) -> None:
    """``--allowed-origins``: a listed origin's preflight is answered and its answers readable
    (``X-Request-Id`` exposed); any other origin, and every origin by default, gets no CORS headers."""
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64)
    ui = "https://ui.example"
    ask = {
        "Origin": ui,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    body = {"prompt": "hi", "max_tokens": 1}
    app = build_app(config, allowed_origins=[ui])

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with ServerThread(app) as srv, httpx.Client(base_url=srv.url) as http:
        failed = http.get("/boom", headers={"Origin": ui, "X-Request-Id": "r9"})  # a bug's 500 too
        assert (
            failed.status_code == 500 and failed.json()["error"]["message"] == "internal error: RuntimeError"
        )
        assert failed.headers["access-control-allow-origin"] == ui and failed.headers["x-request-id"] == "r9"
        preflight = http.options("/v1/completions", headers=ask)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ui
        got = http.post("/v1/completions", json=body, headers={"Origin": ui, "X-Request-Id": "r1"})
        assert got.headers["access-control-allow-origin"] == ui
        assert "x-request-id" in got.headers["access-control-expose-headers"].lower()
        assert (
            "access-control-allow-origin"
            not in http.options(
                "/v1/completions", headers={**ask, "Origin": "https://elsewhere.example"}
            ).headers
        )
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url) as http:
        got = http.post("/v1/completions", json=body, headers={"Origin": ui})
        assert got.status_code == 200 and "access-control-allow-origin" not in got.headers


def test_allowed_origins_as_vllm_takes_them() -> None:
    from prefixserve.entrypoints.openai.cors import read_origins

    assert read_origins(['["https://ui.example", "http://localhost:3000"]']) == [
        "https://ui.example",
        "http://localhost:3000",
    ]  # vLLM's one JSON list
    assert read_origins(["*"]) == ["*"] and read_origins(None) is None
    for bad in (["ui.example"], ["[not json"], ["https://ui.example/path"]):
        with pytest.raises(ValueError, match="allowed-origins"):
            read_origins(bad)
