"""Position IDs for a schema (Prompt Cache, section 3.3): where every module's tokens sit.

Anonymous text and modules follow one another; the members of a union all start at the union's first
position and the union spans its largest member; a parameter reserves ``len`` placeholder positions.
Because a module's positions are fixed by the schema, its KV is the same in every prompt that
imports it, which is what lets the engine store it once and share its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prefixserve.promptcache.chat import ChatFrames
from prefixserve.promptcache.pml import Module, Node, Param, PMLError, Prompt, Role, Schema, Text, Union

Tokenize = Callable[[str], list[int]]


@dataclass(slots=True)
class Segment:
    """A run of positions: tokenized text, or a parameter's placeholders."""

    module: str | None  # the innermost enclosing module; None: anonymous, in every prompt
    start: int
    token_ids: list[int] = field(default_factory=list)  # empty for a parameter
    param: str | None = None
    param_len: int = 0
    filler: bool = False  # whitespace only (between modules): computed with each prompt, not stored

    @property
    def length(self) -> int:
        return self.param_len if self.param is not None else len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.length)


@dataclass(slots=True)
class SchemaLayout:
    segments: list[Segment]
    spans: dict[str, tuple[int, int]]  # module -> [start, end) of its positions
    length: int  # positions the whole schema spans
    chat: bool = False  # the schema has role tags, rendered through the chat template


@dataclass(slots=True)
class _Placing:
    tokenize: Tokenize
    frames: ChatFrames | None
    out: SchemaLayout
    first_role: Role | None = None  # the turn that opens the conversation (first in document order)


def layout(schema: Schema, tokenize: Tokenize, frames: ChatFrames | None = None) -> SchemaLayout:
    """Lay the schema out from position 0; ``frames`` render role tags (None: they add no text).

    In a schema with role tags, whitespace outside the turns is layout, not text: the template alone
    separates turns, so the schema renders as ``apply_chat_template`` renders its conversation."""
    out = SchemaLayout([], {}, 0, chat=schema.has_roles)
    ctx = _Placing(tokenize, frames, out, _first_role(schema.children))
    out.length = _place(schema.children, 0, None, ctx, in_role=False)
    return out


def _first_role(nodes: list[Node]) -> Role | None:
    for node in nodes:
        if isinstance(node, Role):
            return node
        inner = node.children if isinstance(node, Module) else node.members if isinstance(node, Union) else []
        found = _first_role(list(inner))
        if found is not None:
            return found
    return None


def _place(nodes: list[Node], pos: int, module: str | None, ctx: _Placing, in_role: bool) -> int:
    """Place ``nodes`` from ``pos``; returns the position after them."""
    out = ctx.out
    for node, inside in _flatten(nodes, ctx, in_role):
        if isinstance(node, Text):
            ids = ctx.tokenize(node.text)
            if ids:
                out.segments.append(Segment(module, pos, ids, filler=not node.text.strip()))
                pos += len(ids)
        elif isinstance(node, Param):
            out.segments.append(Segment(module, pos, [], node.name, node.length))
            pos += node.length
        elif isinstance(node, Module):
            start = pos
            pos = _place(node.children, pos, node.name, ctx, inside)
            out.spans[node.name] = (start, pos)
        elif isinstance(node, Union):
            end = pos
            for member in node.members:
                end = max(end, _place([member], pos, module, ctx, inside))
            pos = end
        else:  # pragma: no cover - the parser builds no other node
            raise PMLError(f"cannot lay out {type(node).__name__}")
    return pos


def _flatten(nodes: list[Node], ctx: _Placing, in_role: bool) -> list[tuple[Node, bool]]:
    """``nodes`` with each role tag opened into the template's text around its children, whitespace
    outside turns dropped in a chat schema, and neighbouring texts joined: each run of text is
    tokenized whole, as the template's rendering of the same conversation is (no token boundary
    where one tag ends and the next begins). Each node comes with whether it sits inside a turn."""
    opened: list[tuple[Node, bool]] = []
    for node in nodes:
        if isinstance(node, Text) and ctx.out.chat and not in_role and not node.text.strip():
            continue
        if isinstance(node, Role):
            opened += ((child, True) for child in _role_nodes(node, ctx))
        else:
            opened.append((node, in_role))
    joined: list[tuple[Node, bool]] = []
    for node, inside in opened:
        if isinstance(node, Text) and joined and isinstance(joined[-1][0], Text):
            joined[-1] = (Text(joined[-1][0].text + node.text), inside or joined[-1][1])  # type: ignore[union-attr]
        else:
            joined.append((node, inside))
    return joined


def _role_nodes(role: Role, ctx: _Placing) -> list[Node]:
    """A turn: the template's text before it, its content stripped at the edges, the text after."""
    children = list(role.children)
    if children and isinstance(children[0], Text):
        children[0] = Text(children[0].text.lstrip())
    if children and isinstance(children[-1], Text):
        children[-1] = Text(children[-1].text.rstrip())
    if ctx.frames is None:
        return children
    before, _, after = ctx.frames.message(role.role, "", first=role is ctx.first_role)
    return [Text(before), *children, Text(after)]


def check_arguments(
    schema: Schema, prompt: Prompt, tokenize: Tokenize, laid: SchemaLayout | None = None
) -> dict[tuple[str, str], list[int]]:
    """Each import's arguments tokenized; an argument longer than its parameter is refused.

    ``laid``: the schema's layout, if made already (laying the schema out again per request cost a
    millisecond in a Prompt Cache request's first token, issue 54)."""
    if not any(imp.args for imp in prompt.imports):
        return {}
    segments = laid.segments if laid is not None else _param_segments(schema)
    lengths = {(s.module, s.param): s.param_len for s in segments if s.param is not None}
    out: dict[tuple[str, str], list[int]] = {}
    for imp in prompt.imports:
        for name, value in imp.args.items():
            ids = tokenize(value)
            limit = lengths[(imp.module, name)]
            if len(ids) > limit:
                problem = (
                    f"argument {name!r} of <{imp.module}> is {len(ids)} tokens, over its parameter's "
                    f"length of {limit}"
                )
                raise PMLError(problem, imp.line, imp.column)
            out[(imp.module, name)] = ids
    return out


def _param_segments(schema: Schema) -> list[Segment]:
    return [s for s in layout(schema, lambda text: []).segments if s.param is not None]
