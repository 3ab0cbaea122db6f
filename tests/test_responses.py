"""OpenAI's Responses API (``/v1/responses``).

Without a model: input items to chat messages, the streamed events against the non-streamed answer
(plain text, text then a call, required calls, no text, cut by max_output_tokens, logprobs), errors
named in this API's words, the store's bounds and ``truncation: auto``. Live, with the tiny dummy
model and the official ``openai`` client: a response is the chat turn it stands for (same prompt, same
greedy text), streamed or not; ``previous_response_id`` goes on with the stored conversation from the
prefix cache; stored responses are listed, retrieved and deleted; bad requests are 400s naming the
field, and the server keeps serving with its pool empty.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import engine_checks
import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from prefixserve.entrypoints.openai.responses_background import BackgroundRuns, EventLog, FirstOutput
from prefixserve.entrypoints.openai.server import ServerThread
from prefixserve.model.byte_tokenizer import byte_tokenizer
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.prepare import OpenAIContext, prepare_chat
from prefixserve.protocols.responses import prepare as responses_mod
from prefixserve.protocols.responses.prepare import prepare_response
from prefixserve.protocols.responses.request import input_messages
from prefixserve.protocols.responses.store import ResponseStore
from prefixserve.protocols.responses.stream import response_stream

WEATHER = {
    "type": "function",
    "name": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


TOKENIZER = byte_tokenizer()


@pytest.fixture(scope="module")
def ctx() -> OpenAIContext:
    return OpenAIContext(model="m", tokenizer=TOKENIZER, system_prompts={})


def _output(text: str, finish: str | None, logprobs: bool = False) -> RequestOutput:
    ids = list(TOKENIZER.encode(text, add_special_tokens=False))  # bytes: a character may take several
    c = CompletionOutput(0, text, ids, finish)
    if logprobs:
        c.token_logprobs = [-0.25] * len(ids)
        c.top_logprobs = [[(7, -0.1)] for _ in ids]
    return RequestOutput("r-0", None, [1, 2, 3], [c], finish is not None)


def _parse(chunks: list[str]) -> list[dict[str, Any]]:
    """SSE chunks (each may hold several events) -> the events' payloads, checking ``event:`` lines."""
    events = []
    for chunk in chunks:
        for block in chunk.split("\n\n"):
            if not block:
                continue
            kind, data = block.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {payload['type']}"
            events.append(payload)
    return events


def _streamed(
    ctx: OpenAIContext, body: dict[str, Any], text: str, finish: str, lp: bool = False
) -> list[dict]:
    call = prepare_response(ctx, {**body, "stream": True}, ResponseStore())
    state = response_stream(call)
    chunks = list(state.opening())
    for end in range(1, len(text), 5):
        chunks += state.update(0, _output(text[:end], None, lp))
    final = _output(text, finish, lp)
    chunks += state.update(0, final)
    chunks += state.closing([final])
    return _parse(chunks)


def _answered(ctx: OpenAIContext, body: dict[str, Any], text: str, finish: str, lp: bool = False) -> dict:
    call = prepare_response(ctx, body, ResponseStore())
    return call.body([_output(text, finish, lp)])


def _shape(items: list[dict[str, Any]]) -> list[tuple]:
    """Output items without their generated ids."""
    out = []
    for item in items:
        if item["type"] == "message":
            part = item["content"][0]
            out.append(("message", item["status"], part["text"], json.dumps(part.get("logprobs"))))
        else:
            out.append(("function_call", item["status"], item["name"], item["arguments"]))
    return out


