"""A PML prompt as the engine runs it (Prompt Cache, section 3.4): reused module pieces + own tokens.

Each module the prompt uses (its imports and their enclosing modules, ``pml.closure``) is one piece:
the module's own text at the positions the schema gives it, without its parameters' placeholders and
without its nested modules (each of those is a piece of its own). Anonymous text of the schema is
in every prompt: each run of it between modules is a piece too, named ``#<start position>``. A
piece's KV depends on nothing but its tokens and positions, so it is computed once and shared by
every prompt that uses it, wherever it sits in the prompt. A run of anonymous whitespace alone (the
newline between two modules) is no piece: a piece takes whole KV blocks, so it is computed with each
prompt instead, at its schema positions.

What is left is the prompt's own part, computed for each request over all its pieces: every
argument at its parameter's first positions and the schema's whitespace runs, then the prompt's
text, from the first position after the schema's modules that the prompt uses. In a chat (the
schema or the prompt has role tags) that text is turns through the chat template: free text is a
user turn, and the prompt ends with the generation prompt unless its last turn is an unfinished
``<assistant>`` turn, which the model continues. Otherwise free text goes as written. The own
part's last token is the prompt's last position (its logits start generation). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.promptcache.chat import ChatFrames
from prefixserve.promptcache.layout import SchemaLayout, Segment, Tokenize, check_arguments
from prefixserve.promptcache.pml import Import, PMLError, Prompt, Schema, Text, Turn, closure


@dataclass(slots=True)
class Piece:
    """One reusable run of a schema: a module's own text, or a run of anonymous text."""

    name: str  # the module's name, or "#<start>" for anonymous text
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


@dataclass(slots=True)
class AssembledPrompt:
    schema: str
    pieces: list[Piece]  # in position order
    own_token_ids: list[int]  # arguments and whitespace runs in position order, then the prompt's text
    own_positions: list[int]

    @property
    def num_piece_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.pieces)


def _anonymous_runs(layout: SchemaLayout) -> list[list[Segment]]:
    """Runs of anonymous text segments that follow one another with no module or parameter between."""
    runs: list[list[Segment]] = []
    open_run: list[Segment] | None = None
    for seg in layout.segments:
        if seg.module is None and seg.param is None:
            if open_run is None or open_run[-1].start + open_run[-1].length != seg.start:
                open_run = []
                runs.append(open_run)
            open_run.append(seg)
        else:
            open_run = None  # a module (or a parameter) ends the anonymous run
    return runs


def schema_pieces(layout: SchemaLayout) -> dict[str, Piece]:
    """Every piece the schema can contribute, by name: each module's own text, each anonymous run
    that is more than whitespace."""
    pieces: dict[str, Piece] = {}
    for run in _anonymous_runs(layout):
        if all(seg.filler for seg in run):
            continue
        piece = pieces.setdefault(f"#{run[0].start}", Piece(f"#{run[0].start}"))
        for seg in run:
            piece.token_ids += seg.token_ids
            piece.positions += list(seg.positions)
    for seg in layout.segments:
        if seg.module is not None and seg.param is None:
            piece = pieces.setdefault(seg.module, Piece(seg.module))
            piece.token_ids += seg.token_ids
            piece.positions += list(seg.positions)
    ordered = sorted((p for p in pieces.values() if p.token_ids), key=lambda p: p.positions[0])
    return {p.name: p for p in ordered}


def schema_fillers(layout: SchemaLayout) -> list[Segment]:
    """The anonymous whitespace runs that are no piece: every prompt computes them itself."""
    return [seg for run in _anonymous_runs(layout) if all(s.filler for s in run) for seg in run]


def assemble(
    schema: Schema,
    layout: SchemaLayout,
    prompt: Prompt,
    tokenize: Tokenize,
    frames: ChatFrames | None = None,
    all_pieces: dict[str, Piece] | None = None,
) -> AssembledPrompt:
    """The pieces ``prompt`` reuses and its own tokens, each token at its schema position.

    ``all_pieces``: ``schema_pieces(layout)`` made once per schema (a registered schema keeps them:
    rebuilding them per request copied every module's token list); they are read, never changed."""
    if prompt.schema != schema.name:
        raise PMLError(f"prompt is for schema {prompt.schema!r}, not {schema.name!r}")
    used = set(closure(schema, prompt))
    if all_pieces is None:
        all_pieces = schema_pieces(layout)
    pieces = [p for name, p in all_pieces.items() if name.startswith("#") or name in used]
    end = max((p.positions[-1] + 1 for p in pieces), default=0)
    for name in used:
        end = max(end, layout.spans[name][1])
    placed: list[tuple[int, int]] = []  # (position, token) of arguments and whitespace runs
    args = check_arguments(schema, prompt, tokenize, layout)
    starts = {(s.module, s.param): s.start for s in layout.segments if s.param is not None}
    for key, ids in args.items():
        placed += zip(range(starts[key], starts[key] + len(ids)), ids, strict=True)
    for seg in schema_fillers(layout):
        placed += zip(seg.positions, seg.token_ids, strict=True)
        end = max(end, seg.start + seg.length)
    if frames is not None and (layout.chat or prompt.has_turns):
        text_ids = tokenize(_chat_text(prompt, layout.chat, frames))
    else:  # no chat template: turns are text as written, like free text
        text_ids = [t for item in prompt.items if not isinstance(item, Import) for t in tokenize(item.text)]
    if not text_ids and pieces:
        i = max(range(len(pieces)), key=lambda k: pieces[k].positions[-1])
        if pieces[i].positions[-1] > max((p for p, _ in placed), default=-1):
            last = pieces.pop(i)  # the prompt's last position is computed in context: its logits
            placed += zip(last.positions, last.token_ids, strict=True)
    placed.sort(key=lambda pt: pt[0])
    own_ids = [t for _, t in placed] + text_ids
    own_pos = [p for p, _ in placed] + list(range(end, end + len(text_ids)))
    return AssembledPrompt(schema.name, pieces, own_ids, own_pos)


def _chat_text(prompt: Prompt, schema_has_turns: bool, frames: ChatFrames) -> str:
    """The prompt's turns through the chat template: free text (between imports too) gathered into
    user turns, an unfinished final assistant turn left open, else the generation prompt."""
    turns: list[tuple[str, str]] = []
    free = ""
    for item in prompt.items:
        if isinstance(item, Text):
            free += item.text
        elif isinstance(item, Turn):
            if free.strip():
                turns.append(("user", free.strip()))
            free = ""
            turns.append((item.role, item.text))
    if free.strip():
        turns.append(("user", free.strip()))
    open_end = bool(turns) and turns[-1][0] == "assistant"
    parts: list[str] = []
    for i, (role, text) in enumerate(turns):
        last = i == len(turns) - 1
        content = text.lstrip() if last and open_end else text.strip()  # a continuation keeps its spaces
        first = i == 0 and not schema_has_turns
        parts += frames.message(role, content, first=first, open_end=last and open_end)
    if not open_end:
        parts.append(frames.generation)
    return "".join(parts)
