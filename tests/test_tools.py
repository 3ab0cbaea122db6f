"""Tool calling and structured-output fields without a model: reading tools and tool_choice, rendering
(Hermes for templates without tools, the template's own otherwise), parsing calls from outputs,
streaming them as ``delta.tool_calls``, and OpenAI bodies (as batch files send them) to StructuredOutputs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from prefixserve.model.byte_tokenizer import byte_tokenizer
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.prepare import (
    OpenAIContext,
    prepare,
    prepare_chat,
    response_body,
    stream_state,
)
from prefixserve.protocols.openai.request_models import ChatCompletionRequest, parse_request
from prefixserve.protocols.openai.tools import conversation, parse_calls, read_tools, tool_message

pytest.importorskip("xgrammar")

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "time"}},
]
ASK = [{"role": "user", "content": "Weather in Lima?"}]
CALL = '{"city": "Lima"}'


def _req(**body: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": ASK, **body}, "messages")


def test_tool_choice_modes_and_constraints() -> None:
    assert read_tools(_req()) is None
    none = read_tools(_req(tools=TOOLS, tool_choice="none"))
    assert none.choice == "none" and none.constraint() is None
    ctx = OpenAIContext(model="m", tokenizer=byte_tokenizer(), system_prompts={})
    prep = prepare_chat(ctx, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert prep.tools is None  # nothing reads the output as calls...
    auto_prompt = prepare_chat(ctx, {"messages": ASK, "tools": TOOLS}).prompts[0]
    assert prep.prompts[0] == auto_prompt  # ...yet the tools stay in the prompt, as OpenAI and vLLM keep them
    auto = read_tools(_req(tools=TOOLS))
    assert auto.choice == "auto" and auto.constraint() is None
    required = read_tools(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    schema = required.constraint().json
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["weather", "time"]
    named = read_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}))
    assert named.constraint().json == PARAMS
    with pytest.raises(APIError) as err:
        read_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert err.value.param == "tool_choice" and "nope" in err.value.message
    with pytest.raises(APIError) as err:  # the function as a string, not an object
        read_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": "weather"}))
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("function", [5, "weather", {"arguments": "{}"}, {"name": "weather", "arguments": 3}])
def test_an_earlier_call_that_is_not_a_function_object_is_a_400(function: Any) -> None:
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": function}]},
    ]
    with pytest.raises(APIError) as err:
        _req(messages=history, tools=TOOLS)
    assert err.value.status == 400 and err.value.param == "messages[1].tool_calls"


def test_parse_calls_in_each_mode() -> None:
    auto = read_tools(_req(tools=TOOLS))
    text = 'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    message, reason = tool_message(text, "stop", auto)
    assert reason == "tool_calls" and message["content"] == "Sure.\n"  # the text before the call
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Lima"}'}
    two = text + '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    assert [c["function"]["name"] for c in parse_calls(two, auto)] == ["weather", "time"]
    one = read_tools(_req(tools=TOOLS, parallel_tool_calls=False))  # at most one call, the first
    assert [c["function"]["name"] for c in parse_calls(two, one)] == ["weather"]
    assert parse_calls('{"name": "weather", "arguments": {"city": "Oslo"}}', auto)  # bare, no tags
    (llama3,) = parse_calls('{"name": "weather", "parameters": {"city": "Oslo"}}', auto)  # llama3_json's
    assert llama3["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert parse_calls("It is sunny.", auto) is None
    assert parse_calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', auto) is None
    assert tool_message('<tool_call>{"name": "wea', "length", auto) == (
        {"role": "assistant", "content": '<tool_call>{"name": "wea'},
        "length",
    )
    required = read_tools(_req(tools=TOOLS, tool_choice="required"))
    calls = parse_calls(
        '[{"name": "time", "arguments": {}}, {"name": "weather", "arguments": {"city": "A"}}]', required
    )
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{}, {"city": "A"}]
    named = read_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}))
    (call,) = parse_calls('{"city": "Lima"}', named)
    assert call["function"]["name"] == "weather" and call["id"].startswith("call_")


def test_rendering_hermes_and_history() -> None:
    req = _req(
        messages=[
            {"role": "system", "content": "Be brief."},
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": CALL}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=TOOLS,
    )  # fmt: skip
    tools = read_tools(req)
    hermes = conversation(req.messages, tools, native=False)
    assert (
        hermes[0]["content"].startswith("Be brief.\n\n# Tools")
        and '"name": "weather"' in hermes[0]["content"]
    )
    assert (
        hermes[2]["content"]
        == '<tool_call>\n{"name": "weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    )
    assert hermes[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native = conversation(req.messages, tools, native=True)
    assert native[0] == {"role": "system", "content": "Be brief."}
    assert native[2]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Lima"}}
    assert native[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.fixture(scope="module")
def ctx() -> OpenAIContext:
    return OpenAIContext(model="m", tokenizer=byte_tokenizer(), system_prompts={})


def _output(text: str, finish: str | None) -> RequestOutput:
    return RequestOutput(
        "r-0", None, [1], [CompletionOutput(0, text, [1] * len(text), finish)], finish is not None
    )


def _events(chunks: list[str]) -> list[dict[str, Any]]:
    return [json.loads(c.removeprefix("data: ")) for c in chunks]


def test_streamed_tool_calls_reassemble_to_the_reply(ctx: OpenAIContext) -> None:
    body = {"messages": ASK, "tools": TOOLS, "stream": True}
    prep = prepare(ctx, "/v1/chat/completions", body)
    text = '<tool_call>{"name": "weather", "arguments": {"city": "Lima", "days": 3}}</tool_call>'
    state = stream_state(ctx, prep)
    chunks = []
    for end in range(0, len(text), 7):
        chunks += state.update(0, _output(text[:end], None))
    assert chunks == []  # held back: it may be a call
    events = _events(state.update(0, _output(text, "stop")))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    head = deltas[0]["tool_calls"][0]
    assert head["id"].startswith("call_") and head["function"] == {"name": "weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d.get("tool_calls"))
    assert json.loads(args) == {"city": "Lima", "days": 3}
    plain = stream_state(ctx, prep)  # an auto reply that is text streams as text
    first = _events(plain.update(0, _output("It is", None)))
    assert first[0]["choices"][0]["delta"] == {"content": "It is"}
    reply = response_body(ctx, prep, [_output(text, "stop")])
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "weather"


def test_text_then_a_call_streams_the_text_then_the_call(ctx: OpenAIContext) -> None:
    """tool_choice auto, a reply that opens with text and then calls: streamed, the text goes out (never
    the tag, nor a tail that may start one), then the call, as the non-streamed reply holds both."""
    prep = prepare(ctx, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "stream": True})
    text = 'Sure, one moment.\n<tool_call>{"name": "weather", "arguments": {"city": "Lima"}}</tool_call>'
    state = stream_state(ctx, prep)
    sent = ""
    for end in range(1, len(text)):
        for e in _events(state.update(0, _output(text[:end], None))):
            sent += e["choices"][0]["delta"].get("content", "")
            assert "<" not in sent and e["choices"][0]["finish_reason"] is None
    events = _events(state.update(0, _output(text, "stop")))
    sent += "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert sent == "Sure, one moment.\n"
    calls = [d["tool_calls"][0] for e in events if (d := e["choices"][0]["delta"]).get("tool_calls")]
    assert calls[0]["function"]["name"] == "weather"
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == {"city": "Lima"} and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    reply = response_body(ctx, prep, [_output(text, "stop")])["choices"][0]
    assert reply["message"]["content"] == sent and reply["finish_reason"] == "tool_calls"
    plain = stream_state(ctx, prep)  # a tag that parses to no call: the rest goes out as text
    broken = "Hm.\n<tool_call>not json</tool_call>"
    got = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for end in (5, len(broken))
        for e in _events(plain.update(0, _output(broken[:end], None if end < len(broken) else "stop")))
    )
    assert got == broken


def test_held_reply_that_is_no_call_keeps_its_logprobs(ctx: OpenAIContext) -> None:
    body = {"messages": ASK, "tools": TOOLS, "stream": True, "logprobs": True}
    prep = prepare(ctx, "/v1/chat/completions", body)
    state = stream_state(ctx, prep)
    text = "{not a call}"
    out = _output(text, "stop")
    out.outputs[0].token_logprobs = [-0.5] * len(text)
    out.outputs[0].top_logprobs = [[] for _ in text]
    (event,) = _events(state.update(0, out))
    assert event["choices"][0]["delta"] == {"content": text}
    assert len(event["choices"][0]["logprobs"]["content"]) == len(text)


def _with_logprobs(out: RequestOutput) -> RequestOutput:
    c = out.outputs[0]
    c.token_logprobs, c.top_logprobs = [-0.5] * len(c.token_ids), [[] for _ in c.token_ids]
    return out


@pytest.mark.parametrize("before", ["", "Sure! "])
def test_streamed_calls_carry_the_content_and_logprobs_of_the_reply(ctx: OpenAIContext, before: str) -> None:
    """Streamed, a call reply holds the same content (the text before the first call; the text after
    it is dropped in both) and every token's logprob, as the non-streamed reply does."""
    body = {"messages": ASK, "tools": TOOLS, "stream": True, "logprobs": True}
    prep = prepare(ctx, "/v1/chat/completions", body)
    text = before + '<tool_call>{"name": "time", "arguments": {}}</tool_call> bye'
    state = stream_state(ctx, prep)
    events = []
    for end in range(1, len(text) + 1):
        events += _events(
            state.update(0, _with_logprobs(_output(text[:end], None if end < len(text) else "stop")))
        )
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    logprobs = sum(len((e["choices"][0]["logprobs"] or {}).get("content") or ()) for e in events)
    reply = response_body(ctx, prep, [_with_logprobs(_output(text, "stop"))])["choices"][0]
    assert content == (reply["message"]["content"] or "") == before
    assert logprobs == len(reply["logprobs"]["content"]) == len(text)
    assert events[-1]["choices"][0]["finish_reason"] == reply["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PARAMS}}},
            "json",
        ),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
        ({"guided_json": PARAMS}, "json"),
        ({"guided_grammar": 'root ::= "x"'}, "grammar"),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_bodies_to_structured_outputs(ctx: OpenAIContext, body: dict[str, Any], kind: str | None) -> None:
    for url, base in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        spec = prepare(ctx, url, {**base, **body}).params.structured_outputs
        assert (spec.kind if spec else None) == kind