def test_input_items_become_chat_messages() -> None:
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Lima?"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Lima"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": {"city": "Cusco"}},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [
            {"type": "input_text", "text": "rain"}]},
    ]  # fmt: skip
    messages = input_messages(items)
    assert messages[:2] == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Lima?"},
    ]
    assert messages[2]["role"] == "assistant" and messages[2]["content"] == "Checking."
    calls = messages[2]["tool_calls"]  # both calls join the assistant message before them
    assert [c["id"] for c in calls] == ["call_1", "call_2"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Cusco"}
    assert messages[3:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    alone = input_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert alone[0]["role"] == "assistant" and alone[0]["tool_calls"][0]["id"] == "c"


CASES = {
    "text": ({}, "It is sunny in Lima today.", "stop"),
    "cut": ({}, "It is sunny in Li", "length"),
    "empty": ({}, "", "stop"),
    "text then a call": (
        {"tools": [WEATHER]},
        'Let me check.\n<tool_call>{"name": "weather", "arguments": {"city": "Lima"}}</tool_call>',
        "stop",
    ),
    "two calls": (
        {"tools": [WEATHER], "tool_choice": "required"},
        '[{"name": "weather", "arguments": {"city": "Lima"}},'
        ' {"name": "weather", "arguments": {"city": "Cusco"}}]',
        "stop",
    ),
    "named": (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "weather"}},
        '{"city": "Lima"}',
        "stop",
    ),
    "auto, no call": ({"tools": [WEATHER]}, "{not a call}", "stop"),
    "aborted": ({}, "It is sun", "abort"),
    "unicode text then a call": (
        {"tools": [WEATHER]},
        'Voilà 🚲🚲 ok\n<tool_call>{"name": "weather", "arguments": {"city": "Lima"}}</tool_call>',
        "stop",
    ),
}
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.mark.parametrize("logprobs", [False, True], ids=["", "logprobs"])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_events_build_the_non_streamed_answer(ctx: OpenAIContext, case: str, logprobs: bool) -> None:
    extra, text, finish = CASES[case]
    body = {"input": "Weather in Lima?", **extra}
    if logprobs:
        body["include"] = ["message.output_text.logprobs"]
    events = _streamed(ctx, body, text, finish, logprobs)
    answer = _answered(ctx, body, text, finish, logprobs)
    for event in events:  # every event and the answer as the official SDK's models read them
        EVENT.validate_python(event)
    Response.model_validate(answer)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    last = events[-1]
    assert last["type"] == ("response.completed" if finish == "stop" else "response.incomplete")
    final = last["response"]
    assert _shape(final["output"]) == _shape(answer["output"])
    assert final["status"] == answer["status"] and final["usage"] == answer["usage"]
    usage = answer["usage"]["input_tokens_details"]
    assert usage["cached_tokens"] + usage["cache_write_tokens"] == answer["usage"]["input_tokens"]
    # each item: added, its deltas, done, before the next item's; the deltas add up to the item
    indices = [e["output_index"] for e in events if "output_index" in e]
    assert indices == sorted(indices)
    for index, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        assert (
            mine[0]["type"] == "response.output_item.added"
            and mine[-1]["type"] == "response.output_item.done"
        )
        assert mine[-1]["item"] == item and mine[0]["item"]["id"] == item["id"]
        if item["type"] == "message":
            deltas = [e for e in mine if e["type"] == "response.output_text.delta"]
            assert "".join(e["delta"] for e in deltas) == item["content"][0]["text"]
            if logprobs:
                sent = [lp for e in deltas for lp in e["logprobs"]]
                assert sent == item["content"][0]["logprobs"]
                own = TOKENIZER.encode(item["content"][0]["text"], add_special_tokens=False)
                assert len(sent) == len(own)  # the text's own tokens, none of a call's
                if item["content"][0]["text"].isascii():  # a delta carries its own text's tokens
                    assert all("".join(lp["token"] for lp in e["logprobs"]) == e["delta"] for e in deltas)
        else:
            args = [e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta"]
            assert "".join(args) == item["arguments"]
            assert item["call_id"].startswith("call_") and item["status"] == "completed"
    if case == "cut":
        assert answer["status"] == "incomplete" and answer["incomplete_details"] == {
            "reason": "max_output_tokens"
        }
        assert answer["output"][0]["status"] == "incomplete"
    if case == "unicode text then a call":
        assert answer["output"][0]["content"][0]["text"] == "Voilà 🚲🚲 ok\n"
    if case == "text then a call":
        assert [i["type"] for i in answer["output"]] == ["message", "function_call"]
        assert answer["output"][0]["content"][0]["text"] == "Let me check.\n"
    if case == "two calls":
        assert [json.loads(i["arguments"])["city"] for i in answer["output"]] == ["Lima", "Cusco"]
    if case == "empty":
        assert _shape(answer["output"])[0][:3] == ("message", "completed", "")
    if case == "aborted":  # a stream whose client stopped reading: not stored, not "completed"
        assert answer["status"] == "cancelled"


def test_logprobs_ride_on_the_text(ctx: OpenAIContext) -> None:
    body = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    text = "Hello there"
    events = _streamed(ctx, body, text, "stop", lp=True)
    answer = _answered(ctx, body, text, "stop", lp=True)
    part = answer["output"][0]["content"][0]
    assert len(part["logprobs"]) == len(text)
    assert part["logprobs"][0]["logprob"] == -0.25 and len(part["logprobs"][0]["top_logprobs"]) == 1
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert streamed == part["logprobs"] == events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    plain = _answered(ctx, {"input": "hi"}, text, "stop", lp=True)
    assert "logprobs" not in plain["output"][0]["content"][0]


ERRORS = [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # sent back, left out: nothing left
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"input": "hi", "truncation": "middle"}, "truncation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "model": "gpt-9"}, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), ERRORS, ids=[p for _, p in ERRORS])
def test_bad_requests_name_the_field_in_this_api(
    ctx: OpenAIContext, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as err:
        prepare_response(ctx, body, ResponseStore())
    assert err.value.status in (400, 404) and err.value.param == param, err.value.message
    for chat_word in (
        "max_completion_tokens",
        "messages",
        "response_format",
        ".function.",
        "json_schema.schema",
    ):
        assert chat_word not in err.value.message


def test_previous_response_must_be_stored(ctx: OpenAIContext) -> None:
    store = ResponseStore()
    with pytest.raises(APIError) as err:
        prepare_response(ctx, {"input": "hi", "previous_response_id": "resp_x"}, store)
    assert err.value.status == 400 and err.value.code == "previous_response_not_found"
    first = prepare_response(ctx, {"input": "Weather in Lima?", "instructions": "Be brief."}, store)
    first.body([_output("Sunny.", "stop")])
    then = prepare_response(ctx, {"input": "And Cusco?", "previous_response_id": first.rid}, store)
    roles = [(m["role"], m["content"]) for m in then.history]  # the instructions are not carried over
    assert roles == [("user", "Weather in Lima?"), ("assistant", "Sunny."), ("user", "And Cusco?")]
    unstored = prepare_response(ctx, {"input": "hi", "store": False}, store)
    assert unstored.body([_output("x", "stop")])["store"] is False and store.get(unstored.rid) is None
    off = ResponseStore(max_responses=0)
    kept = prepare_response(ctx, {"input": "hi"}, off)
    assert kept.body([_output("x", "stop")])["store"] is False and len(off) == 0


def test_background_responses_need_a_store_and_an_end(ctx: OpenAIContext) -> None:
    with pytest.raises(APIError) as err:  # nothing to poll
        prepare_response(ctx, {"input": "hi", "background": True}, ResponseStore(max_responses=0))
    assert err.value.param == "background"
    store = ResponseStore()
    running = prepare_response(ctx, {"input": "hi", "background": True}, store)
    store.put(running.rid, running.skeleton("in_progress"), running.history, [])
    with pytest.raises(APIError) as err:  # no output yet to go on from
        prepare_response(ctx, {"input": "and?", "previous_response_id": running.rid}, store)
    assert err.value.code == "previous_response_not_finished" and "in_progress" in err.value.message
    running.body([_output("Done.", "stop")])
    then = prepare_response(ctx, {"input": "and?", "previous_response_id": running.rid}, store)
    assert [m["content"] for m in then.history] == ["hi", "Done.", "and?"]


def test_a_running_background_response_is_never_evicted() -> None:
    """The store's bounds drop ended responses only: one still queued or in progress stays
    pollable and cancellable (past the bound if it must)."""
    store = ResponseStore(max_responses=2)
    store.put("running", {"status": "in_progress"}, [], [])
    for i in range(3):
        store.put(f"done{i}", {"status": "completed"}, [], [])
    assert store.get("running") is not None and store.get("done0") is None and len(store) == 2
    store.put("queued", {"status": "queued"}, [], [])
    store.put("done9", {"status": "completed"}, [], [])
    assert store.get("running") and store.get("queued") and len(store) == 2  # at the bound with running ones:
    assert store.get("done9") is None  # an ended one is not kept


def test_a_background_run_cancelled_before_it_ran() -> None:
    """Cancelled in the turn it started (a shutdown, a DELETE at once): its engine requests are
    aborted on its way out and the response reads cancelled; a first output that arrives after the
    cancel (the engine thread's, still on its way) or the delete changes nothing."""
    stopped: list[str] = []

    async def events() -> AsyncIterator[str]:
        await asyncio.sleep(3600)  # cancelled before its first step: its body never runs
        yield ""

    class Call(SimpleNamespace):
        def skeleton(self, status: str) -> dict[str, Any]:
            return {"id": self.rid, "status": status, "background": True}

    async def main() -> None:
        store, runs = ResponseStore(), BackgroundRuns()

        def start(rid: str) -> FirstOutput:
            call = Call(rid=rid, store=store, history=[], req=SimpleNamespace(input="hi"))
            sink = FirstOutput()
            runs.start(call, sink, events(), "", lambda: stopped.append("aborted"))  # type: ignore[arg-type]
            assert store.get(rid).body["status"] == "queued"
            return sink

        start("resp_x")
        runs.cancel_all()
        await asyncio.sleep(0.05)
        assert store.get("resp_x").body["status"] == "cancelled" and stopped == ["aborted"] and len(runs) == 0
        start("resp_y").put_nowait(None)  # its first output: it has started
        assert store.get("resp_y").body["status"] == "in_progress"
        await runs.cancel("resp_y")
        assert store.get("resp_y").body["status"] == "cancelled" and stopped == ["aborted"] * 2
        for rid, delete in (("resp_z", False), ("resp_w", True)):
            sink = start(rid)
            await runs.cancel(rid)
            if delete:
                store.delete(rid)
            sink.put_nowait(None)
            assert (store.get(rid) is None) if delete else store.get(rid).body["status"] == "cancelled"

    asyncio.run(main())


def _event(kind: str, n: int) -> str:
    return f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{n}}}\n\n'


