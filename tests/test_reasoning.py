"""Reasoning outputs (``--reasoning-parser``): a thinking model's ``<think> ... </think>`` apart.

Without a model: the split of whole outputs (opened by the template or by the output, closed or cut),
the streamed split against it on random chunkings (never half a tag in a delta), and each API's
answer streamed and not (chat ``reasoning_content``, a Responses reasoning item, an Anthropic thinking
block), tool calls read from the answer alone. Live, with the tiny dummy model: a template that opens
``<think>`` makes the whole output reasoning, streamed or not.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

anthropic = pytest.importorskip("anthropic")  # a test extra (the GPU image has none)
from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402

from prefixserve.config import EngineConfig  # noqa: E402
from prefixserve.entrypoints.openai.server import ServerThread, build_app  # noqa: E402
from prefixserve.model.byte_tokenizer import byte_tokenizer  # noqa: E402
from prefixserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from prefixserve.protocols.anthropic.prepare import prepare_message  # noqa: E402
from prefixserve.protocols.anthropic.stream import message_stream  # noqa: E402
from prefixserve.protocols.openai.prepare import OpenAIContext, prepare_chat, response_body, stream_state  # noqa: E402
from prefixserve.protocols.openai.reasoning import ReasoningSplit, Thinking  # noqa: E402
from prefixserve.protocols.responses.prepare import prepare_response  # noqa: E402
from prefixserve.protocols.responses.store import ResponseStore  # noqa: E402
from prefixserve.protocols.responses.stream import response_stream  # noqa: E402

TOKENIZER = byte_tokenizer()
SPLITS = [  # (opened by the prompt, output) -> (reasoning, answer)
    (False, "<think>Plan it.</think>The answer.", ("Plan it.", "The answer.")),
    (False, "  <think>\nA</think>\n\nB", ("\nA", "\n\nB")),
    (False, "No thinking here.", (None, "No thinking here.")),
    (False, "<think>cut short", ("cut short", "")),
    (True, "Plan it.</think>The answer.", ("Plan it.", "The answer.")),
    (True, "still thinking </thi", ("still thinking </thi", "")),
    (True, "<think>again</think>x", ("again", "x")),
    (True, "", ("", "")),
    (False, "", (None, "")),
    (False, "<thin", (None, "<thin")),
]


@pytest.mark.parametrize(("opened", "text", "expected"), SPLITS)
def test_whole_outputs_split(opened: bool, text: str, expected: tuple[str | None, str]) -> None:
    assert Thinking(opened).split(text) == expected


def test_a_prompt_opens_the_thought_where_its_last_think_is_not_closed() -> None:
    assert Thinking.for_prompt("User: hi\nAssistant: <think>\n").opened  # an R1 distill's template
    assert Thinking.for_prompt("Assistant: <think>\nLet me").opened  # a prefill stopped inside one
    assert not Thinking.for_prompt("Assistant: <think>a</think>b\nUser: more?\nAssistant:").opened
    assert not Thinking.for_prompt("no tags at all").opened
    # only what the template wrote after the last message counts, or a prefill and after
    asked = "What does the <think> tag do?"
    assert not Thinking.for_prompt(f"<user>{asked}<end><assistant>", asked).opened
    assert Thinking.for_prompt(f"<user>{asked}<end><assistant><think>\n", asked).opened
    prefill = "<think>Let me see"
    assert Thinking.for_prompt(f"<user>hi<end><assistant>{prefill}", prefill, continued=True).opened
    assert not Thinking.for_prompt(f"<user>{prefill}<end><assistant>", prefill).opened


def test_deepseek_r1_reads_every_output_as_thinking_first() -> None:
    """vLLM's R1 parser: R1 may think without writing <think>, so the reasoning runs from the start
    of every output to </think> (all of it where there is none), a leading <think> left out."""
    r1 = Thinking.for_prompt("<user>hi<assistant>", "hi", parser="deepseek_r1")
    assert r1.split("Okay, a greeting.\n</think>\n\nHello!") == ("Okay, a greeting.\n", "\n\nHello!")
    assert r1.split("<think>Plan.</think>Done.") == ("Plan.", "Done.")
    assert r1.split("no tags at all") == ("no tags at all", "")
    qwen = Thinking.for_prompt("<user>hi<assistant>", "hi", parser="qwen3")
    assert qwen.split("no tags at all") == (None, "no tags at all")


@pytest.mark.parametrize("seed", range(60))
def test_the_stream_splits_as_the_whole_output(seed: int) -> None:
    rng = random.Random(seed)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", " a", "b ", "\n", "é", "🚲", "<thi", "nk>"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
    opened = rng.random() < 0.5
    split = ReasoningSplit(Thinking(opened))
    cuts = [*sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6)))), len(text)]
    reasoning, answers = "", []
    for k, end in enumerate(cuts):
        delta, answer = split.advance(0, text[:end], k == len(cuts) - 1)
        assert END_TAG not in delta and not delta.endswith("</thin")
        reasoning += delta
        if answer is not None:
            assert not answers or answer.startswith(answers[-1])  # the answer's text only grows
            answers.append(answer)
    whole_reasoning, whole_answer = Thinking(opened).split(text)
    assert reasoning == (whole_reasoning or "") and answers[-1] == whole_answer, (text, opened)


END_TAG = "</think>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Lima?"}]
CALL_TEXT = '<tool_call>{"name": "weather", "arguments": {"city": "Lima"}}</tool_call>'
OPENING = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}<think>\n"  # an R1 distill's way


@pytest.fixture(scope="module")
def ctx() -> OpenAIContext:
    return OpenAIContext(model="m", tokenizer=TOKENIZER, system_prompts={}, reasoning_parser="qwen3")


def _output(text: str, finish: str | None, logprobs: bool = False) -> RequestOutput:
    ids = list(TOKENIZER.encode(text, add_special_tokens=False))
    c = CompletionOutput(0, text, ids, finish)
    if logprobs:
        c.token_logprobs = [-0.5] * len(ids)
        c.top_logprobs = [[(7, -0.1)] for _ in ids]
    return RequestOutput("r-0", None, [1, 2, 3], [c], finish is not None)


def _streamed_with_logprobs(state: Any, text: str, step: int) -> list[str]:
    """The stream's chunks over a growing output whose tokens have logprobs (cut every ``step``)."""
    chunks = list(state.opening())
    for end in range(1, len(text), step):
        chunks += state.update(0, _output(text[:end], None, logprobs=True))
    final = _output(text, "stop", logprobs=True)
    return chunks + state.update(0, final) + state.closing([final])


