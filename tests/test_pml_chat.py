"""Prompt Cache with chat models: role turns in prompts, the generation prompt, PML in chat.

The rules under test: a schema or prompt with role tags renders through the model's chat template as
``apply_chat_template`` renders the same conversation (checked token for token, on the default
model's template and on a Llama-3-style one written here); free text becomes a user turn; the prompt
ends with the generation prompt unless its last turn is an unfinished ``<assistant>`` turn; a chat
whose first message is a ``<prompt>`` document runs over the schema's modules with its later messages
as turns; whitespace between modules takes no KV block; bad role nesting is refused by line and column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.promptcache.assemble import assemble, schema_pieces
from prefixserve.promptcache.chat import ChatFrames, chat_prompt
from prefixserve.promptcache.layout import layout
from prefixserve.promptcache.pml import PMLError, Turn, parse_prompt, parse_schema

ROLE_NAMES = ("system", "user", "assistant")
TAGS = ChatFrames(  # a stand-in template: [role]content[/role], "[bos]" opening the conversation
    before={r: f"[{r}]" for r in ROLE_NAMES},
    after={r: f"[/{r}]" for r in ROLE_NAMES},
    first_before={r: f"[bos][{r}]" for r in ROLE_NAMES},
    generation="[assistant]",
)

# A schema shaped like the paper's travel schema: a system turn, a user turn holding modules, a union
# and a parameter, and an assistant exemplar; the question comes in the prompt.
TRAVEL = """<schema name="travel">
  <system>You are a travel planner. Answer in one short paragraph.</system>
  <user><module name="trip">I am planning a trip of<param name="days" len="4"/> days.</module><union
  ><module name="overseas"> I am going abroad.</module><module name="domestic"> I stay home.</module></union
  ><module name="tokyo"> I will visit Tokyo.</module><module name="food"> I love noodles and fish.</module
  ></user>
  <assistant>Great, tell me what you would like to know.</assistant>
</schema>"""
TRAVEL_TURNS = [
    {"role": "system", "content": "You are a travel planner. Answer in one short paragraph."},
    {
        "role": "user",
        "content": "I am planning a trip of five days. I am going abroad. I will visit Tokyo. "
        "I love noodles and fish.",
    },
    {"role": "assistant", "content": "Great, tell me what you would like to know."},
]
TRAVEL_PROMPT = (
    '<prompt schema="travel"><trip days=" five"/><overseas/><tokyo/><food/>What should I eat?</prompt>'
)

LLAMA3_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def _text(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def rendered_ids(schema_text: str, prompt_text: str, tokenize: Any, frames: ChatFrames | None) -> list[int]:
    """The prompt's token ids in position order (pieces and its own tokens), as the engine lays them."""
    schema = parse_schema(schema_text)
    lay = layout(schema, tokenize, frames)
    asm = assemble(schema, lay, parse_prompt(prompt_text, {schema.name: schema}), tokenize, frames)
    pairs = [(q, t) for p in asm.pieces for q, t in zip(p.positions, p.token_ids, strict=True)]
    pairs += zip(asm.own_positions, asm.own_token_ids, strict=True)
    positions = [q for q, _ in pairs]
    assert len(set(positions)) == len(positions), "two tokens at one position"
    return [t for _, t in sorted(pairs)]


# ---- the rules, with a stand-in template (pure Python) -------------------------------------------
def test_free_text_after_a_chat_schema_is_a_user_turn_then_the_generation_prompt() -> None:
    schema = '<schema name="s"><system>Be brief.</system><user><module name="m">Doc.</module></user></schema>'
    got = _text(rendered_ids(schema, '<prompt schema="s"><m/> Why? </prompt>', _chars, TAGS))
    assert got == "[bos][system]Be brief.[/system][user]Doc.[/user][user]Why?[/user][assistant]"


def test_role_tags_in_a_prompt_and_an_unfinished_assistant_turn() -> None:
    schema = '<schema name="s"><system>Be brief.</system><module name="m">Doc.</module></schema>'
    prompt = (
        '<prompt schema="s"><m/><user>Hi</user><assistant>Hello</assistant>Go on'
        "<assistant>Sure, </assistant></prompt>"
    )
    got = _text(rendered_ids(schema, prompt, _chars, TAGS))
    # the last turn is continued: no end-of-turn, no generation prompt, its trailing space kept
    assert got.endswith("[user]Hi[/user][assistant]Hello[/assistant][user]Go on[/user][assistant]Sure, ")
    ended = prompt.replace("<assistant>Sure, </assistant>", "")
    assert _text(rendered_ids(schema, ended, _chars, TAGS)).endswith("[user]Go on[/user][assistant]")