def test_an_event_log_is_followed_from_any_event_while_it_grows() -> None:
    async def main() -> None:
        events = EventLog()
        events.add(_event("a", 0) + _event("b", 1))
        follower = events.follow(0)
        first = await follower.__anext__()
        events.add(_event("c", 2))
        events.close()
        assert first + "".join([chunk async for chunk in follower]) == _event("b", 1) + _event("c", 2)
        assert events.last == {"type": "c", "sequence_number": 2}
        assert "".join([chunk async for chunk in events.follow()]) == _event("a", 0) + _event(
            "b", 1
        ) + _event("c", 2)

    asyncio.run(main())


def test_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=3, max_chars=100)
    for i in range(3):
        store.put(f"r{i}", {}, [{"role": "user", "content": "x" * 10}], [])
    assert store.get("r0") is not None  # r0 is now the most recently used
    store.put("r3", {}, [{"role": "user", "content": "x" * 10}], [])
    assert store.get("r1") is None and store.get("r0") is not None and len(store) == 3
    store.put("big", {}, [{"role": "user", "content": "x" * 90}], [])  # over the characters' bound
    assert [r for r in ("r0", "r2", "r3", "big") if store.get(r)] == ["r0", "big"]  # r2, r3 were oldest
    assert store.delete("big") and not store.delete("big") and len(store) == 1


