"""Prompt Cache over HTTP and the command line: ``/v1/schemas``, PML prompts in completions, the
``prefixserve schema`` command and the ``--schema`` engine options.

One live server on the tiny dummy model (CPU, fp32, the reference attention) and an ``LLM`` of the
same on an engine of its own (``llm``), so a PML prompt's greedy output over HTTP equals
``LLM.generate``'s: the routes are under test, not the model (the default model's steps made this
module ~25 CPU-seconds; the tiny one's, a few). The tests run in order: register, use, remove.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.entrypoints.args import engine_config_from_args
from prefixserve.entrypoints.cli import build_parser, main
from prefixserve.entrypoints.openai.server import ServerThread, build_app

API_KEY = "schema-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

SCHEMA = """<schema name="travel">You plan trips. Facts follow.
<module name="tokyo">Tokyo is the capital of Japan; it is known for sushi, temples and trains.</module>
<module name="paris">Paris is the capital of France; it is known for the Eiffel Tower and the Louvre.</module>
<module name="plan">Plan a trip of <param name="days" len="4"/> days.</module>
</schema>"""
PROMPT = (
    '<prompt schema="travel"><paris/><tokyo/><plan days="three"/>'
    " Question: which city has sushi? Answer:</prompt>"
)
MAX_TOKENS = 4  # each answer's first tokens: two paths' greedy outputs compared over them


ENGINE = {"dtype": "float32", "device": "cpu", "attention": "reference", "num_kv_blocks": 512}


@pytest.fixture(scope="module")
def server(tiny_config_path: Path) -> Iterator[ServerThread]:
    config = EngineConfig(model=f"dummy:{tiny_config_path}", **ENGINE)
    with ServerThread(build_app(config, api_key=API_KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(tiny_config_path: Path) -> LLM:
    """The server's model and options on an engine of its own."""
    return LLM(model=f"dummy:{tiny_config_path}", progress=False, **ENGINE)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture
def travel(http: httpx.Client) -> str:
    """The schema registered (kept as it is if it already is: its modules stay encoded)."""
    if http.get("/v1/schemas/travel").status_code == 404:
        assert http.post("/v1/schemas", json={"schema": SCHEMA}).status_code == 201
    return "travel"


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def complete(http: httpx.Client, prompt: str, **kw: object) -> httpx.Response:
    body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return http.post("/v1/completions", json=body)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return str(error["message"])


# ---- registering --------------------------------------------------------------------------------
def test_register_then_list(http: httpx.Client) -> None:
    assert http.get("/v1/schemas").json() == {"object": "list", "data": []}
    r = http.post("/v1/schemas", json={"schema": SCHEMA})
    assert r.status_code == 201, r.text
    card = r.json()
    assert card["name"] == "travel" and card["object"] == "schema"
    assert card["modules"] == ["paris", "plan", "tokyo"]
    assert card["tokens"] > 0 and card["positions"] > 0 and card["pieces"] > 0
    listed = http.get("/v1/schemas").json()
    assert listed == {"object": "list", "data": [card]}
    assert http.get("/v1/schemas/travel").json() == card
    assert metric(http, "prefixserve_module_encodes_total") >= 1
    assert metric(http, "prefixserve_module_blocks_gpu") > 0


def test_duplicate_is_409_and_replace_takes_raw_pml(http: httpx.Client, travel: str) -> None:
    message = error_of(http.post("/v1/schemas", json={"schema": SCHEMA}), 409)
    assert "travel" in message and "already registered" in message
    raw = {"content-type": "application/xml"}
    assert http.post("/v1/schemas", content=SCHEMA, headers=raw).status_code == 409
    r = http.post("/v1/schemas", content=SCHEMA, headers=raw, params={"replace": "true"})
    assert r.status_code == 200, r.text  # replaced: 200, not 201
    assert r.json()["name"] == "travel"
    assert len(http.get("/v1/schemas").json()["data"]) == 1


def test_bad_pml_is_400_naming_line_and_column_and_the_server_keeps_serving(
    http: httpx.Client, travel: str
) -> None:
    bad = '<schema name="broken">\n  <module name="a">text</modul>\n</schema>'
    message = error_of(http.post("/v1/schemas", json={"schema": bad}), 400)
    assert "line 2, column" in message, message
    r = http.post("/v1/schemas", content="<schema>", headers={"content-type": "text/plain"})
    assert "line 1" in error_of(r, 400)
    assert "must be" in error_of(http.post("/v1/schemas", json={"schema": 3}), 400)
    assert "required" in error_of(http.post("/v1/schemas", json={}), 400)
    assert "true or false" in error_of(
        http.post("/v1/schemas", content=SCHEMA, headers={"content-type": "text/xml"}, params={"pin": "x"}),
        400,
    )
    assert [s["name"] for s in http.get("/v1/schemas").json()["data"]] == ["travel"]
    assert http.get("/health").status_code == 200
    assert complete(http, "The capital of France is").status_code == 200


