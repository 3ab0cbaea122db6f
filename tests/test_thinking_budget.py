"""``thinking_token_budget`` (vLLM's): the budget's reading of an output (synthetic tokens), the
engine forcing ``</think>`` after the budget with launch-ahead on and off (the same tokens), rows
without a budget untouched, and the server's fields (chats, completions, Anthropic's
``thinking.budget_tokens``) with their refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.sampling.min_tokens import TokenBan
from prefixserve.sampling.thinking_budget import ThinkingBudget, ThinkingTags, prompt_thought
from tests.conftest import assert_pool_empty

TAGS = ThinkingTags(start=(7, 8), end=(9, 10, 11))


def budget_after(output: list[int], budget: int, opened: bool) -> tuple[Any, int | None]:
    b = ThinkingBudget(budget, TAGS, opened)
    state = b.read(0, output)
    return state, b.forced(state, output)


class Chars:
    """A tokenizer of one id per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def test_the_prompt_opens_the_thought_where_its_last_start_tag_is_open() -> None:
    """As vLLM's budget reads a prompt: its last <think> not closed after it opens the thought, and
    the prompt's tokens after the tag count (a prefill inside it); found as token ids, or as a prompt
    whose text ends with <think> however it was tokenized."""
    chars = Chars()
    tags = ThinkingTags.encode(chars)
    assert tags == ThinkingTags(tuple(map(ord, "<think>")), tuple(map(ord, "</think>")))
    assert prompt_thought(chars.encode("<user>hi<assistant><think>\n"), chars, tags) == 1
    assert prompt_thought(chars.encode("<assistant><think>\nLet me see"), chars, tags) == 11
    assert prompt_thought(chars.encode("<think>\n\n</think>\n\n"), chars, tags) is None
    assert prompt_thought(chars.encode("no tags"), chars, tags) is None
    split = ThinkingTags(start=(900, 901), end=(902,))  # the tag's ids differ from the prompt's split
    assert prompt_thought(chars.encode("<assistant><think>"), chars, split) == 0


def test_a_forced_token_is_the_choice_unless_a_ban_names_it() -> None:
    logits = torch.zeros(3, 6)
    TokenBan([1], [4], forced_rows=[0, 1], forced_ids=[2, 4]).apply(logits)
    assert logits[0].argmax() == 2 and logits[0, 2] > 1e8
    assert logits[1, 4] == float("-inf") and torch.isfinite(logits[1, :4]).all()  # the ban wins
    assert (logits[2] == 0).all()


@pytest.mark.parametrize(
    ("output", "budget", "opened", "forced", "count"),
    [
        ([5, 5, 5], 3, True, 9, 3),  # the budget reached: the end tag's first token
        ([5, 5], 3, True, None, 2),  # not yet
        ([5, 5, 5, 9], 3, True, 10, 4),  # forcing goes on with the tag's next token
        ([5, 9, 10], 2, True, 11, 3),  # the model began the tag itself: its last token is forced
        ([5, 9, 10, 11, 5, 5, 5], 1, True, None, 3),  # closed by the model: never forced after
        ([7, 8, 5, 5], 2, False, 9, 2),  # the output opened it: its tags are not counted
        ([7, 8], 0, False, 9, 0),  # budget 0: the end right after the opening
        ([5, 7, 8, 5, 5], 1, False, None, 0),  # the output did not open with it: no thought
        ([], 0, True, 9, 0),  # opened by the prompt, budget 0: the first token is the end tag
    ],
)
def test_the_budget_reads_an_output(
    output: list[int], budget: int, opened: bool, forced: int | None, count: int
) -> None:
    state, token = budget_after(output, budget, opened)
    assert token == forced and state.count == count


def test_tokens_still_on_the_device_stop_the_reading_and_say_whether_to_wait() -> None:
    b = ThinkingBudget(4, TAGS, True)
    state = b.read(0, [5, 5, -1])
    assert state.seen == 2 and not b.unsure(state, 1)  # 2 + 1 < 4: nothing can be forced yet
    state = b.read(0, [5, 5, 5, -1])
    assert state.seen == 3 and b.unsure(state, 1)  # the token in flight may reach the budget
    assert b.read(0, [5, 5, 5, 5]).count == 4  # read on from where it stopped


