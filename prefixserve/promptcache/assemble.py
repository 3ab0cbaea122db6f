"""A PML prompt as the engine runs it (Prompt Cache, section 3.4): reused module pieces + own tokens.

Each module the prompt uses (its imports and their enclosing modules, ``pml.closure``) is one piece:
the module's own text at the positions the schema gives it, without its parameters' placeholders and
without its nested modules (each of those is a piece of its own). Anonymous text of the schema is
in every prompt: each run of it between modules is a piece too, named ``#<start position>``. A
piece's KV depends on nothing but its tokens and positions, so it is computed once and shared by
every prompt that uses it, wherever it sits in the prompt.

What is left is the prompt's own part, computed for each request over all its pieces: every
argument at its parameter's first positions, then the prompt's free text, in document order, from
the first position after the schema's modules that the prompt uses. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.promptcache.layout import SchemaLayout, Tokenize, check_arguments
from prefixserve.promptcache.pml import PMLError, Prompt, Schema, Text, closure


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
    own_token_ids: list[int]  # arguments, then free text
    own_positions: list[int]

    @property
    def num_piece_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.pieces)


def schema_pieces(layout: SchemaLayout) -> dict[str, Piece]:
    """Every piece the schema can contribute, by name: each module's own text, each anonymous run."""
    pieces: dict[str, Piece] = {}
    anon: Piece | None = None
    for seg in layout.segments:
        if seg.module is None and seg.param is None:
            if anon is None or anon.positions[-1] + 1 != seg.start:
                anon = pieces.setdefault(f"#{seg.start}", Piece(f"#{seg.start}"))
            anon.token_ids += seg.token_ids
            anon.positions += list(seg.positions)
            continue
        anon = None  # a module (or a parameter) ends the anonymous run
        if seg.param is None:
            piece = pieces.setdefault(seg.module, Piece(seg.module))
            piece.token_ids += seg.token_ids
            piece.positions += list(seg.positions)
    return {name: p for name, p in pieces.items() if p.token_ids}


def assemble(schema: Schema, layout: SchemaLayout, prompt: Prompt, tokenize: Tokenize) -> AssembledPrompt:
    """The pieces ``prompt`` reuses and its own tokens, each token at its schema position."""
    if prompt.schema != schema.name:
        raise PMLError(f"prompt is for schema {prompt.schema!r}, not {schema.name!r}")
    used = set(closure(schema, prompt))
    pieces = [p for name, p in schema_pieces(layout).items() if name.startswith("#") or name in used]
    pieces.sort(key=lambda p: p.positions[0])
    end = max((p.positions[-1] + 1 for p in pieces), default=0)
    for name in used:
        end = max(end, layout.spans[name][1])
    own_ids: list[int] = []
    own_pos: list[int] = []
    args = check_arguments(schema, prompt, tokenize)
    starts = {(s.module, s.param): s.start for s in layout.segments if s.param is not None}
    for key, ids in sorted(args.items(), key=lambda kv: starts[kv[0]]):
        own_ids += ids
        own_pos += range(starts[key], starts[key] + len(ids))
    for item in prompt.items:
        if isinstance(item, Text):
            ids = tokenize(item.text)
            own_ids += ids
            own_pos += range(end, end + len(ids))
            end += len(ids)
    return AssembledPrompt(schema.name, pieces, own_ids, own_pos)