def test_a_schema_without_roles_keeps_bare_free_text_but_prompt_turns_open_the_conversation() -> None:
    schema = '<schema name="s">Facts. <module name="m">Doc.</module></schema>'
    bare = _text(rendered_ids(schema, '<prompt schema="s"><m/> Why?</prompt>', _chars, TAGS))
    assert bare == "Facts. Doc. Why?"
    turn = _text(rendered_ids(schema, '<prompt schema="s"><m/><user>Why?</user></prompt>', _chars, TAGS))
    assert turn == "Facts. Doc.[bos][user]Why?[/user][assistant]"
    # without a chat template role tags add no text: turns read as free text
    assert _text(rendered_ids(schema, '<prompt schema="s"><m/><user>Why?</user></prompt>', _chars, None)) == (
        "Facts. Doc.Why?"
    )


def test_whitespace_between_modules_is_no_piece_but_the_prompts_own_tokens() -> None:
    schema = parse_schema(
        '<schema name="s"><module name="a">A.</module>\n\n<module name="b">B.</module>\n</schema>'
    )
    lay = layout(schema, _chars)
    assert sorted(schema_pieces(lay)) == ["a", "b"]  # no block for "\n\n" or the trailing "\n"
    asm = assemble(schema, lay, parse_prompt('<prompt schema="s"><a/><b/>?</prompt>', {"s": schema}), _chars)
    assert _text(asm.own_token_ids) == "\n\n\n?"
    assert asm.own_positions == [2, 3, 6, 7]  # the runs at their schema positions, then the question
    # a prompt with no text of its own still ends on the schema's last position, computed in context
    bare = assemble(schema, lay, parse_prompt('<prompt schema="s"><a/></prompt>', {"s": schema}), _chars)
    assert bare.own_positions[-1] == lay.length - 1 and [p.name for p in bare.pieces] == ["a"]


@pytest.mark.parametrize(
    ("doc", "needle", "line", "column"),
    [
        ('<prompt schema="s"><m>\n<user>Hi</user></m></prompt>', "<user> inside the import of <m>", 2, 1),
        ('<prompt schema="s"><m/><user>Hi <m/></user></prompt>', "<m> inside a <user> turn", 1, 33),
        ('<prompt schema="s"><m/>\n  <tool>Hi</tool></prompt>', "unknown module <tool>", 2, 3),
        ('<prompt schema="s"><user role="x">Hi</user></prompt>', "takes no attributes", 1, 20),
    ],
)
def test_bad_role_nesting_names_line_and_column(doc: str, needle: str, line: int, column: int) -> None:
    schema = parse_schema('<schema name="s"><module name="m">Doc.</module></schema>')
    with pytest.raises(PMLError, match=needle) as err:
        parse_prompt(doc, {"s": schema})
    assert (err.value.line, err.value.column) == (line, column)


def test_role_names_are_no_module_names() -> None:
    with pytest.raises(PMLError, match="role tag's name"):
        parse_schema('<schema name="s"><module name="user">x</module></schema>')


def test_a_chat_opening_with_a_prompt_document_becomes_one_prompt() -> None:
    doc = '<prompt schema="s"><m/></prompt>'
    chat = [
        {"role": "system", "content": doc},
        {"role": "user", "content": "a < b & c"},
        {"role": "assistant", "content": "yes"},
        {"role": "developer", "content": "Be kind."},
    ]
    text = chat_prompt(chat)
    assert text == (
        '<prompt schema="s"><m/><user>a &lt; b &amp; c</user><assistant>yes</assistant>'
        "<system>Be kind.</system></prompt>"
    )
    schema = parse_schema('<schema name="s"><module name="m">Doc.</module></schema>')
    items = parse_prompt(text, {"s": schema}).items
    assert [i.role for i in items if isinstance(i, Turn)] == ["user", "assistant", "system"]
    self_closed = [{"role": "user", "content": '<prompt schema="s"/>'}, {"role": "user", "content": "x"}]
    assert chat_prompt(self_closed) == '<prompt schema="s"><user>x</user></prompt>'
    assert chat_prompt([{"role": "user", "content": "plain"}]) is None
    with pytest.raises(PMLError, match="only the conversation's first message"):
        chat_prompt([{"role": "user", "content": doc}, {"role": "user", "content": doc}])


# ---- real templates: token for token against apply_chat_template ---------------------------------
@pytest.fixture(scope="module")
def smollm_tokenizer() -> Any:
    from prefixserve.model.loader import tokenizer_for

    return tokenizer_for(None, progress=False)[1]


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Llama-3-style template and special tokens, written as a tokenizer config and loaded back."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("llama3-tokenizer")
    smollm_tokenizer.save_pretrained(str(directory))
    import json

    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = LLAMA3_TEMPLATE
    config_path.write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(str(directory))
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    return tok


