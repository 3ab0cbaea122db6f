"""What the module store keeps and hands out: encoded pieces, registered schemas, a PML prompt made
ready for a request, and the one error a request may wait out (``NoRoom``)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from prefixserve.promptcache.assemble import Piece
from prefixserve.promptcache.layout import SchemaLayout
from prefixserve.promptcache.pml import Schema
from prefixserve.promptcache.recompute import NONE, Recompute

HOLE_TOKEN = -2  # a request's token at a module block's empty row (never computed, never sampled)


class NoRoom(ValueError):
    """The KV pool has no room for pieces now (the blocks may free up; ``PromptModules._allocate``)."""


@dataclass(slots=True)
class ModuleEntry:
    """One encoded piece and where its KV is now."""

    key: str
    token_ids: list[int]
    positions: list[int]
    names: set[tuple[str, str]] = field(default_factory=set)  # (schema, piece) naming it
    blocks: list[int] | None = None  # GPU tier: blocks the store holds one reference on
    keep_on_gpu: bool = False  # registered with pin=True: never leaves the GPU tier
    # (ids, positions) as a request's table rows: HOLE_TOKEN and the last position again over the
    # last block's empty rows; ``array("q")``s made once (``PromptModules._slots``), copied per request
    slots: tuple[array, array] | None = None

    @property
    def rows(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class ModulePrompt:
    """A PML prompt made ready for a request: the module blocks it holds and its token layout."""

    token_ids: array  # array("q"): module slots (HOLE_TOKEN at holes), then the own tokens
    positions: array  # array("q")
    blocks: list[int]  # the leading module blocks, in table order (one reference held for the request)
    digests: list[bytes]  # stand-in digests of those blocks, so own blocks chain from all the pieces
    module_tokens: int  # real tokens reused from pieces
    holes: int
    recompute: Recompute = NONE
    recomputed_tokens: int = 0  # module rows computed again in this request's context
    private_rows: int = 0  # module rows in blocks this request holds alone (recomputed or copied along)
    piece_rows: list[int] = field(default_factory=list)  # real rows of each piece, in table order
    # runs (first, end) of table rows to compute in this prompt's context before its own tokens
    recompute_runs: list[tuple[int, int]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # each piece's key, in table order
    private: list[int] = field(default_factory=list)  # table indices of the blocks copied for recovery
    let_go: bool = False  # the pool had no room: ``blocks`` is empty until ``take_again`` holds them
    module_slots: int = 0  # table rows of the module blocks (holes included): the own tokens follow

    @property
    def shared_rows(self) -> int:
        """Module rows read from the blocks every request holding the piece shares."""
        return self.module_tokens - self.private_rows


@dataclass(slots=True)
class RegisteredSchema:
    schema: Schema
    layout: SchemaLayout
    text: str
    pieces: dict[str, Piece]
    recompute: Recompute | None = None  # the schema's recovery setting (None: the engine's)
    # (piece name, cache salt) -> the piece's key: hashing 5K module tokens per request cost ~4 ms of
    # host time in a Prompt Cache request's first token (issue 54). Gone with the registration.
    keys: dict[tuple[str, str | None], str] = field(default_factory=dict)


__all__ = ["HOLE_TOKEN", "ModuleEntry", "ModulePrompt", "NoRoom", "RegisteredSchema"]
