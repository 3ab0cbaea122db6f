"""Shared-segment planning: which KV runs are held by several sequences of this step's batch.

The plan turns a step's block tables into two kinds of work (DESIGN.md, "The one idea"):
  * shared segments: a run of full KV blocks held by two or more sequences of the batch, lying wholly
    before each holder's first query token; attended once with all holders' query rows stacked;
  * own parts: each sequence's remaining blocks (its block table with the shared blocks removed,
    order kept); attended per sequence, causally, like the plain paged path.
Partial outputs are merged per query row with their log-sum-exps.

Planning is host work on every step, so it is vectorised with numpy over (sequence, table index)
pairs: per-block holder counts by ``bincount``, segment boundaries by comparing each entry with its
table neighbours. Python loops run only over segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from prefixserve.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class SharedPlan:
    """Work list for one step. Tensors live on the model's device; ``*_host`` mirrors are lists.

    Segment g covers blocks ``seg_blocks[seg_block_start[g]:seg_block_start[g+1]]`` (``seg_num_tokens[g]``
    KV rows, always whole blocks) and is attended by query rows
    ``seg_rows[seg_row_start[g]:seg_row_start[g+1]]`` (indices into the step's flat query tensor).
    Sequence s's own part is ``own_block_tables[s, :ceil(own_seq_lens[s] / block_size)]`` holding
    ``own_seq_lens[s]`` tokens; its queries are causal within it exactly as in AttentionMetadata.
    """

    seg_blocks: torch.Tensor  # [total_segment_blocks] int32
    seg_block_start: torch.Tensor  # [G+1] int32
    seg_num_tokens: torch.Tensor  # [G] int32
    seg_rows: torch.Tensor  # [total_segment_rows] int32
    seg_row_start: torch.Tensor  # [G+1] int32
    own_block_tables: torch.Tensor  # [S, max_own_blocks] int32, right-padded with 0
    own_seq_lens: torch.Tensor  # [S] int32
    seg_holders_host: list[list[int]]  # sequences (batch indices) holding each segment
    own_seq_lens_host: list[int]
    kv_tokens_read: int  # per layer: each segment once + every own part
    # host mirrors of the offsets, so per-segment loops never sync with the device
    seg_block_start_host: list[int] = field(default_factory=lambda: [0])
    seg_row_start_host: list[int] = field(default_factory=lambda: [0])

    @property
    def num_segments(self) -> int:
        return len(self.seg_holders_host)

    def segment_rows_host(self, g: int) -> int:
        """Query rows stacked in segment g's attention."""
        return self.seg_row_start_host[g + 1] - self.seg_row_start_host[g]


def _host_tables(meta: AttentionMetadata) -> np.ndarray:
    """The padded block tables on the host (the metadata's own copy: no device read)."""
    if meta.block_tables_np is not None:
        return meta.block_tables_np
    return meta.block_tables.detach().cpu().numpy()


def make_plan(meta: AttentionMetadata) -> SharedPlan:
    """Find the shared segments of a step's block tables and compact each sequence's own part.

    A table entry is a *candidate* in sequence s iff its block is full and ends at or before s's first
    query token (index i with ``(i + 1) * block_size <= seq_len - query_len``); a block is *shared* iff
    two or more candidate entries name it. Neighbouring shared blocks b1, b2 are one segment iff b2
    follows b1 in every table holding b1 and both have as many holders: together these mean equal holder
    sets and a run contiguous in every holder, without ever comparing sets. So "runs on into its
    successor" and "starts a segment" are properties of a block, not of a table entry.

    Cost: a handful of passes over the [S, W] table; the per-pair work only visits entries that differ
    from the entry above them (sequences that share a prefix repeat their neighbours' rows), so a batch
    sharing a long prefix costs little more than reading its table once.
    Assumes a block id appears at most once in a sequence's table (the paged cache's invariant).
    """
    device = meta.block_tables.device
    bs = meta.block_size
    num_seqs = meta.num_seqs
    seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)  # [S]
    query_lens = np.asarray(meta.query_lens_host, dtype=np.int64)  # [S]
    n_blocks = -(-seq_lens // bs)  # [S] table length
    n_cand = (seq_lens - query_lens) // bs  # [S] full blocks wholly before the first query token
    tables = _host_tables(meta)  # [S, W] int32, zero-padded
    width = tables.shape[1]
    if num_seqs < 2 or int(n_cand.max(initial=0)) == 0:
        return _no_sharing(meta, seq_lens, n_blocks, tables)

    # blk: candidate block ids, every other entry the sentinel `nb`. The last column is never a
    # candidate (it holds a query token or padding), so every candidate has a successor entry.
    nb = int(tables.max()) + 1
    blk = tables.astype(np.intp)  # [S, W]
    blk.ravel()[_ranges(np.arange(num_seqs) * width + n_cand, width - n_cand)] = nb
    holders = np.bincount(blk.ravel(), minlength=nb + 1)  # [nb+1] candidate entries per block
    holders[nb] = 0
    is_shared = holders >= 2  # [nb+1]
    if not is_shared.any():
        return _no_sharing(meta, seq_lens, n_blocks, tables)

    # (entry, successor) pairs that differ from the pair one row above: together they hold every
    # distinct pair of the batch, usually a small fraction of the table
    novel = np.empty((num_seqs, width), dtype=bool)  # [S, W]
    novel[0] = True
    np.not_equal(blk[1:], blk[:-1], out=novel[1:])
    novel[:, :-1] |= novel[:, 1:]  # now: the pair starting at this entry is new
    novel[:, -1] = False  # the last column starts no pair
    pair_s, pair_i = np.divmod(np.flatnonzero(novel), width)  # row-major
    cur = blk[pair_s, pair_i]
    succ = blk[pair_s, pair_i + 1]

    # join[b]: b runs on into its successor (the same successor in every holder, as many holders)
    sh = is_shared[cur]
    rep_next = np.full(nb + 1, nb, dtype=np.intp)  # [nb+1]
    rep_next[cur[sh]] = succ[sh]  # one holder's successor (any one will do)
    join = is_shared & (rep_next != nb) & (holders[rep_next] == holders)
    join[cur[sh & (rep_next[cur] != succ)]] = False
    # a shared block starts a segment iff it has no predecessor or its predecessor does not run on
    is_start = np.zeros(nb + 1, dtype=bool)
    is_start[blk[:, 0]] = True
    is_start[succ[~join[cur]]] = True
    is_start &= is_shared

    # segment lengths: pointer jumping along the join chains of the shared blocks
    shared_ids = np.flatnonzero(is_shared)  # [K]
    local = np.zeros(nb + 1, dtype=np.intp)
    local[shared_ids] = np.arange(len(shared_ids))
    chain_next = np.where(join[shared_ids], local[rep_next[shared_ids]], np.arange(len(shared_ids)))
    run = join[shared_ids].astype(np.int64)  # [K] links to the end of the chain
    while True:
        jumped = chain_next[chain_next]
        if np.array_equal(jumped, chain_next):
            break
        run += run[chain_next]
        chain_next = jumped

    # one start entry per (segment, holder); a segment is named by its first block
    start_s, start_i = np.divmod(np.flatnonzero(is_start.take(blk)), width)  # row-major: batch order
    start_blk = blk[start_s, start_i]
    order = np.argsort(start_blk, kind="stable")
    sorted_blk = start_blk[order]
    first = np.flatnonzero(np.r_[True, sorted_blk[1:] != sorted_blk[:-1]])  # [G]
    holder_start = np.r_[first, len(order)]  # [G+1]
    holder_seqs = start_s[order]  # [sum of holders]
    dup = np.flatnonzero(holder_seqs[1:] == holder_seqs[:-1]) + 1
    if np.isin(dup, first, invert=True).any():
        raise ValueError("a block appears twice in one sequence's block table")
    rep = order[first]  # a representative start entry per segment
    seg_len = run[local[sorted_blk[first]]] + 1  # [G] blocks
    seg_block_start = np.r_[0, np.cumsum(seg_len)]  # [G+1]
    seg_blocks = blk[np.repeat(start_s[rep], seg_len), _ranges(start_i[rep], seg_len)]

    # query rows of each segment: every row of every holder, holder-major
    qsl = np.r_[0, np.cumsum(query_lens)]  # [S+1]
    row_counts = query_lens[holder_seqs]  # [sum of holders]
    seg_rows = _ranges(qsl[holder_seqs], row_counts)
    seg_row_start = np.r_[0, np.cumsum(np.add.reduceat(row_counts, first))]  # [G+1]

    # own parts: unshared candidates (each differs from the entry above, so it is in the pair list)
    # followed by each table's non-candidate tail, order kept
    lone = (cur != nb) & ~is_shared[cur]
    own_s = np.r_[pair_s[lone], np.repeat(np.arange(num_seqs), n_blocks - n_cand)]
    own_i = np.r_[pair_i[lone], _ranges(n_cand, n_blocks - n_cand)]
    by_row = np.lexsort((own_i, own_s))
    own_s, own_i = own_s[by_row], own_i[by_row]
    own_n = np.bincount(own_s, minlength=num_seqs)  # [S] own blocks
    own_tables = np.zeros((num_seqs, max(int(own_n.max()), 1)), dtype=np.int64)
    own_tables[own_s, np.arange(len(own_s)) - np.repeat(np.r_[0, np.cumsum(own_n)[:-1]], own_n)] = tables[
        own_s, own_i
    ]
    own_seq_lens = seq_lens - (n_blocks - own_n) * bs  # [S]

    kv_read = int(seg_len.sum()) * bs + int(own_seq_lens.sum())
    return SharedPlan(
        seg_blocks=_to_i32(seg_blocks, device),
        seg_block_start=_to_i32(seg_block_start, device),
        seg_num_tokens=_to_i32(seg_len * bs, device),
        seg_rows=_to_i32(seg_rows, device),
        seg_row_start=_to_i32(seg_row_start, device),
        own_block_tables=_to_i32(own_tables, device),
        own_seq_lens=_to_i32(own_seq_lens, device),
        seg_holders_host=[h.tolist() for h in np.split(holder_seqs, holder_start[1:-1])],
        own_seq_lens_host=own_seq_lens.tolist(),
        kv_tokens_read=kv_read,
        seg_block_start_host=seg_block_start.tolist(),
        seg_row_start_host=seg_row_start.tolist(),
    )


def _ranges(begin: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(begin[i], begin[i] + count[i])`` for all i without a Python loop."""
    total = int(count.sum())
    offsets = np.r_[0, np.cumsum(count)[:-1]]
    return np.repeat(begin - offsets, count) + np.arange(total)


def _to_i32(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)


def _no_sharing(
    meta: AttentionMetadata, seq_lens: np.ndarray, n_blocks: np.ndarray, tables: np.ndarray
) -> SharedPlan:
    """Zero segments: every sequence's own part is its whole table."""
    device = meta.block_tables.device
    width = max(int(n_blocks.max(initial=0)), 1)
    own = np.where(np.arange(width)[None, :] < n_blocks[:, None], tables[:, :width], 0)
    empty = np.zeros(0, dtype=np.int64)
    return SharedPlan(
        seg_blocks=_to_i32(empty, device),
        seg_block_start=_to_i32(np.zeros(1), device),
        seg_num_tokens=_to_i32(empty, device),
        seg_rows=_to_i32(empty, device),
        seg_row_start=_to_i32(np.zeros(1), device),
        own_block_tables=_to_i32(own, device),
        own_seq_lens=_to_i32(seq_lens, device),
        seg_holders_host=[],
        own_seq_lens_host=seq_lens.tolist(),
        kv_tokens_read=int(seq_lens.sum()),
    )


def unshared_plan(meta: AttentionMetadata) -> SharedPlan:
    """A plan with zero segments (each own part is the whole table): the per-sequence path's work."""
    seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)
    n_blocks = -(-seq_lens // meta.block_size)
    return _no_sharing(meta, seq_lens, n_blocks, _host_tables(meta))
