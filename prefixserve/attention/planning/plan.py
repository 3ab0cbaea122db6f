"""Shared-segment planning: which KV runs are held by several sequences of this step's batch.

The plan turns a step's block tables into two kinds of work (docs/architecture.md):
  * shared segments: a run of full KV blocks held by two or more sequences of the batch, lying wholly
    before each holder's first query token; attended once with all holders' query rows stacked;
  * own parts: each sequence's remaining blocks (its block table with the shared blocks removed,
    order kept); attended per sequence, causally, like the plain paged path.
Partial outputs are merged per query row with their log-sum-exps.

Planning is host work on every step, so it is vectorised with numpy and touches the whole [S, W]
table only twice (compare each row with the row above; list the entries that differ): the rest works
on those entries alone, about one row plus every sequence's own blocks when the batch shares a
prefix (docs/benchmarks/host_overhead.md: 0.3 ms at B=256, 4K-token prefix, on a 2-core VM; the
previous all-entries version took 0.6 ms, and 4 ms vs 1.1 ms at B=1024, 16K). No Python loop runs
over sequences, blocks or segments.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from prefixserve.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class SharedPlan:
    """Work list for one step. Tensors live on the model's device; ``*_host`` mirrors are lists.

    Segment g covers blocks ``seg_blocks[seg_block_start[g]:seg_block_start[g+1]]``
    (``seg_num_tokens[g]`` KV rows: whole blocks, but for a Prompt Cache module's partly filled
    last block) and is attended by query rows
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
    seg_num_tokens_host: list[int] = field(default_factory=list)  # [G] KV rows of each segment
    # a segment ends in a partly filled Prompt Cache module block: only the segment path is exact
    has_holes: bool = False
    # segments of one holder that hold a prefill's own cached context (``context_segments.py``), last
    context_segments: int = 0
    # values computed from the segments alone (a graphed step's shared work list and merge index),
    # kept with the plan while ``DecodePlans`` carries it on to later steps
    derived: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    # the fields above that are tensors (what moves to the device, what equality of plans compares)
    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = (
        "seg_blocks",
        "seg_block_start",
        "seg_num_tokens",
        "seg_rows",
        "seg_row_start",
        "own_block_tables",
        "own_seq_lens",
    )

    @property
    def num_segments(self) -> int:
        return len(self.seg_holders_host)

    def segment_rows_host(self, g: int) -> int:
        """Query rows stacked in segment g's attention."""
        return self.seg_row_start_host[g + 1] - self.seg_row_start_host[g]


