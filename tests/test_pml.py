"""PML (Prompt Cache's markup): schemas, prompts, layout positions, errors with line and column,
hostile documents refused quickly, and a fuzz test (no crash, no hang)."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.promptcache.chat import ChatFrames
from prefixserve.promptcache.layout import check_arguments, layout
from prefixserve.promptcache.pml import (
    MAX_DEPTH,
    Module,
    Param,
    PMLError,
    Role,
    Text,
    Union,
    closure,
    parse_prompt,
    parse_schema,
)

TRAVEL = """<schema name="travel">
  <system>You are a travel agent.</system>
  <module name="trip-plan">Plan a trip of <param name="duration" len="4"/>.</module>
  <union>
    <module name="domestic">In the country.</module>
    <module name="overseas">Abroad, with a passport.
      <union>
        <module name="tokyo">Tokyo in spring.</module>
        <module name="paris">Paris in autumn, with a long description.</module>
      </union>
    </module>
  </union>
  <user>Question follows.</user>
</schema>"""


ROLE_NAMES = ("system", "user", "assistant")
TAG_FRAMES = ChatFrames(  # a stand-in template: <role>content</role>, "<open>" before the first message
    before={r: f"<{r}>" for r in ROLE_NAMES},
    after={r: f"</{r}>" for r in ROLE_NAMES},
    first_before={r: f"<open><{r}>" for r in ROLE_NAMES},
    generation="<assistant>",
)


def _chars(text: str) -> list[int]:
    """A stand-in tokenizer: one token per non-space character (positions are easy to check)."""
    return [ord(c) for c in text if not c.isspace()]


def _words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


@pytest.fixture()
def travel():
    return parse_schema(TRAVEL)


def test_schema_constructs(travel):
    assert travel.name == "travel"
    assert list(travel.modules) == ["trip-plan", "domestic", "overseas", "tokyo", "paris"]
    assert travel.parent == {
        "trip-plan": None,
        "domestic": None,
        "overseas": None,
        "tokyo": "overseas",
        "paris": "overseas",
    }
    assert travel.union_of["domestic"] == travel.union_of["overseas"] != travel.union_of["tokyo"]
    assert travel.union_of["tokyo"] == travel.union_of["paris"]
    kinds = [type(n) for n in travel.children if not (isinstance(n, Text) and not n.text.strip())]
    assert kinds == [Role, Module, Union, Role]
    plan = travel.modules["trip-plan"]
    assert [type(n) for n in plan.children] == [Text, Param, Text]
    assert plan.children[1] == Param("duration", 4, 3, 43)
    # <parameter> and length= are accepted too
    alt = parse_schema(
        '<schema name="s"><module name="m">a <parameter name="p" length="2"/></module></schema>'
    )
    assert alt.modules["m"].children[1].length == 2


def test_layout_positions(travel):
    lay = layout(travel, _chars)
    system = len(_chars("You are a travel agent."))
    plan_start = system
    plan_len = len(_chars("Plan a trip of")) + 4 + len(_chars("."))
    assert lay.spans["trip-plan"] == (plan_start, plan_start + plan_len)
    union_start = plan_start + plan_len
    # members of a union start together; the union spans its largest member
    assert lay.spans["domestic"][0] == lay.spans["overseas"][0] == union_start
    inner = union_start + len(_chars("Abroad, with a passport."))
    assert lay.spans["tokyo"][0] == lay.spans["paris"][0] == inner
    assert lay.spans["overseas"][1] == lay.spans["paris"][1] > lay.spans["tokyo"][1]
    assert lay.length == lay.spans["overseas"][1] + len(_chars("Question follows."))
    params = [s for s in lay.segments if s.param is not None]
    assert [(s.module, s.param, s.start, s.length) for s in params] == [
        ("trip-plan", "duration", plan_start + len(_chars("Plan a trip of")), 4)
    ]
    # role tags render through the wrapper (the chat template's text around a message)
    wrapped = layout(travel, _chars, TAG_FRAMES)
    assert wrapped.length == lay.length + len(_chars("<open><system></system><user></user>"))


def test_prompt_imports_nesting_and_closure(travel):
    schemas = {"travel": travel}
    doc = '<prompt schema="travel"><trip-plan duration="3 days"/><overseas><tokyo/></overseas> Day one?'
    p = parse_prompt(doc + "</prompt>", schemas)
    assert [i.module for i in p.imports] == ["trip-plan", "overseas", "tokyo"]
    assert p.items[-1] == Text(" Day one?")
    assert closure(travel, p) == ["trip-plan", "overseas", "tokyo"]
    flat = parse_prompt('<prompt schema="travel"><tokyo/>Only Tokyo.</prompt>', schemas)
    assert closure(travel, flat) == ["overseas", "tokyo"]  # the enclosing module comes along
    args = check_arguments(travel, p, _words)
    assert args == {("trip-plan", "duration"): [1, 4]}


@pytest.mark.parametrize(
    ("doc", "needle", "line", "column"),
    [
        ('<prompt schema="travel"><domestic/><tokyo/></prompt>', "members of one union", 1, 36),
        ('<prompt schema="travel"><tokyo/><paris/></prompt>', "members of one union", 1, 33),
        ('<prompt schema="travel"><nope/></prompt>', "unknown module <nope>", 1, 25),
        ('<prompt schema="x"/>', "unknown schema 'x'", 1, 1),
        ('<prompt schema="travel">\n  <trip-plan days="3"/></prompt>', "no parameter 'days'", 2, 3),
        ('<prompt schema="travel"><trip-plan/><trip-plan/></prompt>', "imported twice", 1, 37),
        ('<prompt schema="travel"><domestic><tokyo/></domestic></prompt>', "not a module of", 1, 35),
        ('<prompt schema="travel"><domestic>text</domestic></prompt>', "holds text", 1, 25),
        ('<prompt schema="travel"><trip-plan>', "malformed XML", 1, 36),
        ("<schema/>", "expected a <prompt>", 1, 1),
    ],
)
def test_prompt_errors_name_line_and_column(travel, doc, needle, line, column):
    with pytest.raises(PMLError, match=needle) as info:
        parse_prompt(doc, {"travel": travel})
    assert (info.value.line, info.value.column) == (line, column)


def test_argument_longer_than_its_parameter(travel):
    p = parse_prompt(
        '<prompt schema="travel"><trip-plan duration="one two three four five"/></prompt>', {"travel": travel}
    )
    with pytest.raises(PMLError, match="5 tokens, over its parameter's length of 4"):
        check_arguments(travel, p, _words)


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ('<schema name="s"><module name="a"/><module name="a"/></schema>', "defined twice"),
        ('<schema name="s"><param name="p" len="3"/></schema>', "must be inside a <module>"),
        ('<schema name="s"><module name="m"><param name="p"/></module></schema>', "needs len"),
        ('<schema name="s"><module name="m"><param name="p" len="0"/></module></schema>', "needs len"),
        (
            '<schema name="s"><module name="m"><param name="p" len="2"/><param name="p" len="2"/></module>'
            "</schema>",
            "two parameters",
        ),
        ('<schema name="s"><union>text<module name="a"/></union></schema>', "only <module>"),
        ('<schema name="s"><union><param name="p" len="1"/></union></schema>', "only <module>"),
        ('<schema name="s"><union></union></schema>', "empty <union>"),
        ('<schema name="s"><user><system>x</system></user></schema>', "inside another role"),
        ('<schema name="s"><widget/></schema>', "unknown element <widget>"),
        ('<schema name="s"><module>x</module></schema>', "needs a name"),
        ('<schema name="bad name"/>', "not a valid name"),
        ("<schema/>", "needs a name"),
        ('<prompt schema="s"/>', "expected a <schema>"),
        ("<schema name='s'><module name='m'>", "malformed XML"),
        ("", "malformed XML"),
    ],
)
def test_schema_errors(doc, needle):
    with pytest.raises(PMLError, match=needle) as info:
        parse_schema(doc)
    assert "line" in str(info.value) or "refused" in str(info.value) or info.value.line is None


def test_hostile_documents_are_refused_quickly():
    laughs = '<!DOCTYPE s [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]>'
    cases = [
        laughs + '<schema name="s">&b;</schema>',  # entity expansion
        '<!DOCTYPE s SYSTEM "file:///etc/passwd"><schema name="s"/>',  # external reference
        '<schema name="s"><module name="m" x="' + "a" * 70_000 + '"/></schema>',  # huge attribute
        '<schema name="s">' + "<user>" * (MAX_DEPTH + 5) + "</user>" * (MAX_DEPTH + 5) + "</schema>",  # deep
        '<schema name="s">' + "x" * (5 * 1024 * 1024) + "</schema>",  # huge document
    ]
    for doc in cases:
        started = time.perf_counter()
        with pytest.raises(PMLError):
            parse_schema(doc)
        assert time.perf_counter() - started < 2.0


_PIECES = [*"<>/=\"' abmnorsu-&;!\n", "schema", "module", "union", "param", "name", "len"]
_xmlish = st.sampled_from(_PIECES)


@settings(max_examples=300, deadline=None)
@given(st.lists(_xmlish, max_size=30).map("".join))
def test_fuzz_parser_never_crashes(doc):
    for parse in (parse_schema, lambda d: parse_prompt(d, {"s": parse_schema('<schema name="s"/>')})):
        with contextlib.suppress(PMLError):
            parse(doc)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_any_text(doc):
    with contextlib.suppress(PMLError):
        parse_schema(doc)
