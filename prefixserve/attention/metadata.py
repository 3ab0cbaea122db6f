"""What one engine step tells the attention backends.

The batch is a flat list of query tokens. Sequence ``s`` owns query rows
``query_start_loc[s]:query_start_loc[s+1]``; its KV lives in the paged cache at the blocks of
``block_tables[s]`` and holds ``seq_lens[s]`` tokens *after* this step's tokens were written.

Causality is by cache index, not by position ID (positions are data and need not be
monotone): the ``j``-th query of sequence ``s`` attends to KV indices
``0 .. seq_lens[s] - query_lens[s] + j`` inclusive.

KV cache layout of one layer: ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prefixserve.host_copy import to_device, to_device_packed


@dataclass(slots=True)
class AttentionMetadata:
    """Batch layout for one step; built once per step and shared by every layer."""

    block_size: int
    query_start_loc: torch.Tensor  # [S+1] int32 on the model's device
    seq_lens: torch.Tensor  # [S] int32: KV tokens per sequence, this step's included
    block_tables: torch.Tensor  # [S, max_blocks] int32, right-padded with 0
    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) of each new token
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # each row covers exactly ceil(seq_len / block_size) blocks (lists, or rows made on access)
    block_tables_host: SequenceABC[list[int]]
    block_tables_np: np.ndarray | None = None  # host copy of block_tables (planning reads it, no device sync)
    plan: Any = None  # backend-specific per-step plan (e.g. shared segments), made in ``prepare``
    stats: dict[str, float] = field(default_factory=dict)  # per-step counters a backend reports
    seq_lens_np: np.ndarray | None = None  # [S] int64 host copy of seq_lens_host (planning reads it)
    query_lens_np: np.ndarray | None = None  # [S] int64 host copy of query_lens_host
    # Prompt Cache modules: [num_blocks] rows each block holds if it is a module block, 0 if it is an
    # ordinary one. A module's last block may be partly filled; its empty rows are holes in every table
    # holding it, which only the shared-segment path skips (the plan makes module blocks segments).
    module_rows: np.ndarray | None = None
    # sliding-window layers' shared work of a decode step, per window (``planning/window_plan.py``), made once
    window_plans: dict[int, Any] = field(default_factory=dict)
    # the freeing KV layout (``kv/layout.py``): each sliding group's view of the step (its pages'
    # tables and write slots), and each layer's group; a group's view links back to the step's
    # (``full``), whose shared plan its window plans follow. A group's tables hold only the columns
    # its windows reach: column c of row s is block ``table_base[s] + c``
    group_metas: tuple[AttentionMetadata, ...] = ()
    layer_groups: tuple[int, ...] = ()
    full: AttentionMetadata | None = None
    table_base: torch.Tensor | None = None  # [S] int32 on the device; None: column c is block c
    table_base_np: np.ndarray | None = None  # [S] int64
    # linear-attention hybrids: the step's state slots (``model/gated_delta.LinearStep``), else None
    linear: Any = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` reads its KV through: the step's, or its sliding group's."""
        group = self.layer_groups[layer] if self.layer_groups else 0
        return self if group == 0 else self.group_metas[group - 1]

    def with_groups(self, tables: np.ndarray, base: np.ndarray, layer_groups: tuple[int, ...]) -> None:
        """Add the sliding groups' views: ``tables`` [R, S, K] their pages of each sequence's blocks
        from block ``base[s]`` on (the first its windows reach). One copy to the device for all."""
        device = self.block_tables.device
        assert self.query_lens_np is not None and self.seq_lens_np is not None
        q, s, bs = self.query_lens_np, self.seq_lens_np, self.block_size
        slots = np.stack([write_slots(t, q, s, bs, base) for t in tables])  # [R, T]
        tables_d, slots_d, base_d = to_device_packed([tables, slots, base.astype(np.int32)], device)
        n_blocks = -(-s // bs)
        self.group_metas = tuple(
            dataclasses.replace(
                self,
                block_tables=tables_d[g],
                slot_mapping=slots_d[g],
                block_tables_host=TableRows(tables[g], n_blocks, base),
                block_tables_np=tables[g],
                plan=None,
                stats={},
                window_plans={},
                full=self,
                table_base=base_d,
                table_base_np=base,
            )
            for g in range(len(tables))
        )
        self.layer_groups = layer_groups

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_seq_len(self) -> int:
        """The step's longest sequence (host data: no device read)."""
        if self.seq_lens_np is not None:
            return int(self.seq_lens_np.max(initial=0))
        return max(self.seq_lens_host, default=0)

    @property
    def is_decode_only(self) -> bool:
        if self.query_lens_np is not None:
            return int(self.query_lens_np.sum()) == len(self.query_lens_np)
        return all(q == 1 for q in self.query_lens_host)

    def logical_kv_tokens(self) -> int:
        """KV token-rows a per-sequence path reads per layer: every sequence reads its whole KV."""
        return sum(self.seq_lens_host)

    def has_module_blocks(self) -> bool:
        """Does any table of this step hold a Prompt Cache module block (and so maybe holes)?"""
        if self.module_rows is None or self.block_tables_np is None:
            return False
        return bool(self.module_rows[self.block_tables_np].any())

    def valid_kv(self, s: int) -> torch.Tensor | None:
        """[seq_len] bool: which KV indices of sequence s hold a row (False: a module block's hole)."""
        if self.module_rows is None:
            return None
        table = np.asarray(self.block_tables_host[s], dtype=np.int64)
        rows = self.module_rows[table]
        if not rows.any():
            return None
        bs = self.block_size
        fill = np.where(rows > 0, rows, bs)  # [blocks]
        valid = np.arange(bs)[None, :] < fill[:, None]  # [blocks, bs]
        return torch.from_numpy(valid.reshape(-1)[: self.seq_lens_host[s]].copy())


class TableRows(SequenceABC):
    """The rows of a padded block table as lists, each cut to its sequence's blocks, made on access.

    ``block_tables_host`` of metadata built from an array: planning and the kernels read the array;
    only per-sequence paths (the reference backend) read rows, and only those pay for the lists.
    """

    __slots__ = ("_base", "_n", "_tables")

    def __init__(self, tables: np.ndarray, n_blocks: np.ndarray, base: np.ndarray | None = None) -> None:
        self._tables = tables
        self._n = n_blocks
        self._base = base  # a group's table: row i starts at block base[i] (0 before it)

    def __len__(self) -> int:
        return len(self._n)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._base is None:
            return self._tables[i, : self._n[i]].tolist()
        first = int(self._base[i])
        return [0] * first + self._tables[i, : self._n[i] - first].tolist()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SequenceABC) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TableRows({list(self)!r})"


