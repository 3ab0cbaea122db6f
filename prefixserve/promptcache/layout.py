"""Position IDs for a schema (Prompt Cache, section 3.3): where every module's tokens sit.

Anonymous text and modules follow one another; the members of a union all start at the union's first
position and the union spans its largest member; a parameter reserves ``len`` placeholder positions.
Because a module's positions are fixed by the schema, its KV is the same in every prompt that
imports it, which is what lets the engine store it once and share its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixserve.promptcache.pml import Module, Node, Param, PMLError, Prompt, Role, Schema, Text, Union

Tokenize = Callable[[str], list[int]]
RoleWrap = Callable[[str], tuple[str, str]]  # role -> (text before its content, text after)


@dataclass(slots=True)
class Segment:
    """A run of positions: tokenized text, or a parameter's placeholders."""

    module: str | None  # the innermost enclosing module; None: anonymous, in every prompt
    start: int
    token_ids: list[int] = field(default_factory=list)  # empty for a parameter
    param: str | None = None
    param_len: int = 0

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


def layout(schema: Schema, tokenize: Tokenize, wrap: RoleWrap | None = None) -> SchemaLayout:
    """Lay the schema out from position 0; ``wrap`` renders role tags (default: no text)."""
    out = SchemaLayout([], {}, 0)
    out.length = _place(schema.children, 0, None, tokenize, wrap, out)
    return out


def _place(
    nodes: list[Node], pos: int, module: str | None, tokenize: Tokenize, wrap: RoleWrap | None,
    out: SchemaLayout,
) -> int:
    """Place ``nodes`` from ``pos``; returns the position after them."""
    for node in nodes:
        if isinstance(node, Text):
            ids = tokenize(node.text)
            if ids:
                out.segments.append(Segment(module, pos, ids))
                pos += len(ids)
        elif isinstance(node, Param):
            out.segments.append(Segment(module, pos, [], node.name, node.length))
            pos += node.length
        elif isinstance(node, Role):
            before, after = wrap(node.role) if wrap is not None else ("", "")
            inner = [Text(before), *node.children, Text(after)]
            pos = _place(inner, pos, module, tokenize, wrap, out)
        elif isinstance(node, Module):
            start = pos
            pos = _place(node.children, pos, node.name, tokenize, wrap, out)
            out.spans[node.name] = (start, pos)
        elif isinstance(node, Union):
            end = pos
            for member in node.members:
                end = max(end, _place([member], pos, module, tokenize, wrap, out))
            pos = end
        else:  # pragma: no cover - the parser builds no other node
            raise PMLError(f"cannot lay out {type(node).__name__}")
    return pos


def check_arguments(schema: Schema, prompt: Prompt, tokenize: Tokenize) -> dict[tuple[str, str], list[int]]:
    """Each import's arguments tokenized; an argument longer than its parameter is refused."""
    lengths = {(s.module, s.param): s.param_len for s in _param_segments(schema)}
    out: dict[tuple[str, str], list[int]] = {}
    for imp in prompt.imports:
        for name, value in imp.args.items():
            ids = tokenize(value)
            limit = lengths[(imp.module, name)]
            if len(ids) > limit:
                problem = (f"argument {name!r} of <{imp.module}> is {len(ids)} tokens, over its parameter's "
                           f"length of {limit}")
                raise PMLError(problem, imp.line, imp.column)
            out[(imp.module, name)] = ids
    return out


def _param_segments(schema: Schema) -> list[Segment]:
    return [s for s in layout(schema, lambda text: []).segments if s.param is not None]


_SENTINEL = "\x00PML-CONTENT\x00"


def chat_role_wrap(tokenizer: Any) -> RoleWrap:
    """Role tags through the model's own chat template: the text it puts before and after one message.

    A message is rendered after a fixed system message and the system message alone is cut off, so
    a template that adds a default system prompt before a lone user turn adds nothing here."""
    anchor = [{"role": "system", "content": "."}]

    def render(messages: list[dict[str, str]]) -> str:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))

    wraps: dict[str, tuple[str, str]] = {}
    for role in ("system", "user", "assistant"):
        if role == "system":
            text = render([{"role": role, "content": _SENTINEL}])
        else:
            head, full = render(anchor), render([*anchor, {"role": role, "content": _SENTINEL}])
            text = full[len(head):] if full.startswith(head) else full
        before, sep, after = text.partition(_SENTINEL)
        if not sep:
            raise PMLError(f"the chat template does not render a {role} message's content")
        wraps[role] = (before, after)
    return lambda role: wraps[role]
