"""A prefill's cached context as a segment of one holder: its many query rows over that context on the
shared-segment kernels' tensor-core tiles instead of the paged kernel's.

A sequence that prefills tens to hundreds of query rows behind thousands of cached tokens (a question
over a prefix-cache hit, a Prompt Cache prompt over its modules, a chunk of a long prompt) is a tall
product: its rows times the GQA group, stacked per KV head, against every context key. The paged kernel
walks that context through the block table a 64-row query tile at a time, at about a third of the
tensor cores' rate (docs/kernels.md §2.14); the shared-segment kernels were built for exactly this
shape, many stacked rows over one run of blocks, read by TMA on Hopper. So where ``ContextRule`` says
it pays, the whole blocks that lie before the sequence's first query token and are still in its own
part (no other sequence of the step holds them) become a segment whose one holder is the sequence;
the rest of its own part (the block holding its first query token and after) stays on the paged
kernel, causal as before, and the LSE merge joins the two as it joins any segment's partials. The
context is cut into runs of consecutive cache blocks, a segment each, so that every one is read by TMA
(a document prefilled at once lies in one run; Prompt Cache modules in one run each).

This is a pass over a finished plan (``make_plan``, after any folding), so segments of several holders
are planned exactly as before; only own parts change. Attention over a set of keys does not depend on
how they are cut, so the result equals the per-sequence one up to fp32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.plan import SharedPlan, _ranges, _to_i32, host_lens


@dataclass(frozen=True, slots=True)
class ContextRule:
    """Which sequences of a step take their own cached context as one-holder segments."""

    # The defaults are where whole requests measured faster (first token of a document of C cached
    # tokens plus R new ones, the 8B shape on an H200, bf16 and e4m3 caches; docs/kernels.md §2.16):
    # every R x C of 2M or more, 64-512 rows over 4K-32K tokens, 1.04-1.64x; from 1M to 2M 0.91-1.07x,
    # below 1M 0.76-1.02x (the eager prefill's three launches a layer cost more than the products save).
    min_rows: int = 64  # query rows of the sequence in this step
    min_tokens: int = 4096  # context tokens in whole blocks before the first query token
    min_work: int = 2_000_000  # query rows x those context tokens
    # tokens of every run of consecutive cache blocks in that context: each run is a segment of its
    # own, so the shared kernels read it by TMA; a context cut finer stays on the paged kernel
    min_run: int = 512

    def sequences(self, meta: AttentionMetadata) -> np.ndarray:
        """[S] bool: the sequences whose rows and context qualify (block counts only; the plan says
        which of those blocks are still in the own part, ``with_context_segments`` how they lie)."""
        seq_lens, query_lens = host_lens(meta)
        return self.takes(query_lens, (seq_lens - query_lens) // meta.block_size * meta.block_size)

    def takes(self, rows: np.ndarray, context: np.ndarray) -> np.ndarray:
        return (rows >= self.min_rows) & (context >= self.min_tokens) & (rows * context >= self.min_work)


def _runs(own: np.ndarray, seqs: np.ndarray, moved: np.ndarray, min_blocks: int):
    """The first ``moved[i]`` own blocks of each sequence ``seqs[i]``, cut into runs of consecutive
    block ids, less every sequence with a run shorter than ``min_blocks``: (their blocks, concatenated;
    each run's length; the sequence holding each run; whether each of ``seqs`` is kept)."""
    blocks = own[np.repeat(seqs, moved), _ranges(np.zeros(len(seqs), dtype=np.int64), moved)]
    owner = np.repeat(np.arange(len(seqs)), moved)
    starts = np.ones(len(blocks), dtype=bool)
    starts[1:] = (blocks[1:] != blocks[:-1] + 1) | (owner[1:] != owner[:-1])
    run_len = np.diff(np.append(np.flatnonzero(starts), len(blocks)))
    run_owner = owner[starts]
    kept = np.ones(len(seqs), dtype=bool)
    kept[run_owner[run_len < min_blocks]] = False
    return blocks[kept[owner]], run_len[kept[run_owner]], seqs[run_owner[kept[run_owner]]], kept


def with_context_segments(plan: SharedPlan, meta: AttentionMetadata, rule: ContextRule) -> SharedPlan:
    """``plan`` with each qualifying sequence's own whole context blocks moved into segments held by
    it alone, one a run of consecutive cache blocks (appended after the plan's segments); ``plan``
    itself when no sequence qualifies."""
    bs = meta.block_size
    seq_lens, query_lens = host_lens(meta)
    own_len = np.asarray(plan.own_seq_lens_host, dtype=np.int64)  # [S]
    tail = -(-seq_lens // bs) - (seq_lens - query_lens) // bs  # [S] blocks from the first query token on
    own_n = -(-own_len // bs)  # [S]
    lone = own_n - tail  # [S] own blocks wholly before the first query token (listed first)
    take = rule.takes(query_lens, lone * bs)
    if not take.any():
        return plan
    own = plan.own_block_tables.cpu().numpy().astype(np.int64)
    seqs = np.flatnonzero(take)
    new_blocks, run_len, run_seq, kept = _runs(own, seqs, lone[seqs], -(-rule.min_run // bs))
    if not kept.any():
        return plan
    take[seqs[~kept]] = False  # run_seq: [R] the sequence holding each new segment
    shift = np.where(take, lone, 0)  # [S] columns each own row loses
    keep_n = own_n - shift
    tables = np.zeros((len(own_len), max(int(keep_n.max()), 1)), dtype=np.int64)
    rows_s = np.repeat(np.arange(len(own_len)), keep_n)
    cols = _ranges(np.zeros(len(own_len), dtype=np.int64), keep_n)
    tables[rows_s, cols] = own[rows_s, cols + shift[rows_s]]
    new_own_len = own_len - shift * bs

    qsl = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    new_rows = _ranges(qsl[run_seq], query_lens[run_seq])
    blk_start = np.asarray(plan.seg_block_start_host, dtype=np.int64)
    row_start = np.asarray(plan.seg_row_start_host, dtype=np.int64)
    seg_blocks = np.concatenate([plan.seg_blocks.cpu().numpy().astype(np.int64), new_blocks])
    seg_rows = np.concatenate([plan.seg_rows.cpu().numpy().astype(np.int64), new_rows])
    blk_start = np.concatenate([blk_start, blk_start[-1] + np.cumsum(run_len)])
    row_start = np.concatenate([row_start, row_start[-1] + np.cumsum(query_lens[run_seq])])
    seg_tokens = [*plan.seg_num_tokens_host, *(run_len * bs).tolist()]
    device = plan.own_block_tables.device
    return SharedPlan(
        seg_blocks=_to_i32(seg_blocks, device),
        seg_block_start=_to_i32(blk_start, device),
        seg_num_tokens=_to_i32(np.asarray(seg_tokens, dtype=np.int64), device),
        seg_rows=_to_i32(seg_rows, device),
        seg_row_start=_to_i32(row_start, device),
        own_block_tables=_to_i32(tables, device),
        own_seq_lens=_to_i32(new_own_len, device),
        seg_holders_host=[*plan.seg_holders_host, *([int(s)] for s in run_seq)],
        own_seq_lens_host=new_own_len.tolist(),
        kv_tokens_read=plan.kv_tokens_read,
        seg_block_start_host=blk_start.tolist(),
        seg_row_start_host=row_start.tolist(),
        seg_num_tokens_host=seg_tokens,
        has_holes=plan.has_holes,
        context_segments=plan.context_segments + len(run_seq),
    )


__all__ = ["ContextRule", "with_context_segments"]