def test_the_pinned_prompt_leads_only_a_chat_it_was_put_in_front_of() -> None:
    """``Prepared.application`` (what the engine puts in front) is the request's only where the
    rendered chat opens with the pinned system message as it was pinned."""
    ctx = OpenAIContext(model="m", tokenizer=byte_tokenizer(), system_prompts={"shop": "Sell bikes."})
    ask = {"messages": ASK, "application": "shop"}
    pinned = prepare(ctx, "/v1/chat/completions", ask)
    assert pinned.application == "shop" and "Sell bikes." in pinned.prompts[0]
    own = [{"role": "developer", "content": "Be brief."}, *ASK]
    mine = prepare(ctx, "/v1/chat/completions", {**ask, "messages": own})
    assert mine.application is None and "Sell bikes." not in mine.prompts[0]
    tooled = prepare(ctx, "/v1/chat/completions", {**ask, "tools": TOOLS})  # the tools join its text
    assert tooled.application is None and "Sell bikes.\n\n# Tools" in tooled.prompts[0]
    plain = prepare(ctx, "/v1/completions", {"prompt": "x", "application": "shop"})
    assert plain.application == "shop"


def test_a_template_that_writes_the_tools_into_the_pinned_message_takes_no_application() -> None:
    """A template rendering the tools inside the system turn (as Qwen2.5's does): the chat no longer
    opens with the pinned prompt as pinned, so the engine must not put that in front again."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% if loop.first and tools %} Tools: {{ tools | length }}{% endif %}<|end|>{% endfor %}"
    )
    ctx = OpenAIContext(model="m", tokenizer=tokenizer, system_prompts={"shop": "Sell bikes."})
    ask = {"messages": ASK, "application": "shop"}
    assert prepare(ctx, "/v1/chat/completions", ask).application == "shop"
    tooled = prepare(ctx, "/v1/chat/completions", {**ask, "tools": TOOLS})
    assert tooled.application is None and tooled.prompts[0].startswith("<|system|>Sell bikes. Tools: 2")


def test_names_reasoning_and_effort_reach_the_template() -> None:
    """A message's ``name`` and ``reasoning_content`` and the request's ``reasoning_effort`` are the
    template's to render (vLLM gives them to it); a template that does not read them is unchanged."""
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.reasoning_content }}]{{ m.content }}"
        "{% endfor %}<{{ reasoning_effort }}>"
    )
    ctx = OpenAIContext(model="m", tokenizer=tok, system_prompts={})
    messages = [
        {"role": "user", "content": "Hi", "name": "ana"},
        {"role": "assistant", "content": "Yes", "reasoning_content": "short"},
        {"role": "user", "content": "More?"},
    ]
    prep = prepare(ctx, "/v1/chat/completions", {"messages": messages, "reasoning_effort": "low"})
    assert prep.prompts[0] == "[user|ana|]Hi[assistant||short]Yes[user||]More?<low>"


def test_a_responses_structured_outputs_constrains_it(ctx: OpenAIContext) -> None:
    from prefixserve.protocols.responses.prepare import prepare_response
    from prefixserve.protocols.responses.store import ResponseStore

    call = prepare_response(
        ctx, {"input": "Pick", "structured_outputs": {"choice": ["a", "b"]}}, ResponseStore()
    )
    assert call.prep.params.structured_outputs is not None


def test_a_chat_stream_that_fails_ends_with_the_error_then_done(ctx: OpenAIContext) -> None:
    """An engine failure mid-stream is sent as an error event and the stream still ends with
    ``[DONE]``, as vLLM's streams end (SSE clients wait for it)."""
    state = stream_state(ctx, prepare(ctx, "/v1/chat/completions", {"messages": ASK, "stream": True}))
    error = APIError(500, "the engine failed while running this request", code="engine_error")
    event = state.error_event(error.body())
    assert event.endswith("data: [DONE]\n\n")
    (body,) = [json.loads(ln[6:]) for ln in event.split("\n") if ln.startswith("data: {")]
    assert body["error"]["code"] == "engine_error"