def _chunks(state: Any, text: str, finish: str) -> list[str]:
    chunks = list(state.opening())
    for end in range(1, len(text), 3):
        chunks += state.update(0, _output(text[:end], None))
    final = _output(text, finish)
    return chunks + state.update(0, final) + state.closing([final])


CASES = {
    "thought then answer": ({}, "<think>Check the map.</think>It is sunny."),
    "thought then a call": (
        {"tools": [WEATHER]},
        "<think>Use the tool.</think>\n"
        '<tool_call>{"name": "weather", "arguments": {"city": "Lima"}}</tool_call>',
    ),
    "no thought": ({}, "Sunny."),
    "cut while thinking": ({}, "<think>Hmm, let me"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chat_streams_reasoning_then_the_answer(ctx: OpenAIContext, case: str) -> None:
    extra, text = CASES[case]
    body = {"messages": ASK, **extra}
    finish = "length" if "cut" in case else "stop"
    whole = response_body(ctx, prepare_chat(ctx, body), [_output(text, finish)])["choices"][0]
    events = [
        json.loads(line[6:])
        for chunk in _chunks(stream_state(ctx, prepare_chat(ctx, {**body, "stream": True})), text, finish)
        for line in chunk.split("\n")
        if line.startswith("data: {")
    ]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    if case == "thought then answer":  # continuous usage: the reasoning's chunks carry it too
        usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        state = stream_state(ctx, prepare_chat(ctx, {**body, "stream": True, **usage}))
        chunks = [c for c in _chunks(state, text, finish) if "reasoning_content" in c]
        assert chunks and all('"usage":{"prompt_tokens"' in c for c in chunks)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    message = whole["message"]
    assert reasoning == (message.get("reasoning_content") or "") and content == (message["content"] or "")
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)  # vLLM's newer name too
    calls = [c for d in deltas for c in d.get("tool_calls") or ()]
    if case == "thought then a call":
        assert message["reasoning_content"] == "Use the tool." and whole["finish_reason"] == "tool_calls"
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["weather"] and calls
    if case == "no thought":
        assert "reasoning_content" not in message and message["content"] == "Sunny."
    if case == "cut while thinking":
        assert message["reasoning_content"] == "Hmm, let me" and message["content"] is None


OPENED_CASES = {"empty thought": ({}, "</think>Hi"), "nothing": ({}, "")}


@pytest.fixture(scope="module")
def opening_ctx() -> OpenAIContext:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = OPENING
    return OpenAIContext(model="m", tokenizer=tokenizer, system_prompts={}, reasoning_parser="qwen3")


@pytest.mark.parametrize("case", [*CASES, *OPENED_CASES])
def test_responses_and_messages_answer_the_reasoning(
    ctx: OpenAIContext, opening_ctx: OpenAIContext, case: str
) -> None:
    extra, text = CASES[case] if case in CASES else OPENED_CASES[case]
    ctx = ctx if case in CASES else opening_ctx
    finish = "length" if "cut" in case else "stop"
    tools = [{"type": "function", "name": "weather", "parameters": WEATHER["function"]["parameters"]}]
    r_body = {"input": ASK[0]["content"], **({"tools": tools} if extra else {})}
    answer = prepare_response(ctx, r_body, ResponseStore()).body([_output(text, finish)])
    Response.model_validate(answer)
    streamed_call = prepare_response(ctx, {**r_body, "stream": True}, ResponseStore())
    events = [
        json.loads(line[6:])
        for chunk in _chunks(response_stream(streamed_call), text, finish)
        for line in chunk.split("\n")
        if line.startswith("data: ")
    ]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == [i["type"] for i in answer["output"]]
    reasoning = [i for i in answer["output"] if i["type"] == "reasoning"]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == "".join(i["content"][0]["text"] for i in reasoning)
    assert bool(reasoning) == (case not in ("no thought", *OPENED_CASES))  # an empty thought: no item
    # the tokens that wrote the reasoning (its tags too), streamed or not
    written = (
        Thinking.for_prompt("", parser="qwen3").answer_at(text)
        if case in CASES
        else text.find("</think>") + 8
    )
    want = len(TOKENIZER.encode(text[:written], add_special_tokens=False)) if written > 0 else 0
    details = answer["usage"]["output_tokens_details"]
    assert details == events[-1]["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": want}
    a_tools = [{"name": "weather", "input_schema": WEATHER["function"]["parameters"]}]
    a_body = {"max_tokens": 64, "messages": ASK, **({"tools": a_tools} if extra else {})}
    message = prepare_message(ctx, a_body).body([_output(text, finish)])
    Message.model_validate(message)
    state = message_stream(prepare_message(ctx, {**a_body, "stream": True}))
    snapshot, bufs, adapter = None, {}, TypeAdapter(RawMessageStreamEvent)
    for chunk in _chunks(state, text, finish):
        for block in chunk.split("\n\n"):
            if block:
                payload = json.loads(block.split("\n")[1][6:])
                snapshot = accumulate_event(
                    event=adapter.validate_python(payload), current_snapshot=snapshot, json_bufs=bufs
                )
    assert snapshot is not None
    kinds = [b["type"] for b in message["content"]]
    assert [b["type"] for b in snapshot.to_dict()["content"]] == kinds
    assert ("thinking" in kinds) == (case not in ("no thought", *OPENED_CASES))
    thinking = [b["thinking"] for b in message["content"] if b["type"] == "thinking"]
    assert thinking == [b["thinking"] for b in snapshot.to_dict()["content"] if b["type"] == "thinking"]


def test_a_template_that_opens_the_thought(tiny_config_path: Path) -> None:
    """Live: the prompt ends inside ``<think>``, so all the (dummy) output is reasoning, streamed or
    not, and the plain server answers the same text as content."""
    base = {
        "model": f"dummy:{tiny_config_path}",
        "device": "cpu",
        "num_kv_blocks": 64,
        "chat_template": OPENING,
    }
    chat = {"messages": ASK, "max_tokens": 8, "temperature": 0}
    with (
        ServerThread(build_app(EngineConfig(**base))) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as h,
    ):
        plain = h.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
    thinking = EngineConfig(**base, reasoning_parser="deepseek_r1")
    with ServerThread(build_app(thinking)) as srv, httpx.Client(base_url=srv.url, timeout=60) as h:
        got = h.post("/v1/chat/completions", json=chat).json()["choices"][0]
        shaped = h.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
        assert shaped.status_code == 200, shaped.text  # the grammar after the thought compiles and runs
        with h.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            deltas = [json.loads(ln[6:])["choices"] for ln in r.iter_lines() if ln.startswith("data: {")]
    assert got["message"]["reasoning_content"] == plain["content"] and got["message"]["content"] is None
    streamed = "".join(c[0]["delta"].get("reasoning_content") or "" for c in deltas if c)
    assert streamed == plain["content"]


@pytest.mark.parametrize("how", ["opened", "optional"])
def test_a_constraint_holds_after_the_thought(how: str) -> None:
    """With a reasoning parser, a chat's structured output is the answer's: free reasoning up to
    ``</think>`` first (the prompt's open one, or one the output opens), then the grammar."""
    xgr = pytest.importorskip("xgrammar")
    from prefixserve.sampling.structured_outputs import StructuredOutputs
    from prefixserve.structured.grammars import GrammarCache

    cache = GrammarCache(TOKENIZER, len(TOKENIZER), [TOKENIZER.eos_token_id])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = cache.get(StructuredOutputs(json=schema, after_thinking=how))

    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(t) for t in TOKENIZER.encode(text, add_special_tokens=False)) and (
            matcher.is_completed() or matcher.accept_token(TOKENIZER.eos_token_id)
        )

    thought = 'Try {"a": 2}, no.</think>\n\n{"a": 1}'
    assert takes(thought) == (how == "opened")
    assert takes('<think>hmm</think>{"a": 1}')
    assert takes('{"a": 1}') == (how == "optional")  # no thought where the output may skip one
    assert not takes('hmm</think>{"a": "x"}') and not takes("hmm</think>nope")