def host_tables(meta: AttentionMetadata) -> np.ndarray:
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

    Cost: two passes over the [S, W] table (compare each row with the row above, list the entries that
    differ); everything after works on those *head* entries only. Sequences that share a prefix repeat
    the row above them, so a batch sharing a long prefix has few heads: about one row plus every
    sequence's own blocks. An entry that is not a head has the same key (block, or "not a candidate")
    as the entry above it, so the column below each head is a run of equal keys: holder counts are run
    lengths summed per block, and every distinct (entry, successor) pair of the batch starts at a head
    or just left of one.
    Assumes a block id appears at most once in a sequence's table (the paged cache's invariant).
    """
    device = meta.block_tables.device
    bs = meta.block_size
    num_seqs = meta.num_seqs
    seq_lens, query_lens = host_lens(meta)  # [S], [S] int64
    n_blocks = -(-seq_lens // bs)  # [S] table length
    n_cand = (seq_lens - query_lens) // bs  # [S] full blocks wholly before the first query token
    tables = host_tables(meta)  # [S, W] int32, zero-padded
    modules = meta.module_rows is not None  # module blocks may be in the batch (checked on heads below)
    if (num_seqs < 2 and not modules) or int(n_cand.max(initial=0)) == 0:
        return _no_sharing(meta, seq_lens, n_blocks, tables)
    heads = _head_entries(tables, n_cand)
    # holders of each block: candidate entries, the run lengths below its heads summed
    holders = np.bincount(heads.key, weights=heads.run_len, minlength=heads.nb + 1).astype(np.int64)
    holders[heads.nb] = 0
    is_shared = holders >= 2  # [nb+1]
    rows = np.zeros(heads.nb + 1, dtype=np.int64)  # [nb+1] a module block's rows, 0 otherwise
    if modules:  # every block of the batch is some head's block: look up those alone
        rows[heads.blk] = meta.module_rows[heads.blk]
        modules = bool(rows.any())
    partial = (rows > 0) & (rows < bs)  # a partly filled module block ends its segment
    # a partly filled module block is a segment even with one holder: only the segment path skips its
    # holes; a whole module block with one holder (a recovered private copy, a module one request
    # imports) is own KV like any other, one more block of that sequence's own part, not a segment of
    # its own (link:64 made five 64-token one-holder segments per request: most of the shared kernel)
    is_shared |= partial & (holders >= 1)
    if not is_shared.any():
        return _no_sharing(meta, seq_lens, n_blocks, tables)
    join, rep_next, is_start = _segment_links(heads, tables.ravel(), is_shared, holders, partial)
    seg_blocks, seg_block_start, seg_len, holder_seqs, holder_start = _segments(
        heads, tables, n_cand, (join, is_shared, rep_next, is_start)
    )
    seg_tokens = seg_len * bs  # [G] rows, less the holes of a partly filled last block
    if modules:
        last = seg_blocks[seg_block_start[1:] - 1]
        seg_tokens = seg_tokens - np.where(partial[last], bs - rows[last], 0)
    # query rows of each segment: every row of every holder, holder-major
    if len(query_lens) == int(query_lens.sum()):  # decode: one row per sequence, row = sequence
        seg_rows, seg_row_start = holder_seqs, holder_start
    else:
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)  # [S+1]
        np.cumsum(query_lens, out=qsl[1:])
        row_counts = query_lens[holder_seqs]  # [sum of holders]
        seg_rows = _ranges(qsl[holder_seqs], row_counts)
        seg_row_start = np.zeros(len(holder_start), dtype=np.int64)  # [G+1]
        np.cumsum(np.add.reduceat(row_counts, holder_start[:-1]), out=seg_row_start[1:])
    own_tables, own_n = _own_parts(heads, is_shared, tables, n_cand, n_blocks)
    own_seq_lens = seq_lens - (n_blocks - own_n) * bs  # [S]

    kv_read = int(seg_tokens.sum()) + int(own_seq_lens.sum())
    holder_list = holder_seqs.tolist()
    bounds = holder_start.tolist()
    return SharedPlan(
        seg_blocks=_to_i32(seg_blocks, device),
        seg_block_start=_to_i32(seg_block_start, device),
        seg_num_tokens=_to_i32(seg_tokens, device),
        seg_rows=_to_i32(seg_rows, device),
        seg_row_start=_to_i32(seg_row_start, device),
        own_block_tables=_to_i32(own_tables, device),
        own_seq_lens=_to_i32(own_seq_lens, device),
        seg_holders_host=[holder_list[a:b] for a, b in itertools.pairwise(bounds)],
        own_seq_lens_host=own_seq_lens.tolist(),
        kv_tokens_read=kv_read,
        seg_block_start_host=seg_block_start.tolist(),
        seg_row_start_host=list(bounds) if seg_row_start is holder_start else seg_row_start.tolist(),
        seg_num_tokens_host=seg_tokens.tolist(),
        has_holes=bool(modules and partial[seg_blocks].any()),
    )


class _Heads(NamedTuple):
    """The head entries of a step's [S, W] tables (row 0, and every entry whose block or candidate
    status differs from the entry above it), row-major, and what each one says."""

    flat: np.ndarray  # [H] index into the flattened table
    s: np.ndarray  # [H] row (sequence)
    i: np.ndarray  # [H] column (table entry)
    blk: np.ndarray  # [H] block id
    cand: np.ndarray  # [H] its row's candidate count
    is_cand: np.ndarray  # [H] bool: the entry is a candidate
    key: np.ndarray  # [H] block id, or nb for "not a candidate"
    nb: int  # the sentinel key (1 + the largest block id)
    run_len: np.ndarray  # [H] rows down to the next head of its column


def _head_entries(tables: np.ndarray, n_cand: np.ndarray) -> _Heads:
    """The heads of ``tables`` and the run of equal keys below each one.

    The last column is never a candidate (it holds a query token or padding), so every candidate
    has a successor entry.
    """
    num_seqs, width = len(n_cand), tables.shape[1]
    novel = tables[1:] != tables[:-1]  # [S-1, W]
    lo = np.minimum(n_cand[1:], n_cand[:-1])  # candidate status differs in columns [lo, hi) of row s
    hi = np.maximum(n_cand[1:], n_cand[:-1])
    if (hi > lo).any():
        novel.ravel()[_ranges(np.arange(0, (num_seqs - 1) * width, width) + lo, hi - lo)] = True
    heads = np.concatenate((np.arange(width), np.flatnonzero(novel) + width))  # [H] row-major
    head_s = heads // width
    head_i = heads - head_s * width
    head_blk = tables.ravel()[heads].astype(np.intp)
    nb = int(head_blk.max()) + 1  # the sentinel key "not a candidate" (every block value is in a head)
    head_cand = n_cand[head_s]
    is_cand = head_i < head_cand  # [H]
    key = np.where(is_cand, head_blk, nb)  # [H]

    # run length of each head: rows down to the next head of its column
    by_col = np.argsort(head_i.astype(np.uint16) if width <= 65536 else head_i, kind="stable")
    col_i = head_i[by_col]
    col_s = head_s[by_col]
    next_s = np.empty_like(col_s)
    next_s[:-1] = col_s[1:]
    next_s[np.flatnonzero(col_i[1:] != col_i[:-1])] = num_seqs  # a column's last head
    next_s[-1] = num_seqs
    run_len = np.empty_like(col_s)
    run_len[by_col] = next_s - col_s  # [H]
    return _Heads(heads, head_s, head_i, head_blk, head_cand, is_cand, key, nb, run_len)


def _segment_links(
    h: _Heads, flat: np.ndarray, is_shared: np.ndarray, holders: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(join, rep_next, is_start) over block ids: whether a block runs on into its successor (the same
    successor in every holder, as many holders, and not a block that ``ends`` a segment: a partly
    filled module block), one holder's successor, whether it starts a segment."""
    nb = h.nb
    # every distinct (candidate, successor) pair starts at a candidate head or just left of a head
    cand_heads = h.flat[h.is_cand]
    left = (h.i > 0) & (h.i <= h.cand)  # the entry left of this head is a candidate
    cur = np.concatenate((h.blk[h.is_cand], flat[h.flat[left] - 1]))
    after = np.where(h.i[h.is_cand] + 1 < h.cand[h.is_cand], flat[cand_heads + 1], nb)
    succ = np.concatenate((after, h.key[left]))

    # join[b]: b runs on into its successor (the same successor in every holder, as many holders)
    sh = is_shared[cur]
    rep_next = np.full(nb + 1, nb, dtype=np.intp)  # [nb+1]
    rep_next[cur[sh]] = succ[sh]  # one holder's successor (any one will do)
    join = is_shared & (rep_next != nb) & is_shared[rep_next] & (holders[rep_next] == holders) & ~ends
    join[cur[sh & (rep_next[cur] != succ)]] = False
    # a shared block starts a segment iff it has no predecessor or its predecessor does not run on
    is_start = np.zeros(nb + 1, dtype=bool)
    is_start[h.key[h.i == 0]] = True
    is_start[succ[~join[cur]]] = True
    is_start &= is_shared
    return join, rep_next, is_start


