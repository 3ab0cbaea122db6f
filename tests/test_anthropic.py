"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Without a model: content blocks to chat messages, the streamed events (accumulated by the official
``anthropic`` SDK's own code) against the non-streamed answer (text, a cut, a stop sequence, no
text, text then a call, forced calls), errors named in this API's words and shaped as Anthropic's.
Live, with the tiny dummy model and the official client: a message is the chat turn it stands for
(same prompt, same greedy text), streamed or not, a prefill goes on with the assistant's text, tool
results render as the chat's tool turns, ``count_tokens`` counts the prompt that runs, and bad
requests are 4xx in Anthropic's shape while the server keeps serving with its pool empty.
"""

from __future__ import annotations

import json
from typing import Any

import engine_checks
import httpx
import openai
import pytest
from pydantic import TypeAdapter

anthropic = pytest.importorskip("anthropic")  # a test extra (the GPU image has none)
from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent  # noqa: E402

from prefixserve.entrypoints.openai.server import ServerThread  # noqa: E402
from prefixserve.model.byte_tokenizer import byte_tokenizer  # noqa: E402
from prefixserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from prefixserve.protocols.anthropic.prepare import count_tokens, prepare_message  # noqa: E402
from prefixserve.protocols.anthropic.request import MessagesRequest, chat_messages  # noqa: E402
from prefixserve.protocols.anthropic.stream import message_stream  # noqa: E402
from prefixserve.protocols.errors import APIError  # noqa: E402
from prefixserve.protocols.openai.prepare import OpenAIContext, prepare_chat  # noqa: E402

WEATHER = {
    "name": "weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOKENIZER = byte_tokenizer()
ASK = [{"role": "user", "content": "Weather in Lima?"}]
GREEDY = {"temperature": 0}  # the SDK no longer names the sampling fields; the server takes them


@pytest.fixture(scope="module")
def ctx() -> OpenAIContext:
    return OpenAIContext(model="m", tokenizer=TOKENIZER, system_prompts={})


def _output(text: str, finish: str | None, stop: str | None = None, cached: int = 0) -> RequestOutput:
    ids = list(TOKENIZER.encode(text, add_special_tokens=False))
    c = CompletionOutput(0, text, ids, finish, stop_reason=stop)
    return RequestOutput("r-0", None, [1, 2, 3, 4], [c], finish is not None, num_cached_tokens=cached)


def _parse(chunks: list[str]) -> list[dict[str, Any]]:
    """SSE chunks -> the events' payloads, checking each ``event:`` line names its payload's type."""
    events = []
    for chunk in chunks:
        for block in chunk.split("\n\n"):
            if block:
                kind, data = block.split("\n")
                payload = json.loads(data.removeprefix("data: "))
                assert kind == f"event: {payload['type']}"
                events.append(payload)
    return events


def _streamed(ctx: OpenAIContext, body: dict[str, Any], final: RequestOutput) -> list[dict[str, Any]]:
    state = message_stream(prepare_message(ctx, {**body, "stream": True}))
    chunks = list(state.opening())
    text = final.outputs[0].text
    for end in range(1, len(text), 5):
        chunks += state.update(0, _output(text[:end], None, cached=final.num_cached_tokens))
    chunks += state.update(0, final) + state.closing([final])
    return _parse(chunks)


def test_content_blocks_become_chat_messages() -> None:
    req = MessagesRequest.model_validate(
        {
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                             {"type": "text", "text": "Lima?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Lima"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Cusco"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                     "content": [{"type": "text", "text": "no station"}]},
                    {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": "Tomorrow it"},
            ],
        }
    )  # fmt: skip
    messages, prefill = chat_messages(req)
    assert prefill  # the conversation ends with the assistant's text: the model goes on with it
    assert messages[:2] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Lima?"},
    ]
    said = messages[2]
    assert (said["content"], said["reasoning_content"]) == ("Checking.", "Look it up.")
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in said["tool_calls"]] == [
        ("toolu_1", {"city": "Lima"}),
        ("toolu_2", {"city": "Cusco"}),
    ]
    assert messages[3:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Tomorrow it"},
    ]
    assert chat_messages(MessagesRequest.model_validate({"messages": ASK}))[1] is False


def test_claude_codes_conversations_keep_one_prefix() -> None:
    """Claude Code's first system block changes every request (a billing header): left out, so that
    turns share their prompt; same-role neighbours are one turn, as Anthropic combines them."""
    turns = []
    for cch in ("a1b2c", "d3e4f"):
        req = MessagesRequest.model_validate(
            {
                "system": [
                    {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={cch};"},
                    {"type": "text", "text": "You are Claude Code."},
                ],
                "messages": [
                    {"role": "user", "content": "Fix the bug."},
                    {"role": "user", "content": [{"type": "text", "text": "In main.py."}]},
                    {"role": "assistant", "content": "Looking."},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "main.py"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "x = 1"}]},
                ],
            }
        )  # fmt: skip
        turns.append(chat_messages(req))
    assert turns[0] == turns[1]
    messages, prefill = turns[0]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"] and not prefill
    assert messages[0]["content"] == "You are Claude Code."
    assert messages[1]["content"] == "Fix the bug.\n\nIn main.py."
    assert messages[2]["content"] == "Looking." and messages[2]["tool_calls"][0]["id"] == "t1"


def _without_ids(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content blocks without the tool calls' generated ids (checked to be there)."""
    assert all(b["id"].startswith("call_") for b in blocks if b["type"] == "tool_use")
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Lima"}}</tool_call>'
CASES = {
    "text": ({}, "It is sunny in Lima today.", "stop", None),
    "cut": ({}, "It is sunny in Li", "length", None),
    "stop sequence": ({"stop_sequences": ["today"]}, "It is sunny in Lima ", "stop", "today"),
    "empty": ({}, "", "stop", None),
    "text then a call": ({"tools": [WEATHER]}, "Let me check.\n" + CALL, "stop", None),
    "any": (
        {"tools": [WEATHER], "tool_choice": {"type": "any"}},
        '[{"name": "weather", "arguments": {"city": "Lima"}},'
        ' {"name": "weather", "arguments": {"city": "Cusco"}}]',
        "stop",
        None,
    ),
    "named": ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "weather"}}, '{"city": "Lima"}',
              "stop", None),
    "auto, no call": ({"tools": [WEATHER]}, "{not a call}", "stop", None),
    "any, cut": ({"tools": [WEATHER], "tool_choice": {"type": "any"}}, '[{"name": "weather", "argu',
                 "length", None),
    "named, cut": ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "weather"}}, '{"city": "Li',
                   "length", None),
    "typeless tool": ({"tools": [{**WEATHER, "type": None}]}, "Sunny.", "stop", None),
    "unicode": ({}, "Voilà 🚲🚲 ok", "stop", None),
}  # fmt: skip
EVENT = TypeAdapter(RawMessageStreamEvent)


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_events_build_the_non_streamed_answer(ctx: OpenAIContext, case: str) -> None:
    extra, text, finish, stop = CASES[case]
    body = {"model": "m", "max_tokens": 64, "messages": ASK, **extra}
    final = _output(text, finish, stop, cached=3)
    answer = prepare_message(ctx, body).body([final])
    Message.model_validate(answer)
    events = _streamed(ctx, body, final)
    for event in events:
        EVENT.validate_python(event)
    assert events[0]["type"] == "message_start" and events[0]["message"]["content"] == []
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    snapshot, bufs = None, {}  # the message as the official SDK's stream accumulates it
    for event in events:
        snapshot = accumulate_event(
            event=EVENT.validate_python(event), current_snapshot=snapshot, json_bufs=bufs
        )
    assert snapshot is not None
    streamed = snapshot.to_dict()
    assert streamed["id"].startswith("msg_") and answer["id"].startswith("msg_")
    for key in ("model", "stop_reason", "stop_sequence", "usage"):
        assert streamed[key] == answer[key], key
    assert _without_ids(streamed["content"]) == _without_ids(answer["content"])
    opened = [e["index"] for e in events if e["type"] == "content_block_start"]
    closed = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert opened == closed == list(range(len(answer["content"])))  # each block closed before the next
    usage = answer["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"], usage["output_tokens"]) == (
        1,
        3,
        len(final.outputs[0].token_ids),
    )  # input_tokens: the prompt's tokens the prefix cache did not hold
    kinds = [b["type"] for b in answer["content"]]
    expected = {
        "text": (["text"], "end_turn"),
        "cut": (["text"], "max_tokens"),
        "stop sequence": (["text"], "stop_sequence"),
        "empty": ([], "end_turn"),
        "text then a call": (["text", "tool_use"], "tool_use"),
        "any": (["tool_use", "tool_use"], "tool_use"),
        "named": (["tool_use"], "tool_use"),
        "auto, no call": (["text"], "end_turn"),
        "any, cut": (["tool_use"], "max_tokens"),  # never the constrained output's own text
        "named, cut": (["tool_use"], "max_tokens"),
        "typeless tool": (["text"], "end_turn"),
        "unicode": (["text"], "end_turn"),
    }
    assert (kinds, answer["stop_reason"]) == expected[case]
    assert answer["stop_sequence"] == stop
    for block in answer["content"]:
        if block["type"] == "tool_use":
            assert block["name"] == "weather" and block["input"].get("city", "Lima") in ("Lima", "Cusco")
            assert block["input"] or "cut" in case  # a call cut short has no input yet
    if case == "text then a call":
        assert answer["content"][0]["text"] == "Let me check.\n"