def test_bad_budgets_are_refused() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)  # type: ignore[arg-type]


# ---- the engine ---------------------------------------------------------------------------------
def thinking_llm(path: Path, async_scheduling: bool, parser: str | None = "qwen3") -> LLM:
    return LLM(model=f"dummy:{path}", device="cpu", num_kv_blocks=256, reasoning_parser=parser,
               async_scheduling=async_scheduling, progress=False)  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_ends_the_thought_after_the_budget(tiny_config_path: Path, async_scheduling: bool) -> None:
    """A prompt that opens <think>: each sample's output has the end tag right after its budget's
    tokens (unless it wrote one itself first), samples without a budget run as they would alone, and
    launch-ahead changes no token."""
    llm = thinking_llm(tiny_config_path, async_scheduling)
    tok = llm.get_tokenizer()
    end = tok.encode("</think>", add_special_tokens=False)
    prompt = {"prompt_token_ids": [5, 6, 7, *tok.encode("<think>\n", add_special_tokens=False)]}
    budgets = [0, 3, 6, None]
    room = 6 + len(end) + 2  # the tag's tokens fit after the largest budget (8 of them in bytes)
    params = [
        SamplingParams(max_tokens=room, ignore_eos=True, temperature=t, seed=1, n=2, thinking_token_budget=b)
        for b in budgets
        for t in (0.0, 1.0)
    ]
    outs = llm.generate([prompt] * len(params), params)
    alone = llm.generate([prompt], SamplingParams(max_tokens=room, ignore_eos=True, temperature=0.0, n=2))[0]
    for p, out in zip(params, outs, strict=True):
        for c in out.outputs:
            budget = p.thinking_token_budget
            if budget is None:
                continue
            ids = c.token_ids
            written = next((i for i in range(len(ids)) if ids[i : i + len(end)] == end), None)
            assert written is not None and written <= budget, (budget, ids)
            if written < budget:
                continue  # the model closed it itself
            assert ids[budget : budget + len(end)] == end
            assert "</think>" in c.text
    none_greedy = outs[budgets.index(None) * 2]
    assert [c.token_ids for c in none_greedy.outputs] == [c.token_ids for c in alone.outputs]
    assert_pool_empty(llm)
    other = thinking_llm(tiny_config_path, not async_scheduling)
    again = other.generate([prompt] * len(params), params)
    assert [[c.token_ids for c in o.outputs] for o in again] == [
        [c.token_ids for c in o.outputs] for o in outs
    ]


def test_a_budget_needs_a_reasoning_parser(tiny_config_path: Path) -> None:
    llm = thinking_llm(tiny_config_path, False, parser=None)
    with pytest.raises(ValueError, match="reasoning parser"):
        llm.generate("hi", SamplingParams(thinking_token_budget=4))
    assert_pool_empty(llm)


def test_a_constraint_with_a_budget_must_come_after_the_thought(tiny_config_path: Path) -> None:
    """The forced end tag would break a grammar applied from the first token: refused, unless the
    constraint holds after the thought (``after_thinking``, which chats set), where it is kept."""
    from prefixserve.sampling.structured_outputs import StructuredOutputs

    pytest.importorskip("xgrammar")
    llm = thinking_llm(tiny_config_path, False)
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": [5, 6, *tok.encode("<think>\n", add_special_tokens=False)]}
    choice = StructuredOutputs(choice=["yes", "no"])
    with pytest.raises(ValueError, match="after_thinking"):
        llm.generate(prompt, SamplingParams(thinking_token_budget=2, structured_outputs=choice))
    after = StructuredOutputs(choice=["yes", "no"], after_thinking="opened")
    out = llm.generate(
        prompt, SamplingParams(thinking_token_budget=2, max_tokens=40, structured_outputs=after)
    )
    text = out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop" and text.split("</think>")[-1].strip() in ("yes", "no")
    assert_pool_empty(llm)