def build_metadata(
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]] | np.ndarray,
    device: torch.device | str,
    module_rows: np.ndarray | None = None,
) -> AttentionMetadata:
    """Make device tensors (and the write slots of the new tokens) from host lists.

    ``block_tables`` is one list of blocks per sequence (each covering at least its ``seq_len``
    tokens), or a 2-d integer array whose row s holds sequence s's blocks in its first
    ``ceil(seq_lens[s] / block_size)`` columns and 0 after them (``BlockManager.block_tables_np``
    keeps one). The array is the fast form: turning a batch's lists into an array costs ~20 ns per
    entry (1-2 ms a step at B=256 with 4K-token sequences), while an array is used as it is.
    Vectorised with numpy: at B=256 with 4K-token sequences a Python loop here cost 7-31 ms a step.
    """
    num_seqs = len(seq_lens)
    if not (len(query_lens) == len(block_tables) == num_seqs):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    bad = np.flatnonzero((q < 1) | (q > s))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"query length {query_lens[i]} must be in [1, seq_len={seq_lens[i]}]")
    if isinstance(block_tables, np.ndarray):
        tables, host_rows = _array_tables(block_tables, s, block_size)
    else:
        tables = _list_tables(block_tables, s, block_size)
        host_rows = block_tables
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q, out=starts[1:])
    slots = write_slots(tables, q, s, block_size)
    host = [starts.astype(np.int32), s.astype(np.int32), tables, slots]
    if torch.device(device).type == "cuda":  # one copy for the four
        starts_d, seq_lens_d, tables_d, slots_d = to_device_packed(host, device)
    else:
        starts_d, seq_lens_d, tables_d, slots_d = (to_device(a, device) for a in host)
    return AttentionMetadata(
        block_size=block_size,
        query_start_loc=starts_d,
        seq_lens=seq_lens_d,
        block_tables=tables_d,
        slot_mapping=slots_d,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        block_tables_host=host_rows,
        block_tables_np=tables,
        seq_lens_np=s,
        query_lens_np=q,
        module_rows=module_rows,
    )


def write_slots(
    tables: np.ndarray, q: np.ndarray, s: np.ndarray, block_size: int, base: np.ndarray | None = None
) -> np.ndarray:
    """[T] int64 write slots of the new tokens: token j of sequence i sits at cache index
    ``seq_len - q_len + j`` (a decode step: one token each, at ``seq_len - 1``); ``base``: row i's
    first column is block ``base[i]``."""
    num_seqs, num_tokens = len(s), int(q.sum())
    if num_tokens == num_seqs:
        index = s - 1
        column = index // block_size - (base if base is not None else 0)
        slots = tables[np.arange(num_seqs), column].astype(np.int64) * block_size
        return slots + index % block_size
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q, out=starts[1:])
    owner = np.repeat(np.arange(num_seqs), q)
    index = (s - q)[owner] + np.arange(num_tokens) - starts[owner]
    column = index // block_size - (base[owner] if base is not None else 0)
    return tables[owner, column].astype(np.int64) * block_size + index % block_size


def _list_tables(block_tables: list[list[int]], s: np.ndarray, block_size: int) -> np.ndarray:
    """[S, width] int32 zero-padded table from one list per sequence (width: the longest list)."""
    num_seqs = len(block_tables)
    n_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
    short = np.flatnonzero(n_blocks * block_size < s)
    if short.size:
        i = int(short[0])
        raise ValueError(f"block table of {n_blocks[i]} blocks cannot hold {int(s[i])} tokens")
    width = max(int(n_blocks.max(initial=0)), 1)
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(n_blocks.sum()))
    tables = np.zeros((num_seqs, width), dtype=np.int32)
    tables[np.arange(width) < n_blocks[:, None]] = flat  # row-major: the lists one after the other
    return tables


def _array_tables(block_tables: np.ndarray, s: np.ndarray, block_size: int) -> tuple[np.ndarray, TableRows]:
    """The array form: checked, cut to the widest sequence's blocks, int32 contiguous (no copy if so)."""
    n_blocks = -(-s // block_size)
    width = max(int(n_blocks.max(initial=0)), 1)
    if block_tables.ndim != 2 or block_tables.shape[0] != len(s) or block_tables.shape[1] < width:
        raise ValueError(
            f"block table array of shape {block_tables.shape} cannot hold {len(s)} sequences of up to "
            f"{width} blocks"
        )
    tables = np.ascontiguousarray(block_tables[:, :width], dtype=np.int32)
    return tables, TableRows(tables, n_blocks)