def test_chats_put_the_constraint_after_the_thought(ctx: OpenAIContext) -> None:
    body = {"messages": ASK, "response_format": {"type": "json_object"}}
    assert prepare_chat(ctx, body).params.structured_outputs.after_thinking == "optional"
    plain = OpenAIContext(model="m", tokenizer=TOKENIZER, system_prompts={})
    assert prepare_chat(plain, body).params.structured_outputs.after_thinking is None
    TOKENIZER_OPENING = byte_tokenizer()
    TOKENIZER_OPENING.chat_template = OPENING
    opening = OpenAIContext(
        model="m", tokenizer=TOKENIZER_OPENING, system_prompts={}, reasoning_parser="qwen3"
    )
    forced = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    assert prepare_chat(opening, forced).params.structured_outputs.after_thinking == "opened"


@pytest.mark.parametrize(
    ("text", "said"),
    [("<think>Plan.</think>Hello there", "Hello there"), ("<think>P</think>Hi\n" + CALL_TEXT, "Hi\n")],
)
def test_a_responses_message_has_its_own_logprobs(ctx: OpenAIContext, text: str, said: str) -> None:
    """The reasoning's tokens (and a call's) are no text's: a message's logprobs spell its text,
    streamed or not."""
    tools = [{"type": "function", "name": "weather", "parameters": WEATHER["function"]["parameters"]}]
    body = {"input": "hi", "include": ["message.output_text.logprobs"], "tools": tools}

    answer = prepare_response(ctx, body, ResponseStore()).body([_output(text, "stop", logprobs=True)])
    state = response_stream(prepare_response(ctx, {**body, "stream": True}, ResponseStore()))
    chunks = _streamed_with_logprobs(state, text, 4)
    events = [json.loads(ln[6:]) for c in chunks for ln in c.split("\n") if ln.startswith("data: ")]
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    for part in (
        next(i for i in answer["output"] if i["type"] == "message")["content"][0],
        next(i for i in events[-1]["response"]["output"] if i["type"] == "message")["content"][0],
    ):
        assert "".join(lp["token"] for lp in part["logprobs"]) == part["text"] == said
    assert "".join(lp["token"] for lp in streamed) == said


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["plain", "tools"])
@pytest.mark.parametrize("text", ["<think>Check the map.</think>It is sunny.", "<think>Check the map"])
def test_reasoning_chunks_carry_their_own_logprobs(ctx: OpenAIContext, tools: Any, text: str) -> None:
    """Streamed, each reasoning chunk carries its own tokens' logprobs (vLLM's), the answer's chunks
    the rest; together they are the non-streamed answer's, once each (with tools the answer is held
    until it is known not to be a call: it must not send the reasoning's again, nor where the output
    ends while thinking)."""
    body = {"messages": ASK, "logprobs": True, "top_logprobs": 1} | ({"tools": tools} if tools else {})

    whole = response_body(ctx, prepare_chat(ctx, body), [_output(text, "stop", logprobs=True)])["choices"][0]
    chunks = _streamed_with_logprobs(stream_state(ctx, prepare_chat(ctx, {**body, "stream": True})), text, 3)
    events = [json.loads(ln[6:]) for c in chunks for ln in c.split("\n") if ln.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    thought = [c for c in choices if c["delta"].get("reasoning_content")]
    assert any(c["logprobs"] for c in thought)
    for c in thought:  # a chunk's tokens lie within the reasoning sent so far
        assert all(lp["token"] in "<think>Check the map." for lp in (c["logprobs"] or {}).get("content", []))
    streamed = [lp for c in choices for lp in (c.get("logprobs") or {}).get("content") or ()]
    assert streamed == whole["logprobs"]["content"]
    assert "".join(lp["token"] for lp in streamed) == text


@pytest.mark.parametrize(
    ("text", "blocks"),
    [
        ("<think>Which city? Let me", [("thinking", None)]),  # cut in the thought: no call begun
        ('<think>Lima.</think>{"name": "weather", "argu', [("thinking", None), ("tool_use", "weather")]),
    ],
)
def test_a_forced_call_cut_by_max_tokens_has_the_same_blocks_streamed_or_not(
    ctx: OpenAIContext, text: str, blocks: list[tuple[str, str | None]]
) -> None:
    tools = [
        {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    ]
    body = {"max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Lima?"}], "tools": tools,
            "tool_choice": {"type": "any"}}  # fmt: skip
    whole = prepare_message(ctx, body).body([_output(text, "length")])
    state = message_stream(prepare_message(ctx, {**body, "stream": True}))
    snapshot, buffers, events = None, {}, TypeAdapter(RawMessageStreamEvent)
    for chunk in _chunks(state, text, "length"):
        for block in filter(None, chunk.split("\n\n")):
            event = events.validate_python(json.loads(block.split("\n")[1][6:]))
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert [(b["type"], b.get("name")) for b in whole["content"]] == blocks
    assert [(b.type, getattr(b, "name", None)) for b in snapshot.content] == blocks
    assert whole["stop_reason"] == snapshot.stop_reason == "max_tokens"