def test_schema_routes_need_the_api_key(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert anon.get("/v1/schemas").status_code == 401
        assert anon.post("/v1/schemas", json={"schema": SCHEMA}).status_code == 401
        assert anon.delete("/v1/schemas/travel").status_code == 401


# ---- PML prompts in completions -----------------------------------------------------------------
def test_pml_completion_reuses_modules_and_equals_llm_generate(
    http: httpx.Client, travel: str, llm: LLM
) -> None:
    first, second = complete(http, PROMPT, logprobs=0), complete(http, PROMPT, logprobs=0)
    assert first.status_code == 200, first.text
    a, b = first.json(), second.json()
    assert a["choices"][0]["text"], a
    assert a["choices"][0]["logprobs"]["tokens"] == b["choices"][0]["logprobs"]["tokens"]
    usage = a["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < usage["prompt_tokens"]

    llm.register_schema(SCHEMA)  # the same schema on an engine of its own
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        want = llm.generate(PROMPT, params)[0]
    finally:
        llm.unregister_schema("travel")
    assert a["choices"][0]["text"] == want.outputs[0].text
    assert a["choices"][0]["finish_reason"] == want.outputs[0].finish_reason
    assert usage["prompt_tokens"] == len(want.prompt_token_ids)
    assert usage["completion_tokens"] == len(want.outputs[0].token_ids)
    assert cached == want.num_cached_tokens
    assert metric(http, "prefixserve_module_tokens_reused_total") >= 2 * cached


def test_pml_stream_usage_and_cache_salt(http: httpx.Client, travel: str) -> None:
    plain = complete(http, PROMPT).json()
    body = {"stream": True, "stream_options": {"include_usage": True}}
    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": "default", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **body},
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    salted = complete(http, PROMPT, cache_salt="tenant-b").json()  # its own copy of the modules
    assert salted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_pml_prompt_errors_are_400(http: httpx.Client, travel: str) -> None:
    message = error_of(complete(http, '<prompt schema="nope"><tokyo/> Hi</prompt>'), 400)
    assert "unknown schema 'nope'" in message and "line 1" in message
    r = complete(http, '<prompt schema="travel"><lima/> Hi</prompt>')
    assert "lima" in error_of(r, 400) and r.json()["error"]["code"] == "invalid_pml"
    r = complete(http, '<prompt schema="travel"><plan days="far too many days for four tokens"/></prompt>')
    assert r.json()["error"]["param"] == "prompt" and "line 1" in error_of(r, 400)
    assert complete(http, PROMPT).status_code == 200  # still serving


# ---- chat-shaped schemas: role turns, PML in chat completions ------------------------------------
def test_chat_shaped_pml_over_completions_and_chat_completions(
    http: httpx.Client, server: ServerThread
) -> None:
    """The paper's use: a chat model answering a question over cached modules, through the official
    client, streamed and not, n > 1, stop strings and logprobs; repeats report the modules as cached."""
    import openai

    from tests.test_pml_chat import TRAVEL, TRAVEL_PROMPT

    if http.get("/v1/schemas/travel-chat").status_code == 404:
        body = {"schema": TRAVEL.replace('name="travel"', 'name="travel-chat"')}
        assert http.post("/v1/schemas", json=body).status_code == 201, http.get("/v1/schemas").text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    prompt = TRAVEL_PROMPT.replace('schema="travel"', 'schema="travel-chat"')
    done = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text.strip(), done
    pieces = client.completions.create(
        model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == done.choices[0].text
    messages = [
        {"role": "user", "content": prompt.replace("What should I eat?", "")},
        {"role": "user", "content": "What should I eat?"},
    ]
    chat = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].message.content == done.choices[0].text  # one prompt, two request shapes
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    again = client.chat.completions.create(
        model="default", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    cached = chat.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= cached > 0
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    samples = client.chat.completions.create(
        model="default", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, n=3, seed=5, stop=["\n"]
    )
    assert len(samples.choices) == 3 and all("\n" not in c.message.content for c in samples.choices)


def test_bad_role_nesting_is_400_naming_line_and_column(http: httpx.Client, travel: str) -> None:
    r = complete(http, '<prompt schema="travel">\n<tokyo><user>Hi</user></tokyo></prompt>')
    message = error_of(r, 400)
    assert "<user> inside the import of <tokyo>" in message and "line 2, column 8" in message
    body = {
        "model": "default",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": '<prompt schema="travel"><tokyo/><wizard>Hi</wizard></prompt>'}
        ],
    }
    r = http.post("/v1/chat/completions", json=body)
    assert "unknown module <wizard>" in error_of(r, 400) and r.json()["error"]["param"] == "messages"
    body["messages"].append(dict(body["messages"][0]))
    assert "first message" in error_of(http.post("/v1/chat/completions", json=body), 400)
    assert complete(http, PROMPT).status_code == 200  # still serving


# ---- removing ---------------------------------------------------------------------------------
def test_delete_then_list_is_empty(http: httpx.Client, travel: str) -> None:
    r = http.delete("/v1/schemas/travel")
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "schema", "name": "travel", "deleted": True}
    http.delete("/v1/schemas/travel-chat")
    assert http.get("/v1/schemas").json()["data"] == []
    assert "travel" in error_of(http.delete("/v1/schemas/travel"), 404)
    assert error_of(http.get("/v1/schemas/travel"), 404)
    assert metric(http, "prefixserve_module_blocks_gpu") == 0
    # a <prompt ...> document is never read as plain text: its schema is named as unknown
    r = complete(http, '<prompt schema="travel"><tokyo/></prompt>')
    assert "unknown schema 'travel' (known: none are registered)" in error_of(r, 400)


# ---- the command line ---------------------------------------------------------------------------
def test_schema_cli_add_list_rm(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "travel.pml"
    file.write_text(SCHEMA)
    conn = ["--url", server.url, "--api-key", API_KEY]

    assert main(["schema", "list", *conn]) == 0
    assert "no schemas registered" in capsys.readouterr().out
    assert main(["schema", "add", str(file), *conn]) == 0
    out = capsys.readouterr().out
    assert "registered travel: 3 modules (paris, plan, tokyo)" in out
    assert main(["schema", "add", str(file), *conn]) == 1
    err = capsys.readouterr().err
    assert "HTTP 409" in err and "already registered" in err
    assert main(["schema", "add", str(file), "--replace", "--pin", *conn]) == 0
    assert "(pinned)" in capsys.readouterr().out
    assert main(["schema", "list", *conn]) == 0
    assert capsys.readouterr().out.startswith("travel: 3 modules")
    assert main(["schema", "rm", "travel", *conn]) == 0
    assert "removed schema 'travel'" in capsys.readouterr().out
    assert main(["schema", "rm", "travel", *conn]) == 1
    assert "HTTP 404" in capsys.readouterr().err

    bad = tmp_path / "bad.pml"
    bad.write_text('<schema name="b">\n<module name="m">x</module>\n<oops>')
    assert main(["schema", "add", str(bad), *conn]) == 1
    assert "HTTP 400" in (err := capsys.readouterr().err) and "line " in err
    assert main(["schema", "list", "--url", server.url]) == 1  # no key
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["schema", "add", str(tmp_path / "missing.pml"), *conn]) == 2
    assert "not found" in capsys.readouterr().err


def test_engine_args_carry_schemas_and_module_tiers(tmp_path: Path) -> None:
    """No model needed: parse the options and build the EngineConfig (it loads nothing)."""
    a, b = tmp_path / "a.pml", tmp_path / "b.pml"
    a.write_text(SCHEMA)
    b.write_text('<schema name="b"><module name="m">hello</module></schema>')
    store = str(tmp_path / "store")
    extra = [
        "--schema",
        str(a),
        "--schema",
        str(b),
        "--module-store",
        store,
        "--module-gpu-fraction",
        "0.25",
        "--module-host-bytes",
        "512M",
    ]
    for command in (["serve"], ["generate"], ["bench"], ["batch", "in.jsonl"]):
        config = engine_config_from_args(build_parser().parse_args([*command, *extra]))
        assert config.schemas == [SCHEMA, b.read_text()]
        assert config.module_store == store
        assert config.module_gpu_fraction == 0.25
        assert config.module_host_bytes == 512 << 20
    defaults = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults.schemas == [] and defaults.module_store is None
    assert defaults.module_gpu_fraction == EngineConfig().module_gpu_fraction
    assert defaults.module_host_bytes == EngineConfig().module_host_bytes
    with pytest.raises(ValueError, match="schema file"):
        engine_config_from_args(build_parser().parse_args(["serve", "--schema", str(tmp_path / "none.pml")]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--module-host-bytes", "lots"])


def test_salted_pml_prompts_share_the_modules_under_the_scope(http: httpx.Client, travel: str) -> None:
    """Over HTTP, ``cache_salt_scope: "after-system"``: a second tenant's salted PML prompt reads the
    modules the first one read (unsalted: nothing encoded for it; the first may have encoded them again
    where earlier tests' traffic had dropped them); under "prompt" a new salt encodes its own."""
    prompt = f'<prompt schema="{travel}"><tokyo/><paris/> Which city has sushi?</prompt>'
    r = complete(http, prompt, cache_salt="scope-a", cache_salt_scope="after-system")
    assert r.status_code == 200, r.text
    before = metric(http, "prefixserve_module_encodes_total")
    r = complete(http, prompt, cache_salt="scope-b", cache_salt_scope="after-system")
    assert r.status_code == 200, r.text
    assert metric(http, "prefixserve_module_encodes_total") == before
    assert complete(http, prompt, cache_salt="scope-c", cache_salt_scope="prompt").status_code == 200
    assert metric(http, "prefixserve_module_encodes_total") > before
