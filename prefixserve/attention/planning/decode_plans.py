"""Decode plans carried from one step to the next instead of made again.

A decode batch that only grew by one token a sequence keeps its shared segments: a block is shared by
the candidate entries (full blocks before the query token) that name it, and from one such step to the
next the candidates either stay as they were or gain, in a sequence whose last block filled up, that
block. When no other candidate names it, the gained block is private, so the segments, their holders
and their rows are the step before's; only the own parts move: each own length grows by one token,
and the block holding the query token is the own table's last entry (a new column where a block
filled). ``DecodePlans.plan`` checks exactly those conditions on the host arrays and otherwise plans
from scratch, so the plan it returns equals the fresh one field by field (``tests/test_decode_plans.py``
compares them over random decode runs with joins, leaves, forks and copy-on-write).

Planning from scratch is the largest host cost of a graphed decode step at B=256
(docs/benchmarks/host_overhead.md); the carried plan also keeps its ``derived`` values (the shared
work list and merge index of ``graph_attention.shared_graph_step``), which depend on segments alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.plan import SharedPlan, host_lens, host_tables


@dataclass(slots=True)
class _Planned:
    """The last planned decode step: its inputs, its plan, and what carrying the plan on needs."""

    tables: np.ndarray  # [S, W] the step's block tables
    seq_lens: np.ndarray  # [S] int64
    n_cand: np.ndarray  # [S] candidate entries of each row (full blocks before its query token)
    cand_count: np.ndarray  # [>= max block + 1] candidate entries naming each block
    own_n: np.ndarray  # [S] entries of each row's own table
    plan: SharedPlan


class DecodePlans:
    """One backend's plan of its last decode step, carried on while the batch only grows by a token."""

    __slots__ = ("_last", "carried", "made")

    def __init__(self) -> None:
        self._last: _Planned | None = None
        self.carried = 0  # steps whose plan was carried on (tests and benchmarks read these)
        self.made = 0  # decode steps planned from scratch

    def plan(self, meta: AttentionMetadata, make: Callable[[AttentionMetadata], SharedPlan]) -> SharedPlan:
        """``make(meta)``, or the last step's plan carried on when that equals it."""
        carried = self._carry(meta)
        if carried is not None:
            self.carried += 1
            return carried
        plan = make(meta)
        self._remember(meta, plan)
        return plan

    def _carry(self, meta: AttentionMetadata) -> SharedPlan | None:
        last = self._last
        if last is None or meta.module_rows is not None:
            return None
        seq_lens, query_lens = host_lens(meta)
        num_seqs = len(seq_lens)
        if num_seqs != len(last.seq_lens) or int(query_lens.sum()) != num_seqs:
            return None
        if not np.array_equal(seq_lens, last.seq_lens + 1):
            return None
        n_cand = (seq_lens - 1) // meta.block_size
        gained = n_cand != last.n_cand  # [S] rows whose last block filled: exactly one more candidate
        tables = host_tables(meta)
        # every candidate entry as it was (a row that gained one: its block as it was, too)
        width = min(tables.shape[1], last.tables.shape[1])
        changed = np.flatnonzero(tables[:, :width] != last.tables[:, :width])  # few: new blocks
        if changed.size and (changed % width < n_cand[changed // width]).any():
            return None
        rows = np.flatnonzero(gained)
        if rows.size:
            new = tables[rows, n_cand[rows] - 1].astype(np.intp)  # [R] the blocks that filled
            counts = last.cand_count
            known = new[new < len(counts)]
            if counts[known].any() or len(set(new.tolist())) != new.size:  # named by another candidate
                return None
            _count(last, new)
        last.tables, last.seq_lens, last.n_cand = tables, seq_lens, n_cand
        return self._carried_plan(last, tables, n_cand, gained, num_seqs)

    def _carried_plan(
        self, last: _Planned, tables: np.ndarray, n_cand: np.ndarray, gained: np.ndarray, num_seqs: int
    ) -> SharedPlan:
        """The last plan with each own part one token longer, the query block its own table's last entry."""
        prev = last.plan
        own_n = last.own_n + gained
        old = prev.own_block_tables.numpy()
        width = int(own_n.max(initial=1))
        own = np.zeros((num_seqs, width), dtype=np.int32)
        own[:, : old.shape[1]] = old
        every = np.arange(num_seqs)
        own[every, own_n - 1] = tables[every, n_cand]
        own_lens = prev.own_seq_lens.numpy() + 1
        last.own_n = own_n
        last.plan = replace(
            prev,
            own_block_tables=torch.from_numpy(own),
            own_seq_lens=torch.from_numpy(own_lens),
            own_seq_lens_host=own_lens.tolist(),
            kv_tokens_read=prev.kv_tokens_read + num_seqs,
        )
        return last.plan

    def _remember(self, meta: AttentionMetadata, plan: SharedPlan) -> None:
        """Keep a decode step's inputs and plan (a host plan: its tensors on the CPU) to carry on."""
        self._last = None
        seq_lens, query_lens = host_lens(meta)
        decode = int(query_lens.sum()) == len(seq_lens)
        if not decode or meta.module_rows is not None or plan.own_block_tables.device.type != "cpu":
            return
        self.made += 1
        bs = meta.block_size
        tables = host_tables(meta)
        n_cand = (seq_lens - 1) // bs
        candidates = tables[np.arange(tables.shape[1]) < n_cand[:, None]]
        cand_count = np.bincount(candidates.astype(np.intp), minlength=1)
        own_n = -(-plan.own_seq_lens.numpy().astype(np.int64) // bs)
        self._last = _Planned(tables, seq_lens, n_cand, cand_count, own_n, plan)


def _count(last: _Planned, blocks: np.ndarray) -> None:
    """Add candidate entries naming ``blocks`` (distinct) to the last step's counts."""
    need = int(blocks.max()) + 1
    if need > len(last.cand_count):  # doubling: new blocks keep coming with higher ids
        grown = np.zeros(max(need, 2 * len(last.cand_count)), dtype=last.cand_count.dtype)
        grown[: len(last.cand_count)] = last.cand_count
        last.cand_count = grown
    last.cand_count[blocks] += 1


__all__ = ["DecodePlans"]