def test_a_bad_word_that_is_the_end_tag_wins_over_the_budget(tiny_config_path: Path) -> None:
    """A ban of the forced token leaves the row a real choice (no all -inf row, no token 0 forever)."""
    llm = thinking_llm(tiny_config_path, False)
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": [5, 6, *tok.encode("<think>\n", add_special_tokens=False)]}
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, thinking_token_budget=0,
                            bad_words=["</think>"])  # fmt: skip
    ids = llm.generate(prompt, params)[0].outputs[0].token_ids
    end = tok.encode("</think>", add_special_tokens=False)
    assert all(ids[i : i + len(end)] != end for i in range(len(ids))) and 0 not in ids
    assert_pool_empty(llm)


# ---- the server ---------------------------------------------------------------------------------
OPENING = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant><think>\n"
ASK = [{"role": "user", "content": "why?"}]


def test_the_server_takes_the_budget(tiny_config_path: Path) -> None:
    from prefixserve.entrypoints.openai.server import ServerThread, build_app

    base = {
        "model": f"dummy:{tiny_config_path}",
        "device": "cpu",
        "num_kv_blocks": 64,
        "chat_template": OPENING,
    }
    chat = {"messages": ASK, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with (
        ServerThread(build_app(EngineConfig(**base))) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as h,
    ):
        refused = h.post("/v1/chat/completions", json={**chat, "thinking_token_budget": 3})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
    with (
        ServerThread(build_app(EngineConfig(**base, reasoning_parser="qwen3"))) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as h,
    ):
        got = h.post("/v1/chat/completions", json={**chat, "thinking_token_budget": 3})
        assert got.status_code == 200, got.text
        choice = got.json()["choices"][0]
        assert choice["message"]["reasoning_content"] and choice["message"]["content"] is not None
        end = h.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
        ids = choice["token_ids"]
        assert end in [ids[i : i + len(end)] for i in range(4)], ids  # at the budget, or the model's own
        plain = h.post("/v1/completions", json={"prompt": "<user>why?<assistant><think>\n", "max_tokens": 12,
                                                "ignore_eos": True, "thinking_token_budget": 2})  # fmt: skip
        assert plain.status_code == 200 and "</think>" in plain.json()["choices"][0]["text"]
        bad = h.post("/v1/chat/completions", json={**chat, "thinking_token_budget": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"
        messages = {"model": "default", "max_tokens": 16, "messages": ASK,
                    "thinking": {"type": "enabled", "budget_tokens": 2}}  # fmt: skip
        answer = h.post("/v1/messages", json=messages)
        assert answer.status_code == 200, answer.text
        kinds = [b["type"] for b in answer.json()["content"]]
        assert kinds[0] == "thinking" and "text" in kinds
        wrong = h.post("/v1/messages", json={**messages, "thinking": {"type": "enabled", "budget_tokens": 0}})
        assert wrong.status_code == 400 and wrong.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.gpu
def test_on_a_gpu_the_budget_holds_with_graphs_and_launch_ahead(tiny_config_path: Path) -> None:
    """CUDA, the engine's defaults (decode graphs, launch-ahead): each budgeted sample's end tag comes
    right after its budget, and the tokens equal a synchronous run's."""
    runs = []
    for async_scheduling in (True, False):
        llm = LLM(model=f"dummy:{tiny_config_path}", device="cuda", dtype="float32", num_kv_blocks=256,
                  reasoning_parser="qwen3", async_scheduling=async_scheduling, progress=False)  # fmt: skip
        tok = llm.get_tokenizer()
        end = tok.encode("</think>", add_special_tokens=False)
        prompt = {"prompt_token_ids": [5, 6, 7, *tok.encode("<think>\n", add_special_tokens=False)]}
        room = 9 + len(end) + 2  # the tag's tokens fit after the largest budget (8 in bytes)
        params = [SamplingParams(max_tokens=room, ignore_eos=True, temperature=0.0, thinking_token_budget=b)
                  for b in (0, 2, 5, 9)]  # fmt: skip
        outs = llm.generate([prompt] * len(params), params)
        for p, out in zip(params, outs, strict=True):
            ids = out.outputs[0].token_ids
            b = p.thinking_token_budget
            assert any(ids[i : i + len(end)] == end for i in range(b + 1)), (b, ids)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert_pool_empty(llm)
        llm.shutdown()
    assert runs[0] == runs[1]