def test_truncation_auto_drops_the_oldest_turns(ctx: OpenAIContext, monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclass(kw_only=True)
    class Sized(OpenAIContext):
        max_model_len: int = 300

    sized = Sized(model="m", tokenizer=ctx.tokenizer, system_prompts={})
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a" * 150},
        {"role": "assistant", "content": "b" * 50},
        {"role": "user", "content": "c" * 40},
        {"role": "assistant", "content": "d" * 10},
        {"role": "user", "content": "Last?"},
    ]
    body = {"input": turns, "max_output_tokens": 20}
    whole = prepare_response(sized, body, ResponseStore())
    assert "a" * 150 in whole.prep.prompts[0]  # disabled: sent whole (the context check refuses it later)
    cut = prepare_response(sized, {**body, "truncation": "auto"}, ResponseStore())
    prompt = cut.prep.prompts[0]
    assert "Be brief." in prompt and "a" * 150 not in prompt and "c" * 40 in prompt and "Last?" in prompt
    assert len(ctx.tokenizer.encode(prompt)) + 20 <= 300
    many = [turns[0]] + [
        {"role": r, "content": f"{r} {i} " * 6} for i in range(64) for r in ("user", "assistant")
    ] + [{"role": "user", "content": "Last?"}]  # fmt: skip
    renders = []
    monkeypatch.setattr(responses_mod, "prepare_chat", lambda *a: renders.append(1) or prepare_chat(*a))
    cut = prepare_response(
        sized, {"input": many, "truncation": "auto", "max_output_tokens": 20}, ResponseStore()
    )
    assert len(renders) <= 8  # bisection over 65 possible cuts, not one render per turn
    kept = cut.prep.prompts[0]
    first = min(i for i in range(64) if f"user {i} " in kept)  # the fewest turns dropped that fit
    assert len(ctx.tokenizer.encode(kept)) + 20 <= 300
    longer = prepare_chat(sized, {"messages": [turns[0], *many[1 + 2 * (first - 1) :]], "max_tokens": 20})
    assert len(ctx.tokenizer.encode(longer.prompts[0])) + 20 > 300
    tiny = Sized(model="m", tokenizer=ctx.tokenizer, system_prompts={}, max_model_len=40)
    last = prepare_response(tiny, {**body, "truncation": "auto"}, ResponseStore())  # only the last turn left
    assert "Last?" in last.prep.prompts[0] and "c" * 40 not in last.prep.prompts[0]