def _segments(
    h: _Heads, tables: np.ndarray, n_cand: np.ndarray, links: tuple[np.ndarray, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seg_blocks, seg_block_start [G+1], blocks per segment, holder rows, holder_start [G+1]).

    One start entry per (segment, holder): the runs below the heads that start a segment; a segment is
    named by its first block, its holders in batch order.
    """
    join, is_shared, rep_next, is_start = links
    flat, width = tables.ravel(), tables.shape[1]
    starts = is_start[h.key]
    start_run = h.run_len[starts]
    start_s = _ranges(h.s[starts], start_run)
    start_i = np.repeat(h.i[starts], start_run)
    start_blk = np.repeat(h.key[starts], start_run)
    order = np.lexsort((start_i, start_s, start_blk))
    sorted_blk = start_blk[order]
    new_seg = np.empty(len(order), dtype=bool)
    new_seg[0] = True
    np.not_equal(sorted_blk[1:], sorted_blk[:-1], out=new_seg[1:])
    first = np.flatnonzero(new_seg)  # [G]
    holder_seqs = start_s[order]  # [sum of holders]
    if ((holder_seqs[1:] == holder_seqs[:-1]) & ~new_seg[1:]).any():
        raise ValueError("a block appears twice in one sequence's block table")
    holder_start = np.append(first, len(order))  # [G+1]
    rep = order[first]  # a representative start entry per segment
    seg_len = _segment_lengths(flat, width, start_s[rep], start_i[rep], n_cand, join, is_shared, rep_next)
    seg_block_start = np.zeros(len(first) + 1, dtype=np.int64)  # [G+1]
    np.cumsum(seg_len, out=seg_block_start[1:])
    seg_blocks = tables[np.repeat(start_s[rep], seg_len), _ranges(start_i[rep], seg_len)]
    return seg_blocks, seg_block_start, seg_len, holder_seqs, holder_start


def _own_parts(
    h: _Heads, is_shared: np.ndarray, tables: np.ndarray, n_cand: np.ndarray, n_blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(own block tables [S, max own blocks], own blocks per sequence [S]).

    Own parts are the unshared candidates (each differs from the entry above, so it is a head; heads
    are in row-major order) followed by each table's non-candidate tail, order kept.
    """
    num_seqs = len(n_cand)
    lone = h.is_cand & ~is_shared[h.key]
    lone_s = h.s[lone]
    lone_n = np.bincount(lone_s, minlength=num_seqs)  # [S]
    tail_n = n_blocks - n_cand  # [S] >= 1
    own_n = lone_n + tail_n  # [S] own blocks
    own_tables = np.zeros((num_seqs, int(own_n.max())), dtype=np.int32)
    lone_first = np.cumsum(lone_n) - lone_n  # [S] index of each row's first lone head
    own_tables[lone_s, np.arange(len(lone_s)) - lone_first[lone_s]] = h.blk[lone]
    if len(tail_n) == int(tail_n.sum()):  # decode: each tail is the block holding the query token
        every = np.arange(num_seqs)
        own_tables[every, lone_n] = tables[every, n_cand]
    else:
        tail_s = np.repeat(np.arange(num_seqs), tail_n)
        tail_j = _ranges(np.zeros(num_seqs, dtype=np.int64), tail_n)
        own_tables[tail_s, lone_n[tail_s] + tail_j] = tables[tail_s, n_cand[tail_s] + tail_j]
    return own_tables, own_n


SCAN_SLACK = 1024  # segment lengths by scanning rows while that costs at most 4 x shared blocks + this


def _segment_lengths(
    flat: np.ndarray,
    width: int,
    rep_s: np.ndarray,
    rep_i: np.ndarray,
    n_cand: np.ndarray,
    join: np.ndarray,
    is_shared: np.ndarray,
    rep_next: np.ndarray,
) -> np.ndarray:
    """Blocks in each segment, given a holder (row ``rep_s``, column ``rep_i``) of its first block.

    A segment is its first block and the blocks its join chain runs on into, and that chain lies
    contiguous in every holder: so in the representative's row it ends at the first block, from the
    start on, that does not run on (the row's last candidate never does). Scanning those rows costs
    the candidates after each start; when that is much more than the shared blocks, pointer jumping
    along the chains (log of the longest chain passes over the shared blocks) is used instead.
    """
    span = n_cand[rep_s] - rep_i  # [G] >= 1: candidates from the start to the row's last
    shared_ids = np.flatnonzero(is_shared)  # [K]
    if int(span.sum()) <= 4 * len(shared_ids) + SCAN_SLACK:
        base = rep_s * width + rep_i  # [G] flat index of each start
        ends = np.flatnonzero(~join[flat[_ranges(base, span)]])  # scan positions that end a chain
        offsets = np.cumsum(span) - span  # [G] where each segment's scan begins
        return ends[np.searchsorted(ends, offsets)] - offsets + 1
    local = np.zeros(len(is_shared), dtype=np.intp)
    local[shared_ids] = np.arange(len(shared_ids))
    chain_next = np.where(join[shared_ids], local[rep_next[shared_ids]], np.arange(len(shared_ids)))
    run = join[shared_ids].astype(np.int64)  # [K] links to the end of the chain
    while True:
        jumped = chain_next[chain_next]
        if (jumped == chain_next).all():
            break
        run += run[chain_next]
        chain_next = jumped
    return run[local[flat[rep_s * width + rep_i]]] + 1


def fold_segments(plan: SharedPlan, fold: np.ndarray, block_size: int) -> SharedPlan:
    """The plan with the segments marked in ``fold`` [G] bool moved into their holders' own parts.

    A segment that saves little (few holders, few blocks) costs more as its own attention call and
    LSE merge than its holders spend re-reading it (CPU cascade). Folded blocks go first in each
    holder's own table: they lie before the holder's first query token, so the causal rule over the
    own part (row j sees own keys up to ``own_len - q_len + j``) still holds, and attention over a
    set of keys does not depend on their order. Only segments of whole blocks may be folded (a partly
    filled module block has holes that only the segment path skips).
    """
    fold = np.asarray(fold, dtype=bool)
    if not fold.any():
        return plan
    device = plan.own_block_tables.device
    blk_start = np.asarray(plan.seg_block_start_host, dtype=np.int64)  # [G+1]
    row_start = np.asarray(plan.seg_row_start_host, dtype=np.int64)  # [G+1]
    nblk = np.diff(blk_start)  # [G]
    n_tok = np.asarray(plan.seg_num_tokens_host, dtype=np.int64)
    if (n_tok[fold] != nblk[fold] * block_size).any():
        raise ValueError("only segments of whole blocks can be folded into own parts")
    seg_blocks = plan.seg_blocks.cpu().numpy().astype(np.int64)
    seg_rows = plan.seg_rows.cpu().numpy().astype(np.int64)
    own = plan.own_block_tables.cpu().numpy()
    own_len = np.asarray(plan.own_seq_lens_host, dtype=np.int64)  # [S]
    own_n = -(-own_len // block_size)  # [S]
    num_seqs = len(own_len)

    # (segment, holder) pairs of the folded segments, grouped by holder
    folded = np.flatnonzero(fold)
    counts = np.array([len(plan.seg_holders_host[g]) for g in folded], dtype=np.int64)
    pair_seg = np.repeat(folded, counts)
    pair_seq = np.array([s for g in folded for s in plan.seg_holders_host[g]], dtype=np.int64)
    order = np.argsort(pair_seq, kind="stable")
    pair_seg, pair_seq = pair_seg[order], pair_seq[order]
    cnt = nblk[pair_seg]  # blocks each pair adds
    extra = np.bincount(pair_seq, weights=cnt, minlength=num_seqs).astype(np.int64)  # [S]
    before = np.cumsum(cnt) - cnt  # blocks of earlier pairs (all holders)
    first_pair = np.searchsorted(pair_seq, pair_seq, side="left")
    offset = before - before[first_pair]  # where each pair's blocks start in its holder's row
    new_n = own_n + extra
    tables = np.zeros((num_seqs, int(new_n.max())), dtype=np.int64)
    tables[np.repeat(pair_seq, cnt), _ranges(offset, cnt)] = seg_blocks[_ranges(blk_start[pair_seg], cnt)]
    own_s = np.repeat(np.arange(num_seqs), own_n)
    own_j = _ranges(np.zeros(num_seqs, dtype=np.int64), own_n)
    tables[own_s, extra[own_s] + own_j] = own[own_s, own_j]
    new_len = own_len + extra * block_size

    keep = np.flatnonzero(~fold)
    k_nblk, k_rows = nblk[keep], np.diff(row_start)[keep]
    k_blk_start = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(k_nblk, out=k_blk_start[1:])
    k_row_start = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(k_rows, out=k_row_start[1:])
    k_tok = n_tok[keep]
    return SharedPlan(
        seg_blocks=_to_i32(seg_blocks[_ranges(blk_start[keep], k_nblk)], device),
        seg_block_start=_to_i32(k_blk_start, device),
        seg_num_tokens=_to_i32(k_tok, device),
        seg_rows=_to_i32(seg_rows[_ranges(row_start[keep], k_rows)], device),
        seg_row_start=_to_i32(k_row_start, device),
        own_block_tables=_to_i32(tables, device),
        own_seq_lens=_to_i32(new_len, device),
        seg_holders_host=[plan.seg_holders_host[g] for g in keep],
        own_seq_lens_host=new_len.tolist(),
        kv_tokens_read=int(k_tok.sum()) + int(new_len.sum()),
        seg_block_start_host=k_blk_start.tolist(),
        seg_row_start_host=k_row_start.tolist(),
        seg_num_tokens_host=k_tok.tolist(),
        has_holes=plan.has_holes,
    )


def _ranges(begin: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(begin[i], begin[i] + count[i])`` for all i without a Python loop."""
    ends = np.cumsum(count)
    if not len(ends):
        return np.zeros(0, dtype=np.int64)
    return np.repeat(begin - ends + count, count) + np.arange(ends[-1])


def host_lens(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """(seq_lens, query_lens) as int64 arrays: the metadata's own copies when it has them."""
    if meta.seq_lens_np is not None and meta.query_lens_np is not None:
        return meta.seq_lens_np, meta.query_lens_np
    return np.asarray(meta.seq_lens_host, dtype=np.int64), np.asarray(meta.query_lens_host, dtype=np.int64)


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
    seq_lens = host_lens(meta)[0]
    n_blocks = -(-seq_lens // meta.block_size)
    return _no_sharing(meta, seq_lens, n_blocks, host_tables(meta))
