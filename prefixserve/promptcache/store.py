"""Prompt Cache modules: schemas registered, pieces encoded once, kept in GPU / host / disk tiers.

A piece (a module's own text, or a run of a schema's anonymous text; ``promptcache/assemble.py``) is
encoded alone at its schema positions into blocks of the KV pool, and every request that uses it
holds those very blocks at the head of its block table: nothing is copied, and the shared-segment
attention reads a piece once per step for all its holders, wherever it sits in their prompts.

Pieces start on a block boundary. A piece whose length is not a multiple of the block size leaves
the rest of its last block empty, and those rows are *holes* in every table that holds the block:
requests put ``HOLE_TOKEN`` placeholders there, and ``module_rows`` tells the attention plan how many
rows each module block holds, so it attends module blocks as segments that end where the rows do
(``attention/planning/plan.py``). Padding in storage costs under one block per piece and keeps each piece's
KV in one place, where filling each request's boundary blocks would copy a block per piece per
request and realigning a piece at other offsets would store it up to block-size times.

A piece's key is a digest of (model, dtype, cache salt, tokens, positions): equal keys mean equal KV,
so two schemas that lay out the same text at the same positions share it, and tenants with
different ``cache_salt`` never do. Where pieces live (GPU, host memory, disk) and how they move:
``promptcache/piece_tiers.py``, this class's base.

Accuracy recovery (``promptcache/recompute.py``): a request may recompute some rows of its pieces
in its own context (``link:K``, ``blend:R``). Those rows go into private copies of just the blocks
they fall in (copied at admission) and are computed in the request's first prefill step
(``ModulePrompt.recompute_runs``); the module store's blocks are never written, and every block not
copied stays shared.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.promptcache.assemble import AssembledPrompt, Piece, assemble, schema_pieces
from prefixserve.promptcache.chat import ChatFrames
from prefixserve.promptcache.digests import StandInDigests
from prefixserve.promptcache.entries import (
    HOLE_TOKEN,
    ModuleEntry,
    ModulePrompt,
    NoRoom,
    RegisteredSchema,
)
from prefixserve.promptcache.layout import layout
from prefixserve.promptcache.piece_tiers import Encode, PieceTiers
from prefixserve.promptcache.pml import PMLError, Schema, parse_prompt, parse_schema
from prefixserve.promptcache.recompute import (
    NONE,
    Recompute,
    blend_blocks,
    block_runs,
    link_runs,
    parse_recompute,
)

if TYPE_CHECKING:
    from prefixserve.sequence import HeldModules

log = logging.getLogger(__name__)

KEY_CACHE_SIZE = 4096  # (piece, salt) keys a registered schema remembers

# (token ids, positions, table blocks, runs of table rows): each row's layer-1 KV deviation, per run
Deviation = Callable[[list[int], list[int], list[int], list[tuple[int, int]]], list[np.ndarray]]


class PromptModules(PieceTiers):
    """Schemas, encoded pieces and their tiers, for one engine."""

    def __init__(
        self,
        pool: BlockPool,
        kv: KVCache,
        encode: Encode,
        tokenizer: Any,
        model_id: str,
        gpu_fraction: float = 0.5,
        host_bytes: int = 4 << 30,
        store_dir: str | Path | None = None,
        deviation: Deviation | None = None,
        default_recompute: Recompute | str | None = None,
        recompute_reserve: int = 0,
    ) -> None:
        super().__init__(pool, kv, encode, gpu_fraction, host_bytes, store_dir)
        self.tokenizer = tokenizer
        self.deviation = deviation
        self.default_recompute = parse_recompute(default_recompute)
        # free blocks a request's private copies must leave in the pool, or it runs without recovery
        self.recompute_reserve = recompute_reserve
        self.model_id = model_id
        self.schemas: dict[str, RegisteredSchema] = {}
        self._frames: ChatFrames | bool | None = False  # False: not read yet
        # (piece keys, recovery, salt) -> stand-in digests: requests over one set of pieces (one
        # document, other questions) hash the same ~320 digests per 5K module tokens otherwise
        self._digests = StandInDigests()
        self.counters.update(
            {
                "module_recomputed_tokens_total": 0,
                "module_rows_shared_total": 0,
                "module_rows_private_total": 0,
                "module_recompute_skipped_total": 0,
                "module_holds_let_go_total": 0,  # these two hold their pieces from admission on
                "module_holds_deferred_total": 0,
            }
        )

    # ---- schemas --------------------------------------------------------------------------------
    @property
    def frames(self) -> ChatFrames | None:
        """The chat template's frames, read once (role tags and chat prompts render through them)."""
        if self._frames is False:
            self._frames = ChatFrames.of(self.tokenizer)
        return self._frames  # type: ignore[return-value]

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def register(self, text: str, replace: bool = False, recompute: Recompute | str | None = None) -> Schema:
        """Parse and lay out a schema; its pieces are encoded on first use (``encode_schema`` now).

        ``recompute`` is the schema's accuracy-recovery setting (requests may override it)."""
        setting = parse_recompute(recompute) if recompute is not None else None
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot lay out PML schemas")
        if not self.kv.packs:
            raise ValueError(
                "Prompt Cache modules need every layer's KV kept in one shape: this model's sliding "
                "layers give blocks back (start with keep_sliding_kv / --keep-sliding-kv to keep them) "
                "or its layers' KV shapes differ"
            )
        schema = parse_schema(text)
        if schema.name in self.schemas and not replace:
            raise PMLError(f"schema {schema.name!r} is already registered; remove it first")
        lay = layout(schema, self._tokenize, self.frames)
        if replace and schema.name in self.schemas:
            self.unregister(schema.name)
        self.schemas[schema.name] = RegisteredSchema(schema, lay, text, schema_pieces(lay), setting)
        return schema

    def add_schema(
        self, text: str, encode: bool, pin: bool, replace: bool, recompute: Recompute | str | None
    ) -> str:
        """Register a schema; with ``encode`` its pieces are encoded now (else at first use), and
        ``pin`` keeps them on the GPU for good. A schema whose encoding fails is not kept."""
        schema = self.register(text, replace=replace, recompute=recompute)
        if encode or pin:
            try:
                self.encode_schema(schema.name, pin=pin)
            except BaseException:
                self.unregister(schema.name)
                raise
        return schema.name

    def unregister(self, name: str) -> None:
        """Forget a schema; its pieces leave the GPU tier once no request holds them."""
        if self.schemas.pop(name, None) is None:
            raise KeyError(f"unknown schema {name!r}")
        for entry in list(self.entries.values()):
            entry.names = {n for n in entry.names if n[0] != name}
            if not entry.names:
                entry.keep_on_gpu = False
                self._drop_gpu(entry)

    def encode_schema(self, name: str, cache_salt: str | None = None, pin: bool = False) -> int:
        """Encode every piece of a schema now (Prompt Cache encodes at registration); returns tokens."""
        reg = self.schemas[name]
        total = 0
        for piece in reg.pieces.values():  # one at a time: they need not all fit at once
            entry = self._entry(reg, piece, cache_salt)
            if entry.blocks is None:
                self._bring_up([entry], issue=False)  # issued below, across all of them
            entry.keep_on_gpu = entry.keep_on_gpu or pin
            total += entry.rows
        self.kv.issue_layered()
        return total

    # ---- requests -------------------------------------------------------------------------------
    def prepare(
        self,
        text: str,
        cache_salt: str | None,
        recompute: Recompute | str | None = None,
        public_tokens: int = 0,
    ) -> ModulePrompt:
        """A PML prompt's module blocks (made resident, one reference taken) and token layout.

        ``recompute`` (else the schema's setting, else the engine's) says which module rows are
        computed again in this prompt's context, into private copies of their blocks.
        ``public_tokens``: with a salt, the prompt's first rows as run that are public (the salt's
        scope, ``docs/guides/tenants.md``); where they cover every module row, the schema's pieces
        (its own text, declared by whoever registered it) are keyed and digested without the salt,
        so tenants share them; the arguments and the text after stay salted (the table's own blocks
        are digested with the request's salt)."""
        setting = parse_recompute(recompute) if recompute is not None else None
        reg, assembled = self._assemble(text)
        setting = setting or reg.recompute or self.default_recompute
        public = 0 < assembled.num_piece_tokens <= public_tokens
        mp = self._place(reg, assembled, None if public else cache_salt, setting)
        self.counters["module_recomputed_tokens_total"] += mp.recomputed_tokens
        self.counters["module_rows_shared_total"] += mp.shared_rows
        self.counters["module_rows_private_total"] += mp.private_rows
        return mp

    def layout_of(self, text: str) -> tuple[list[int], list[int]]:
        """The tokens and positions a PML prompt runs as, in table order (pieces, then its own tokens),
        without holes and without reusing anything: what full prefill of the very same prompt computes
        (the exact baseline of every approximation). Sorted by position, the ids are the prompt's text."""
        asm = self._assemble(text)[1]
        ids = [t for p in asm.pieces for t in p.token_ids] + list(asm.own_token_ids)
        pos = [q for p in asm.pieces for q in p.positions] + list(asm.own_positions)
        return ids, pos

    def _assemble(self, text: str) -> tuple[RegisteredSchema, AssembledPrompt]:
        """A PML prompt parsed against the registered schemas and assembled into pieces."""
        prompt = parse_prompt(text, {n: r.schema for n, r in self.schemas.items()})
        reg = self.schemas[prompt.schema]
        return reg, assemble(reg.schema, reg.layout, prompt, self._tokenize, self.frames, reg.pieces)

    def _place(
        self, reg: RegisteredSchema, asm: AssembledPrompt, salt: str | None, recompute: Recompute = NONE
    ) -> ModulePrompt:
        pieces, own_ids, own_pos = list(asm.pieces), list(asm.own_token_ids), list(asm.own_positions)
        if not own_ids:  # the last token must be computed for its logits: run the last piece in context
            if not pieces:
                raise PMLError("the prompt is empty")
            last = pieces.pop()
            own_ids, own_pos = list(last.token_ids), list(last.positions)
        tokens, positions = array("q"), array("q")  # the arrays a sequence keeps (never re-typed)
        blocks: list[int] = []
        entries = [self._entry(reg, piece, salt) for piece in pieces]
        try:
            self._hold(entries)  # their host-tier copies issued
            held = True
        except NoRoom:  # the pool is busy: held at admission instead (``take_again``)
            held = False
            self.counters["module_holds_deferred_total"] += 1
        holes = 0
        starts: list[int] = []  # each piece's first row in the table
        for entry in entries:
            starts.append(len(tokens))
            ids, pos = self._slots(entry)
            tokens += ids  # a copy at C speed: ~5K module rows took ~0.4 ms element by element
            positions += pos
            if held:
                assert entry.blocks is not None
                blocks += entry.blocks
            holes += len(ids) - entry.rows
            self.entries.move_to_end(entry.key)
        module_tokens = sum(e.rows for e in entries)
        module_slots = len(tokens)
        tokens.fromlist(own_ids)
        positions.fromlist(own_pos)
        mp = ModulePrompt(
            tokens,
            positions,
            blocks,
            [],
            module_tokens,
            holes,
            recompute,
            piece_rows=[e.rows for e in entries],
            keys=[e.key for e in entries],
            let_go=not held,
            module_slots=module_slots,
        )
        if recompute.kind != "none" and len(entries) > 1:
            if not held:  # as under memory pressure (``_recover``): plain Prompt Cache, not a wait
                self._skip_recovery(recompute)
            else:
                try:
                    self._recover(mp, mp.piece_rows, starts)
                except BaseException:
                    self.release(mp.blocks)
                    raise
        if not mp.recompute_runs:
            mp.recompute = NONE  # nothing recomputed: the plain Prompt Cache KV
        mp.digests = self._stand_ins(entries, mp.recompute, salt)
        return mp

    def _slots(self, entry: ModuleEntry) -> tuple[array, array]:
        """A piece's rows in a request's table: its ids and positions, then over the empty rows of its
        last block ``HOLE_TOKEN`` and its last position again (made once per entry)."""
        slots = entry.slots
        if slots is None:
            pad = -entry.rows % self.block_size
            ids = array("q", entry.token_ids + [HOLE_TOKEN] * pad)
            slots = entry.slots = (ids, array("q", entry.positions + [entry.positions[-1]] * pad))
        return slots

    def _stand_ins(self, entries: list[ModuleEntry], recompute: Recompute, salt: str | None) -> list[bytes]:
        """The stand-in digests of a table's module blocks (each piece's key and block count)."""
        return self._digests([(e.key, -(-e.rows // self.block_size)) for e in entries], recompute, salt)

    def _skip_recovery(self, setting: Recompute) -> None:
        self.counters["module_recompute_skipped_total"] += 1
        log.info("module_recompute %s skipped: %d free blocks", setting.spec, self.pool.num_free)

    # ---- accuracy recovery ----------------------------------------------------------------------
    def _recover(self, mp: ModulePrompt, rows: list[int], starts: list[int]) -> None:
        """Pick the rows ``mp.recompute`` recomputes and give their blocks private copies
        (``mp.blocks`` changes to hold them; the shared blocks they replace are let go). The rows
        are left in ``mp.recompute_runs`` for the request's first prefill step to compute."""
        bs, setting = self.block_size, mp.recompute
        if setting.kind == "link":
            runs = [(starts[i] + a, starts[i] + b) for i, a, b in link_runs(rows, setting.tokens)]
        else:
            scores: list[list[float]] = [[] for _ in rows]
            if setting.needs_deviation:
                if self.deviation is None:
                    raise ValueError("this engine cannot measure module KV deviation (blend)")
                spans = [(starts[i], starts[i] + rows[i]) for i in range(1, len(rows))]
                per_row = self.deviation(mp.token_ids, mp.positions, mp.blocks, spans)
                for i, dev in enumerate(per_row, start=1):
                    scores[i] = [float(dev[j : j + bs].mean()) for j in range(0, rows[i], bs)]
            chosen = blend_blocks(rows, scores, setting.ratio, bs)
            runs = []
            for i, picked in enumerate(chosen):
                for a, b in block_runs(picked):
                    runs.append((starts[i] + a * bs, starts[i] + min(b * bs, rows[i])))
        if not runs:
            return
        touched = sorted({r // bs for a, b in runs for r in range(a, b)})
        if self.pool.num_free - len(touched) < self.recompute_reserve:
            # The copies are held from admission to the end of the request: under memory pressure
            # they would starve running sequences, so the request runs as plain Prompt Cache (its
            # output says so: num_recomputed_tokens 0) rather than wait or be refused.
            self._skip_recovery(setting)
            return
        fresh = self._privatize(mp.blocks, touched)
        mp.private = touched
        mp.recompute_runs = runs
        mp.recomputed_tokens = sum(b - a for a, b in runs)
        mp.private_rows = sum(int(self.module_rows[b]) for b in fresh)

    def _privatize(self, blocks: list[int], touched: list[int]) -> list[int]:
        """Give ``blocks[t]`` for each t in ``touched`` a private copy (in place); returns the copies.
        The request's reference moves to its copies; the store keeps its own on the originals."""
        fresh = self.pool.allocate(len(touched))
        old = [blocks[t] for t in touched]
        try:
            self.kv.copy_blocks(list(zip(old, fresh, strict=True)))
        except BaseException:
            self.pool.release(fresh)
            raise
        for t, b, o in zip(touched, fresh, old, strict=True):
            blocks[t] = b
            self.module_rows[b] = self.module_rows[o]
            self.num_marked += 1
        self.release(old)
        return fresh

    # ---- tiers ----------------------------------------------------------------------------------
    def key_of(self, piece: Piece, salt: str | None) -> str:
        h = hashlib.blake2b(digest_size=20)
        h.update(f"{self.model_id}|{self.kv.slots[0].dtype}|{salt or ''}|".encode())
        h.update(self.kv.scheme)  # an e4m3 cache's scales (nothing for the model's dtype)
        h.update(array("q", piece.token_ids).tobytes() + b"|" + array("q", piece.positions).tobytes())
        return h.hexdigest()

    def _key(self, reg: RegisteredSchema, piece: Piece, salt: str | None) -> str:
        """``key_of`` a registered schema's piece, made once per (piece, salt)."""
        if reg.pieces.get(piece.name) is not piece:  # not the schema's own piece (never cached)
            return self.key_of(piece, salt)
        key = reg.keys.get((piece.name, salt))
        if key is None:
            if len(reg.keys) >= KEY_CACHE_SIZE:  # per-request salts must not grow it without end
                reg.keys.clear()
            key = reg.keys[(piece.name, salt)] = self.key_of(piece, salt)
        return key

    def _entry(self, reg: RegisteredSchema, piece: Piece, salt: str | None) -> ModuleEntry:
        """The piece's entry (made on first use), wherever its KV is now."""
        key = self._key(reg, piece, salt)
        entry = self.entries.get(key)
        if entry is None:
            entry = ModuleEntry(key, list(piece.token_ids), list(piece.positions))
            self.entries[key] = entry
        entry.names.add((reg.schema.name, piece.name))
        return entry

    def _hold(self, entries: list[ModuleEntry]) -> None:
        """Put the entries (in table order) on the GPU and hold each once more (for a request). Those
        on the GPU are held first, so making room for the others cannot move them out; the others come
        up together (``_bring_up``), their host-tier copies issued (layer-major across them) first."""
        missing = {e.key: e for e in entries if e.blocks is None}  # distinct, in table order
        held: list[list[int]] = []

        def hold(up: bool) -> None:
            for entry in entries:
                if (entry.key in missing) == up:
                    assert entry.blocks is not None
                    self.pool.acquire(entry.blocks)
                    held.append(entry.blocks)

        try:
            hold(up=False)
            self._bring_up(list(missing.values()))
            hold(up=True)
        except BaseException:
            for blocks in held:
                self.release(blocks)
            raise

    # ---- waiting requests' holds ----------------------------------------------------------------
    def let_go(self, held: HeldModules) -> None:
        """Drop the holds of a request no sequence of which is in a table (a stuck scheduler's head
        needs the blocks). Its layout stays; ``take_again`` holds the same pieces before it is
        admitted, and its recovery rows are computed again into fresh copies."""
        self.release(held.blocks)
        held.blocks = []
        held.let_go = True
        held.recompute_runs = list(held.runs)
        self.counters["module_holds_let_go_total"] += 1

    def drop_recovery(self, held: HeldModules, salt: str | None, computed: bool) -> None:
        """Let go of a request that fits the pool only without its recovery copies, and make it plain
        Prompt Cache (its own blocks then chain from the plain pieces' stand-in digests). ``computed``:
        it had run its recovery rows before it was preempted, so the tokens it made so far saw them
        (its count of recomputed rows stays); the rest of its answer does not."""
        if held.blocks:
            self.let_go(held)
        held.private, held.runs, held.recompute_runs = [], [], []
        held.private_rows = 0
        if not computed:
            held.recomputed_tokens = 0
        held.digests = self._stand_ins([self.entries[key] for key in held.keys], NONE, salt)
        self.counters["module_recompute_skipped_total"] += 1
        log.info("module recovery dropped: the request fits the KV pool only without its copies")

    def take_again(self, held: HeldModules) -> bool:
        """Hold a request's pieces after ``let_go`` (or an intake with no room for them), its recovery
        blocks copied afresh (none of their rows was computed: it had not started); False, holding
        nothing, if the pool has no room yet. The pieces come back by key, so a schema removed
        meanwhile costs an encode, not the request."""
        entries = [self.entries[key] for key in held.keys]
        try:
            self._hold(entries)
        except NoRoom:
            return False
        blocks = [b for entry in entries for b in entry.blocks or ()]
        if held.private:
            if self.pool.num_free < len(held.private):
                self.release(blocks)
                return False
            try:
                self._privatize(blocks, held.private)
            except BaseException:
                self.release(blocks)
                raise
        for entry in entries:
            self.entries.move_to_end(entry.key)
        held.blocks, held.let_go = blocks, False
        return True

    def list_schemas(self) -> list[dict[str, Any]]:
        out = []
        for name, reg in self.schemas.items():
            tokens = sum(len(p.token_ids) for p in reg.pieces.values())
            recompute = reg.recompute.spec if reg.recompute is not None else None
            out.append(
                {
                    "name": name,
                    "modules": sorted(reg.schema.modules),
                    "positions": reg.layout.length,
                    "pieces": len(reg.pieces),
                    "tokens": tokens,
                    "module_recompute": recompute,
                }
            )
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        out["module_blocks_gpu"] = self.gpu_blocks
        out["module_entries_host"] = len(self.host)
        out["module_store_corrupt_total"] = self.disk.corrupt if self.disk is not None else 0
        return out