def test_batch_rows_answer_as_the_server_does(tiny_config_path: Path, tmp_path: Path) -> None:
    """A batch file's /v1/responses rows: the chat row's text in the Responses shape; nothing is
    stored, so a previous_response_id is a 404 row; a prompt over the context a 400 naming input."""
    from prefixserve import LLM

    llm = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, progress=False)
    ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Quito?"}]
    bodies = {
        "chat": ("/v1/chat/completions", {"messages": ask, "max_tokens": 6, "temperature": 0}),
        "resp": ("/v1/responses", {
            "instructions": "Be brief.", "input": ask[1:], "max_output_tokens": 6, "temperature": 0}),
        "chained": ("/v1/responses", {"input": "more?", "previous_response_id": "resp_x"}),
        "long": ("/v1/responses", {"input": "word " * 3000}),
        "background": ("/v1/responses", {"input": "hi", "background": True}),
    }  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": k, "method": "POST", "url": u, "body": b} for k, (u, b) in bodies.items()]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    llm.batch(src, out, progress=False)
    rows = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    answer = rows["resp"]["body"]
    assert rows["resp"]["status_code"] == 200 and answer["object"] == "response" and answer["store"] is False
    chat = rows["chat"]["body"]
    assert answer["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert rows["chained"]["status_code"] == 400
    assert rows["long"]["status_code"] == 400 and rows["long"]["body"]["error"]["param"] == "input"
    assert rows["background"]["status_code"] == 400  # the output file is where a batch answers
    assert rows["background"]["body"]["error"]["param"] == "background"


# ---- live --------------------------------------------------------------------------------------
_pool_empty = engine_checks.wait_server_pool_empty


def test_a_response_is_the_chat_turn_it_stands_for(
    tiny_openai: openai.OpenAI, tiny_server: ServerThread
) -> None:
    ask = "Tell me about the bicycles you sell."
    r = tiny_openai.responses.create(
        model="default", instructions="You sell bicycles.", input=ask, max_output_tokens=12, temperature=0
    )
    chat = tiny_openai.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "You sell bicycles."}, {"role": "user", "content": ask}],
        max_completion_tokens=12,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == chat.model
    assert r.output_text == chat.choices[0].message.content
    assert (
        r.usage.input_tokens == chat.usage.prompt_tokens
        and r.usage.output_tokens == chat.usage.completion_tokens
    )
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.instructions == "You sell bicycles." and r.store is True
    events = list(
        tiny_openai.responses.create(
            model="default",
            instructions="You sell bicycles.",
            input=ask,
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert tiny_openai.responses.retrieve(events[-1].response.id).output_text == text
    _pool_empty(tiny_server)


def test_previous_response_id_goes_on_from_the_prefix_cache(
    tiny_openai: openai.OpenAI, tiny_server: ServerThread
) -> None:
    first = tiny_openai.responses.create(
        model="default", input="Which bicycle for a city?", max_output_tokens=8, temperature=0
    )
    second = tiny_openai.responses.create(
        model="default",
        input="And for mountains?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    whole = [
        {"role": "user", "content": "Which bicycle for a city?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And for mountains?"},
    ]
    chat = tiny_openai.chat.completions.create(
        model="default", messages=whole, max_completion_tokens=8, temperature=0
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0 and second.previous_response_id == first.id
    listed = tiny_openai.responses.input_items.list(second.id)
    assert [i.content[0].text for i in listed.data] == ["And for mountains?"]
    replay = [
        {"role": "user", "content": [{"type": "text", "text": "Which bicycle for a city?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"type": "function_call", "call_id": "call_9", "name": "weather", "arguments": {"city": "Lima"}},
        {"type": "function_call_output", "call_id": "call_9", "output": "sunny"},
    ]
    third = tiny_openai.responses.create(model="default", input=replay, max_output_tokens=2)
    page = httpx.get(f"{tiny_server.url}/v1/responses/{third.id}/input_items?order=asc", timeout=60).json()
    ResponseItemList.model_validate(page)  # the SDK's models: statuses, output_text for the assistant
    assert [i["type"] for i in page["data"]] == [
        "message",
        "message",
        "function_call",
        "function_call_output",
    ]
    assert page["data"][1]["content"][0]["type"] == "output_text"
    tiny_openai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        tiny_openai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as err:  # as OpenAI answers it
        tiny_openai.responses.create(model="default", input="more?", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = tiny_openai.responses.create(model="default", input="hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        tiny_openai.responses.retrieve(unstored.id)
    _pool_empty(tiny_server)


def test_function_call_results_continue_the_conversation(
    tiny_openai: openai.OpenAI, tiny_server: ServerThread
) -> None:
    """A function call and its output sent back as items render as the chat's tool turns do."""
    items = [
        {"role": "user", "content": "Weather in Lima?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Lima"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
    ]
    r = tiny_openai.responses.create(
        model="default", input=items, tools=[WEATHER], max_output_tokens=6, temperature=0
    )
    chat = tiny_openai.chat.completions.create(
        model="default",
        messages=[
            items[0],
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Lima"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
        ],
        tools=[{"type": "function", "function": {"name": "weather", "parameters": WEATHER["parameters"]}}],
        max_completion_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.tools[0].name == "weather"
    _pool_empty(tiny_server)


def _polled(client: openai.OpenAI, rid: str, timeout: float = 60) -> Response:
    """A background response once it has left queued and in_progress."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_background_responses_are_polled_and_cancelled(
    tiny_openai: openai.OpenAI, tiny_server: ServerThread
) -> None:
    ask = {"model": "default", "input": "Which bicycle for a city?", "max_output_tokens": 8, "temperature": 0}
    queued = tiny_openai.responses.create(**ask, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _polled(tiny_openai, queued.id)
    foreground = tiny_openai.responses.create(**ask)
    assert done.status in ("completed", "incomplete") and done.output_text == foreground.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens
    then = tiny_openai.responses.create(
        model="default", input="Why?", previous_response_id=done.id, max_output_tokens=2
    )
    assert then.usage.input_tokens > done.usage.input_tokens  # goes on from the background turn
    with pytest.raises(openai.BadRequestError):  # a foreground response has nothing to cancel
        tiny_openai.responses.cancel(foreground.id)
    long = {
        "model": "default",
        "input": "Ride on.",
        "max_output_tokens": 1500,
        "extra_body": {"ignore_eos": True},
    }
    running = tiny_openai.responses.create(**long, background=True)
    with pytest.raises(openai.BadRequestError) as err:  # still running: no output to go on from
        tiny_openai.responses.create(model="default", input="and?", previous_response_id=running.id)
    assert "previous_response_id" in str(err.value.body)
    cancelled = tiny_openai.responses.cancel(running.id)
    assert (
        cancelled.status == "cancelled" and tiny_openai.responses.retrieve(running.id).status == "cancelled"
    )
    assert tiny_openai.responses.cancel(running.id).status == "cancelled"  # twice: harmless
    deleted = tiny_openai.responses.create(**long, background=True)
    tiny_openai.responses.delete(deleted.id)  # stops it too
    with pytest.raises(openai.NotFoundError):
        tiny_openai.responses.retrieve(deleted.id)
    _pool_empty(tiny_server)  # the cancelled runs' blocks are free
    assert len(tiny_server.app.state.server.background) == 0


def test_a_background_stream_is_resumed_after_any_event(
    tiny_openai: openai.OpenAI, tiny_server: ServerThread
) -> None:
    """OpenAI's background streaming: the create call streams from response.created (status queued)
    on; a client that leaves stops nothing, and GET ?stream=true&starting_after=N resumes after
    event N, so the events join to what a foreground stream sends; cancelling ends the stream."""
    ask = {
        "model": "default",
        "input": "Which bicycle for a city?",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    first: list[Any] = []
    with tiny_openai.responses.create(**ask, background=True, stream=True) as stream:
        for event in stream:
            first.append(event)
            if event.sequence_number == 4:
                break  # the connection drops
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert first[0].response.status == "queued" and first[0].response.background
    rid = first[0].response.id
    rest = list(tiny_openai.responses.retrieve(rid, stream=True, starting_after=4))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    again = list(tiny_openai.responses.retrieve(rid, stream=True))  # from the start, after the end
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    foreground = tiny_openai.responses.create(**ask)
    assert text == foreground.output_text == _polled(tiny_openai, rid).output_text
    with pytest.raises(openai.BadRequestError):  # a foreground response was never streamed to keep
        list(tiny_openai.responses.retrieve(foreground.id, stream=True))
    long = {**ask, "max_output_tokens": 1500, "extra_body": {"ignore_eos": True}}
    running = tiny_openai.responses.create(**long, background=True, stream=True)
    head = next(iter(running))
    tiny_openai.responses.cancel(head.response.id)
    tail = list(tiny_openai.responses.retrieve(head.response.id, stream=True, starting_after=0))
    assert tail[-1].type != "response.completed"  # the stream ends where the run stopped
    assert tiny_openai.responses.retrieve(head.response.id).status == "cancelled"
    tiny_openai.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        list(tiny_openai.responses.retrieve(rid, stream=True))
    _pool_empty(tiny_server)


def test_errors_over_http_and_the_server_keeps_serving(
    tiny_server: ServerThread, tiny_openai: openai.OpenAI
) -> None:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        long_input = "bicycle " * 3000  # over the tiny model's 2,048-token context
        for body, param in [
            ({"input": long_input}, "input"),
            ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
            (
                {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
                "input[0].content[0]",
            ),
        ]:
            got = http.post("/v1/responses", json=body)
            assert got.status_code == 400, got.text
            assert got.json()["error"]["param"] == param, got.text
        streamed = http.post("/v1/responses", json={"input": long_input, "stream": True})
        assert streamed.status_code == 400 and streamed.json()["error"]["code"] == "context_length_exceeded"
        assert http.get("/v1/responses/resp_nope").status_code == 404
        assert http.delete("/v1/responses/resp_nope").status_code == 404
        turns = [
            {"role": "user", "content": long_input},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "hi"},
        ]
        cut = http.post("/v1/responses", json={"input": turns, "truncation": "auto", "max_output_tokens": 4})
        assert cut.status_code == 200 and cut.json()["usage"]["input_tokens"] < 100, cut.text
    ok = tiny_openai.responses.create(model="default", input="still there?", max_output_tokens=3)
    assert ok.usage.output_tokens == 3
    _pool_empty(tiny_server)
