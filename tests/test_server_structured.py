"""Structured outputs and tools over HTTP: the official ``openai`` client against a live server running
the default model (SmolLM2-135M-Instruct) with async scheduling (steps launched ahead).

``parse()`` with a pydantic model returns a parsed object for 8 varied prompts; JSON mode, a regex, a
choice and an EBNF grammar are matched, on chat and completions, through every field name clients send;
``tool_choice="required"`` and a named function return calls whose arguments validate against the
function's schema, streamed or not; bad specs and unknown tools are 400s naming the field, and the
server keeps serving.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import engine_checks
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.server import ServerThread, build_app

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    config = EngineConfig(
        device="cpu", dtype="float32", num_kv_blocks=1024, max_num_seqs=32, async_scheduling=True
    )
    with ServerThread(build_app(config)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def pool_empty(server: ServerThread, timeout: float = 15.0) -> None:
    engine_checks.wait_server_pool_empty(server, timeout, integrity=False)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    likes_cats: bool


TOPICS = [  # asked at once: a batch of constrained rows (8: the CI machine's time)
    "a pirate", "a chef from Lyon", "a retired astronaut", "a teenage chess champion", "a beekeeper",
    "a jazz drummer", "a lighthouse keeper", "a robot",
]  # fmt: skip


def test_parse_returns_the_pydantic_object_every_time(client: openai.OpenAI, server: ServerThread) -> None:
    def ask(topic: str) -> Any:
        return client.chat.completions.parse(
            model="default",
            messages=[
                {
                    "role": "user",
                    "content": f"Invent {topic}. Give their name, age and whether they like cats.",
                }
            ],
            response_format=Person,
            max_tokens=200,
            temperature=0.8,
            seed=len(topic),
        )

    with ThreadPoolExecutor(len(TOPICS)) as pool:
        replies = list(pool.map(ask, TOPICS))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person), choice.message.content
    pool_empty(server)


def test_json_mode_regex_choice_and_grammar(client: openai.OpenAI, http: httpx.Client) -> None:
    """Every kind of constraint, through each field name clients send; the requests go at once (rows
    of every kind in the same steps: the steps of one at a time took 17 s on the CI machine)."""
    jobs: dict[str, Any] = {}

    def chat(name: str, content: str, **kw: Any) -> None:
        messages = [{"role": "user", "content": content}]
        jobs[name] = lambda: client.chat.completions.create(model="default", messages=messages, **kw)

    def complete(name: str, prompt: str, **kw: Any) -> None:
        jobs[name] = lambda: client.completions.create(model="default", prompt=prompt, **kw)

    describe = "Describe a red bicycle as a JSON object with two keys."
    chat("json_object", describe, response_format={"type": "json_object"}, max_tokens=300, temperature=0)

    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for i, extra in enumerate(({"structured_outputs": {"regex": phone}}, {"guided_regex": phone})):
        chat(f"phone {i}", "Give me a phone number.", max_tokens=40, extra_body=extra)
    complete("phone completion", "Call me at", max_tokens=40, extra_body={"guided_regex": phone})

    choices = ["positive", "negative", "neutral"]
    for i, extra in enumerate(({"structured_outputs": {"choice": choices}}, {"guided_choice": choices})):
        chat(f"choice {i}", "Sentiment of: 'I love this bike!'", max_tokens=10, n=3, extra_body=extra)

    tagged = {"type": "structural_tag", "format": {"type": "tag", "begin": "<n>", "end": "</n>",
              "content": {"type": "regex", "pattern": "[0-9]{2,4}"}}}  # fmt: skip
    for i, extra in enumerate(
        ({"response_format": tagged}, {"structured_outputs": {"structural_tag": json.dumps(tagged)}})
    ):
        complete(f"tagged {i}", "Tag:", max_tokens=20, extra_body=extra)

    # a tag naming a token by its text: compiled with the tokenizer, as vLLM compiles it
    by_text = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer:"}, {"type": "token", "token": "<|im_end|>"}]}}  # fmt: skip
    complete("by_text", "Q:", max_tokens=6, extra_body={"response_format": by_text})

    grammar = 'root ::= "SELECT " column " FROM " table\n'
    grammar += 'column ::= "name" | "age" | "*"\ntable ::= "users" | "bikes"'
    sql = r"SELECT (name|age|\*) FROM (users|bikes)"
    for i, extra in enumerate(({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar})):
        complete(f"grammar {i}", "SQL:", max_tokens=20, extra_body=extra)

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
    }
    body = {
        "prompt": "A number:",
        "max_tokens": 60,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": schema, "strict": True},
        },
    }
    jobs["json_schema"] = lambda: http.post("/v1/completions", json=body).json()

    with ThreadPoolExecutor(len(jobs)) as pool:
        running = {name: pool.submit(job) for name, job in jobs.items()}
        replies = {name: future.result() for name, future in running.items()}

    reply = replies["json_object"]
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    for i in range(2):
        reply = replies[f"phone {i}"]
        assert re.fullmatch(phone, reply.choices[0].message.content), reply.choices[0].message.content
    assert re.fullmatch(phone, replies["phone completion"].choices[0].text)
    for i in range(2):
        assert all(c.message.content in choices for c in replies[f"choice {i}"].choices)
    for i in range(2):
        done = replies[f"tagged {i}"]
        assert re.fullmatch(r"<n>[0-9]{2,4}</n>", done.choices[0].text), done.choices[0].text
    assert replies["by_text"].choices[0].text == "Answer:"  # the token is special: skipped in the text
    for i in range(2):
        done = replies[f"grammar {i}"]
        assert re.fullmatch(sql, done.choices[0].text), done.choices[0].text
    jsonschema.validate(json.loads(replies["json_schema"]["choices"][0]["text"]), schema)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Sky", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                           "required": ["city"], "additionalProperties": False},
        },
    },
]  # fmt: skip
ASK = [{"role": "user", "content": "What will the weather be in Tokyo for the next 3 days?"}]


def _schema(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def _streamed_calls(client: openai.OpenAI, **kw: Any) -> tuple[list[dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_validate_streamed_or_not(
    client: openai.OpenAI, server: ServerThread, tool_choice: Any
) -> None:
    kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=150, temperature=0)  # fmt: skip
    with ThreadPoolExecutor(1) as pool:  # the same request streamed, at once: their steps shared
        streaming = pool.submit(_streamed_calls, client, **kw)
        reply = client.chat.completions.create(**kw)
        streamed, finish = streaming.result()
    choice = reply.choices[0]
    # OpenAI (and vLLM) end a named function's call with "stop", required calls with "tool_calls"
    want = "stop" if isinstance(tool_choice, dict) else "tool_calls"
    assert choice.finish_reason == want and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))
    assert finish == want
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]
    assert streamed[0]["id"].startswith("call_")
    pool_empty(server)


def test_parallel_required_calls_all_validate(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0
    )
    choice = reply.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def test_tool_results_come_back_and_auto_answers(client: openai.OpenAI, server: ServerThread) -> None:
    args = json.dumps({"city": "Tokyo", "unit": "celsius", "days": 3})
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 24 C"}'},
    ]  # fmt: skip
    kw = dict(model="default", messages=history, tools=TOOLS, max_tokens=40, temperature=0)

    def streamed(tool_choice: str) -> str:
        chunks = client.chat.completions.create(**kw, tool_choice=tool_choice, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    choices = ("auto", "none")
    with ThreadPoolExecutor(2 * len(choices)) as pool:  # all at once, their steps shared
        replies = [pool.submit(client.chat.completions.create, **kw, tool_choice=c) for c in choices]
        streams = [pool.submit(streamed, c) for c in choices]
        answers = [(r.result(), s.result()) for r, s in zip(replies, streams, strict=True)]
    for reply, text in answers:
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content or choice.message.tool_calls
        if choice.message.content is not None:
            assert text == choice.message.content
    pool_empty(server)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"guided_regex": "[z-"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
        ({"guided_grammar": 'start ::= "a"'}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format"),
        ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
         "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_naming_the_field(http: httpx.Client, extra: dict[str, Any], param: str) -> None:
    body = {"messages": ASK, "max_tokens": 5, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[0].split("[")[0] in error["message"], error
    ok = http.post(
        "/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, "guided_choice": ["yes", "no"]}
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
