"""Structured outputs and tools over HTTP: the official ``openai`` client against a live server running
the default model (SmolLM2-135M-Instruct) with async scheduling (steps launched ahead).

``parse()`` with a pydantic model returns a parsed object for 8 varied prompts; JSON mode, a regex, a
choice and an EBNF grammar are matched, on chat and completions, through every field name clients send;
``tool_choice="required"`` and a named function return calls whose arguments validate against the
function's schema, streamed or not; bad specs and unknown tools are 400s naming the field, and the
server keeps serving.

Every request of the module that generates goes out at once (``answers``) and each test checks its
own: a step of the default model costs about the same for thirty rows as for one on the CPU, and the
tests' requests, one test after another, took ~220 steps (35 CPU-seconds); at once they take ~50.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SENTIMENTS = ["positive", "negative", "neutral"]
SQL = r"SELECT (name|age|\*) FROM (users|bikes)"
DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["n"],
}

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
FORCED = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
TOOL_ANSWER_CHOICES = ("auto", "none")

BAD_SPECS = [
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
]  # fmt: skip

Jobs = dict[tuple[str, ...], Callable[[], Any]]
Answers = dict[tuple[str, ...], Future[Any]]


def _ask_person(client: openai.OpenAI, topic: str) -> Any:
    return client.chat.completions.parse(
        model="default",
        messages=[
            {"role": "user", "content": f"Invent {topic}. Give their name, age and whether they like cats."}
        ],
        response_format=Person,
        max_tokens=200,
        temperature=0.8,
        seed=len(topic),
    )


def _constraint_jobs(client: openai.OpenAI, http: httpx.Client) -> Jobs:
    """Every kind of constraint, through each field name clients send (rows of every kind in the same
    steps: the steps of one at a time took 17 s on the CI machine)."""
    jobs: Jobs = {}

    def chat(name: str, content: str, **kw: Any) -> None:
        messages = [{"role": "user", "content": content}]
        jobs["constraint", name] = lambda: client.chat.completions.create(
            model="default", messages=messages, **kw
        )

    def complete(name: str, prompt: str, **kw: Any) -> None:
        jobs["constraint", name] = lambda: client.completions.create(model="default", prompt=prompt, **kw)

    describe = "Describe a red bicycle as a JSON object with two keys."
    chat("json_object", describe, response_format={"type": "json_object"}, max_tokens=300, temperature=0)

    for i, extra in enumerate(({"structured_outputs": {"regex": PHONE}}, {"guided_regex": PHONE})):
        chat(f"phone {i}", "Give me a phone number.", max_tokens=40, extra_body=extra)
    complete("phone completion", "Call me at", max_tokens=40, extra_body={"guided_regex": PHONE})

    for i, extra in enumerate(
        ({"structured_outputs": {"choice": SENTIMENTS}}, {"guided_choice": SENTIMENTS})
    ):
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
    for i, extra in enumerate(({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar})):
        complete(f"grammar {i}", "SQL:", max_tokens=20, extra_body=extra)

    body = {
        "prompt": "A number:",
        "max_tokens": 60,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": DIGIT, "strict": True},
        },
    }
    jobs["constraint", "json_schema"] = lambda: http.post("/v1/completions", json=body).json()
    return jobs


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


def _tool_jobs(client: openai.OpenAI) -> Jobs:
    """Forced calls (each the same request streamed and not: their steps shared), parallel required
    calls, and the answers after a tool's result."""
    jobs: Jobs = {}
    for name, tool_choice in FORCED.items():
        kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=150, temperature=0)  # fmt: skip
        jobs["forced", name, "streamed"] = functools.partial(_streamed_calls, client, **kw)
        jobs["forced", name, "reply"] = functools.partial(client.chat.completions.create, **kw)
    jobs["parallel",] = functools.partial(
        client.chat.completions.create,
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0,
    )  # fmt: skip

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

    for c in TOOL_ANSWER_CHOICES:
        jobs["tool result", c, "reply"] = functools.partial(
            client.chat.completions.create, **kw, tool_choice=c
        )
        jobs["tool result", c, "streamed"] = functools.partial(streamed, c)
    return jobs


def _bad_then_ok(http: httpx.Client, extra: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """A bad spec's answer, then a good request's after it (the server keeps serving)."""
    bad = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **extra})
    ok = http.post(
        "/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, "guided_choice": ["yes", "no"]}
    )
    return bad, ok


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI, http: httpx.Client) -> Answers:
    """Every generating request of the module, sent at once (the longest first, so none waits for a
    free row behind them), each answer's future by name; all answered before the first test checks
    its own, so that each test's empty-pool check finds no other test's request running."""
    jobs: Jobs = {
        **_tool_jobs(client),
        **_constraint_jobs(client, http),
        **{("parse", topic): functools.partial(_ask_person, client, topic) for topic in TOPICS},
        **{
            ("bad", json.dumps(extra)): functools.partial(_bad_then_ok, http, extra) for extra, _ in BAD_SPECS
        },
    }
    with ThreadPoolExecutor(len(jobs)) as pool:  # its end waits for every answer
        return {name: pool.submit(job) for name, job in jobs.items()}


def test_parse_returns_the_pydantic_object_every_time(answers: Answers, server: ServerThread) -> None:
    for topic in TOPICS:
        choice = answers["parse", topic].result().choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person), choice.message.content
    pool_empty(server)


def test_json_mode_regex_choice_and_grammar(answers: Answers) -> None:
    replies = {key[1]: future.result() for key, future in answers.items() if key[0] == "constraint"}
    reply = replies["json_object"]
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    for i in range(2):
        reply = replies[f"phone {i}"]
        assert re.fullmatch(PHONE, reply.choices[0].message.content), reply.choices[0].message.content
    assert re.fullmatch(PHONE, replies["phone completion"].choices[0].text)
    for i in range(2):
        assert all(c.message.content in SENTIMENTS for c in replies[f"choice {i}"].choices)
    for i in range(2):
        done = replies[f"tagged {i}"]
        assert re.fullmatch(r"<n>[0-9]{2,4}</n>", done.choices[0].text), done.choices[0].text
    assert replies["by_text"].choices[0].text == "Answer:"  # the token is special: skipped in the text
    for i in range(2):
        done = replies[f"grammar {i}"]
        assert re.fullmatch(SQL, done.choices[0].text), done.choices[0].text
    jsonschema.validate(json.loads(replies["json_schema"]["choices"][0]["text"]), DIGIT)


def _schema(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("forced", list(FORCED))
def test_forced_tool_calls_validate_streamed_or_not(
    answers: Answers, server: ServerThread, forced: str
) -> None:
    tool_choice = FORCED[forced]
    reply = answers["forced", forced, "reply"].result()
    streamed, finish = answers["forced", forced, "streamed"].result()
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


def test_parallel_required_calls_all_validate(answers: Answers) -> None:
    choice = answers["parallel",].result().choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def test_tool_results_come_back_and_auto_answers(answers: Answers, server: ServerThread) -> None:
    for c in TOOL_ANSWER_CHOICES:
        reply, text = (
            answers["tool result", c, "reply"].result(),
            answers["tool result", c, "streamed"].result(),
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content or choice.message.tool_calls
        if choice.message.content is not None:
            assert text == choice.message.content
    pool_empty(server)


@pytest.mark.parametrize(("extra", "param"), BAD_SPECS)
def test_bad_specs_are_400s_naming_the_field(answers: Answers, extra: dict[str, Any], param: str) -> None:
    r, ok = answers["bad", json.dumps(extra)].result()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[0].split("[")[0] in error["message"], error
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