def _ids(encoded: Any) -> list[int]:
    """apply_chat_template's ids (a list, or a BatchEncoding in newer transformers)."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _encoder(tokenizer: Any) -> Any:
    return lambda text: tokenizer.encode(text, add_special_tokens=False) if text else []


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm_tokenizer", "llama3_tokenizer"])
def test_rendered_tokens_equal_apply_chat_template(which: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(which)
    frames = ChatFrames.of(tok)
    question = {"role": "user", "content": "What should I eat?"}
    as_turns = "<user>What should I eat?</user><assistant>Try</assistant>"
    turns = TRAVEL_PROMPT.replace("What should I eat?", as_turns)
    cases = [
        (TRAVEL_PROMPT, [*TRAVEL_TURNS, question], False),
        (turns, [*TRAVEL_TURNS, question, {"role": "assistant", "content": "Try"}], True),
    ]
    for prompt, conversation, open_end in cases:
        want = tok.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=not open_end, continue_final_message=open_end
        )
        want = _ids(want)
        got = rendered_ids(TRAVEL, prompt, _encoder(tok), frames)
        assert tok.decode(got) == tok.decode(want)
        assert got == want
    # a schema opening with a user turn: the template's default system turn (SmolLM2) or BOS comes first
    schema = '<schema name="s"><user><module name="m">Doc.</module></user></schema>'
    want = tok.apply_chat_template(
        [{"role": "user", "content": "Doc."}, {"role": "user", "content": "Q?"}],
        tokenize=True,
        add_generation_prompt=True,
    )
    want = _ids(want)
    assert rendered_ids(schema, '<prompt schema="s"><m/>Q?</prompt>', _encoder(tok), frames) == want


# ---- end to end on the default model -----------------------------------------------------------
DOC_SCHEMA = """<schema name="museum"><module name="doc">
<system>You answer questions about the document.</system>
<user>The museum opens at nine and closes at five. Tickets cost twelve euros; children enter free.</user>
</module></schema>"""
DOC_CHAT = [
    {"role": "system", "content": "You answer questions about the document."},
    {
        "role": "user",
        "content": "The museum opens at nine and closes at five. Tickets cost twelve euros; "
        "children enter free.",
    },
]


@pytest.fixture(scope="module")
def chat_llm() -> LLM:
    """The default model for the end-to-end tests, one engine: each registers a schema of its own."""
    return LLM(dtype="float32", device="cpu", num_kv_blocks=256, progress=False)


@pytest.mark.slow
def test_plain_prefix_chat_schema_gives_llm_chats_greedy_tokens(default_llm: LLM, chat_llm: LLM) -> None:
    llm = chat_llm
    llm.register_schema(DOC_SCHEMA)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    question = {"role": "user", "content": "When does the museum close?"}
    want = default_llm.chat([*DOC_CHAT, question], params)[0]
    as_pml = llm.generate(
        '<prompt schema="museum"><doc/><user>When does the museum close?</user></prompt>', params
    )[0]
    as_chat = llm.chat(
        [{"role": "system", "content": '<prompt schema="museum"><doc/></prompt>'}, question], params
    )[0]
    for got in (as_pml, as_chat):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text.strip()
        assert got.num_cached_tokens > 0
    assert as_chat.prompt_token_ids == want.prompt_token_ids  # one module, one piece: no holes shown


@pytest.mark.slow
def test_chat_shaped_schema_answers_with_text_and_reuses_modules(chat_llm: LLM) -> None:
    llm = chat_llm
    llm.register_schema(TRAVEL)
    params = SamplingParams(max_tokens=6, temperature=0.0, n=2, seed=1)
    first = llm.generate(TRAVEL_PROMPT, params)[0]
    again = llm.chat(
        [
            {"role": "user", "content": TRAVEL_PROMPT.replace("What should I eat?", "")},
            {"role": "user", "content": "What should I eat?"},
        ],
        params,
    )[0]
    for out in (first, again):
        assert out.outputs[0].text.strip() and out.outputs[0].token_ids[0] != llm.get_tokenizer().eos_token_id
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == first.num_cached_tokens > 0
    with pytest.raises(PMLError, match="inside the import of <tokyo>"):
        llm.generate('<prompt schema="travel"><tokyo><user>Hi</user></tokyo></prompt>', params)
    assert llm.generate(TRAVEL_PROMPT, params)[0].outputs[0].text.strip()  # still serving