ERRORS = [
    ({"max_tokens": 8}, "messages"),
    ({"messages": ASK}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 8}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 8}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 8},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}], "max_tokens": 8},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}], "max_tokens": 8},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "weather", "input": {}}]}], "max_tokens": 8},
     "messages[1].content"),
    ({"messages": ASK, "max_tokens": 8, "system": 3}, "system"),
    ({"messages": ASK, "max_tokens": 8, "thinking": {"type": "deep"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}], "max_tokens": 8},
     "messages[0].content[0].is_error"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking"}]}], "max_tokens": 8},
     "messages[0].content[0].thinking"),
    ({"messages": ASK, "max_tokens": 8, "tools": [WEATHER],
      "tool_choice": {"type": "any", "disable_parallel_tool_use": "x"}},
     "tool_choice.disable_parallel_tool_use"),
    ({"messages": ASK, "max_tokens": 8, "tools": [{**WEATHER, "description": 3}]}, "tools[0].description"),
    ({"messages": ASK, "max_tokens": 8, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": ASK, "max_tokens": 8, "context_management": {"edits": []}}, "context_management"),
    ({"messages": ASK, "max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"messages": ASK, "max_tokens": 8, "tools": [{"name": "bad name!", "input_schema": {}}]},
     "tools[0].name"),
    ({"messages": ASK, "max_tokens": 8, "tools": [{"name": "f", "input_schema": 3}]},
     "tools[0].input_schema"),
    ({"messages": ASK, "max_tokens": 8, "tools": [WEATHER], "tool_choice": {"type": "sometimes"}},
     "tool_choice"),
    ({"messages": ASK, "max_tokens": 8, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice"),
    ({"messages": ASK, "max_tokens": 8, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": ASK, "max_tokens": 8, "output_config": {"format": {"type": "yaml"}}},
     "output_config.format"),
    ({"messages": ASK, "max_tokens": 8, "output_config": {"format": {"type": "json_schema",
                                                                     "schema": {"type": "nope"}}}},
     "output_config.format.schema"),
    ({"messages": ASK, "max_tokens": 8, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"messages": ASK, "max_tokens": 8, "temperature": "hot"}, "temperature"),
    ({"messages": ASK, "max_tokens": 8, "stop_sequences": "END"}, "stop_sequences"),
    ({"messages": ASK, "max_tokens": 8, "model": "claude-9"}, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), ERRORS, ids=[p for _, p in ERRORS])
def test_bad_requests_name_the_field_in_this_api(
    ctx: OpenAIContext, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as err:
        prepare_message(ctx, body)
    assert err.value.status in (400, 404) and err.value.param == param, err.value.message
    for chat_word in ("max_completion_tokens", "response_format", ".function.", "json_schema.schema",
                      "truncation", "'required'"):  # fmt: skip
        assert chat_word not in err.value.message


def test_count_tokens_counts_the_prompt_that_runs(ctx: OpenAIContext) -> None:
    body = {"system": "Be brief.", "messages": [*ASK, {"role": "assistant", "content": "It is"}]}
    counted = count_tokens(ctx, body)["input_tokens"]
    chat = prepare_chat(
        ctx,
        {
            "messages": [{"role": "system", "content": "Be brief."}, *body["messages"]],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert counted == len(TOKENIZER.encode(chat.prompts[0])) > 10
    with pytest.raises(APIError):
        count_tokens(ctx, {"messages": []})


# ---- live --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(tiny_server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="none", max_retries=0, timeout=120)


_pool_empty = engine_checks.wait_server_pool_empty


def test_a_message_is_the_chat_turn_it_stands_for(
    claude: anthropic.Anthropic, tiny_openai: openai.OpenAI, tiny_server: ServerThread
) -> None:
    ask = "Tell me about the bicycles you sell."
    c = tiny_openai.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "You sell bicycles."}, {"role": "user", "content": ask}],
        max_completion_tokens=12,
        temperature=0,
    )
    m = claude.messages.create(
        model="default", system="You sell bicycles.", max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": ask}],
    )  # fmt: skip
    text = c.choices[0].message.content
    assert m.type == "message" and m.id.startswith("msg_") and m.model == c.model
    assert "".join(b.text for b in m.content if b.type == "text") == text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.cache_read_input_tokens > 0  # the chat's prompt, asked again
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.stop_reason == ("max_tokens" if c.choices[0].finish_reason == "length" else "end_turn")
    with claude.messages.stream(
        model="default", system="You sell bicycles.", max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": ask}],
    ) as stream:  # fmt: skip
        deltas = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert deltas == text == "".join(b.text for b in final.content if b.type == "text")
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    counted = claude.messages.count_tokens(
        model="default", system="You sell bicycles.", messages=[{"role": "user", "content": ask}]
    )
    assert counted.input_tokens == c.usage.prompt_tokens
    if len(text) > 8:  # a stop sequence from the greedy text itself ends it there
        seq = text[4:8]
        cut = claude.messages.create(
            model="default", system="You sell bicycles.", max_tokens=12, extra_body=GREEDY,
            messages=[{"role": "user", "content": ask}], stop_sequences=[seq],
        )  # fmt: skip
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", seq)
        assert cut.content[0].text == text[: text.find(seq)]
    _pool_empty(tiny_server)


def test_prefill_and_tool_results_render_as_the_chat(
    claude: anthropic.Anthropic, tiny_openai: openai.OpenAI, tiny_server: ServerThread
) -> None:
    prefill = [{"role": "user", "content": "Name a bicycle."}, {"role": "assistant", "content": "The best"}]
    m = claude.messages.create(model="default", max_tokens=6, extra_body=GREEDY, messages=prefill)
    c = tiny_openai.chat.completions.create(
        model="default", messages=prefill, max_completion_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert m.content[0].text == c.choices[0].message.content  # the new text only, as Claude answers
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    turns = [
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Lima"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]  # fmt: skip
    m = claude.messages.create(
        model="default", max_tokens=4, extra_body=GREEDY, messages=turns, tools=[WEATHER]
    )
    c = tiny_openai.chat.completions.create(
        model="default",
        messages=[
            turns[0],
            {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Lima"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        ],
        tools=[{"type": "function", "function": {"name": "weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],
        max_completion_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    _pool_empty(tiny_server)


def test_errors_are_anthropics_and_the_server_keeps_serving(
    claude: anthropic.Anthropic, tiny_server: ServerThread
) -> None:
    long = [{"role": "user", "content": "bicycle " * 3000}]  # over the tiny model's 2,048-token context
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="default", max_tokens=8, messages=long)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="default", max_tokens=8, messages=long, stream=True)
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-9", max_tokens=8, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:  # the message names the field, as Anthropic's do
        claude.messages.create(
            model="default", max_tokens=8, messages=[{"role": "user", "content": [{"type": "image"}]}]
        )
    assert err.value.body["error"]["message"].startswith("messages[0].content[0]: ")
    thinks = claude.messages.create(  # Claude's clients send it unasked: accepted
        model="default", max_tokens=2, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert thinks.usage.output_tokens == 2
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        got = http.post("/v1/messages", content=b"{not json")
        assert got.status_code == 400 and got.json()["type"] == "error", got.text
        got = http.post("/v1/messages/count_tokens", json={"messages": "hi"})
        assert got.status_code == 400 and got.json()["error"]["type"] == "invalid_request_error"
    ok = claude.messages.create(model="default", max_tokens=3, messages=ASK)
    assert ok.usage.output_tokens == 3
    _pool_empty(tiny_server)


def test_a_failure_mid_stream_is_an_error_event(ctx: OpenAIContext) -> None:
    state = message_stream(prepare_message(ctx, {"max_tokens": 8, "messages": ASK, "stream": True}))
    started = _parse(state.update(0, _output("It is", None)))
    assert [e["type"] for e in started] == ["message_start", "content_block_start", "content_block_delta"]
    for server_type, kind in [
        ("internal_server_error", "api_error"),
        ("rate_limit_error", "rate_limit_error"),
        ("invalid_request_error", "invalid_request_error"),
    ]:
        (event,) = _parse([state.error_event({"error": {"type": server_type, "message": "why"}})])
        ErrorResponse.model_validate(event)  # what the SDK reads an error event's data as
        assert event == {"type": "error", "error": {"type": kind, "message": "why"}}
