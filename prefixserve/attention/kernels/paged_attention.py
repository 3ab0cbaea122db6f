"""Paged attention (decode, prefill chunks, mixed) with GQA packing and split-KV, plus its torch reference.

One program owns (sequence, query tile, KV head, KV split). Its M rows are ``BLOCK_M // G`` query tokens
x the ``G = q_heads / kv_heads`` query heads that read one KV head, so each KV tile is loaded once for
the whole group (M is padded to >= 16 for ``tl.dot``). Long sequences are cut into KV splits
(flash-decoding) whose partials go to an fp32 buffer and are merged by ``merge.py``.

Causality follows ``AttentionMetadata``: the j-th new query of sequence s sees KV indices
``0 .. seq_lens[s] - query_lens[s] + j``. Scores are fp32, the softmax runs in base 2 with log2(e)
folded into the scale, and the LSE is returned in natural log; a row that sees no key gets o = 0 and
lse = -inf (true -inf, guarded so that it never produces NaN).
"""

from __future__ import annotations

import math

import torch

from prefixserve.attention.kernels.attend import attend_range, attend_range_ahead, finish_rows, widened_q
from prefixserve.attention.kernels.merge import merge_last, merge_partials
from prefixserve.attention.kernels.packed_decode import launch_packed_decode
from prefixserve.attention.planning.e4m3_walks import e4m3_walks, e4m3_wave_splits, register_cap
from prefixserve.attention.planning.tiles import (
    LOG2E,
    MIN_BLOCK_N,
    check_cache,
    dot_precision,
    fit_tiles,
    interpreter_upcast,
    launch_fitting,
    num_sms,
    smem_limit,
)
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.launch import Launch

triton, tl = require_triton()

Merged = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]  # (out, out_lse, counts)
MERGED_OUT = 25  # ``_paged_kernel``'s out_ptr: the output a merged launch writes (relaunched per layer)


@triton.jit
def paged_program(
    pid,  # sequence x query tile
    kvh,
    split,
    num_splits,
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    bt_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    qsl_ptr,  # [S+1] int32
    o_ptr,  # split 0 of [splits, T, Hq, D] (or the final [T, Hq, D] when there is one split)
    lse_ptr,  # split 0 of [splits, T, Hq]
    qk_scale,
    q_tiles,
    split_size,  # KV tokens per split; 0: each sequence's KV cut evenly into num_splits
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    PAGES_AHEAD: tl.constexpr = 0,  # > 0: a split's block ids (at most this many) read before its walk
    WALKS: tl.constexpr = 0,  # an e4m3 decode walk's form (``e4m3_walks``); 0: ``attend.E4M3_WALKS``
):
    # a Triton kernel body: one program's query tile over its KV split, kept in one piece
    """One program of the paged kernel: (sequence query tile, KV head, KV split) -> o, lse rows."""
    seq = pid // q_tiles
    q0 = (pid % q_tiles) * (BLOCK_M // GROUP)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # KV tokens before this step's first query

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        qi = q0 + offs_m // GROUP  # query index within the sequence
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < (BLOCK_M // GROUP) * GROUP) & (qi < q_len)
        tok = (q_start + qi).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        q = widened_q(q, k_ptr)
        limit = ctx + qi + 1
        # split_size == 0 sizes the splits per sequence from its own length (no host scalar): what a
        # captured CUDA graph needs, since the graph keeps its launch arguments while lengths grow
        even = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        split_size = tl.where(split_size > 0, split_size, even)
        kv_lo = split * split_size
        kv_hi = tl.minimum(kv_lo + split_size, ctx + tl.minimum(q0 + BLOCK_M // GROUP, q_len))

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        k_base, v_base = k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh
        table = bt_ptr + seq.to(tl.int64) * stride_bt
        if PAGES_AHEAD > 0:
            m_i, l_i, acc = attend_range_ahead(
                q, m_i, l_i, acc, k_base, v_base, table, kv_lo, kv_hi, limit, qk_scale, stride_kb,
                stride_kt, stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST,
                PAGES_AHEAD,
            )  # fmt: skip
        else:
            m_i, l_i, acc = attend_range(
                q, m_i, l_i, acc, k_base, v_base, table, kv_lo, kv_hi, limit, qk_scale, stride_kb,
                stride_kt, stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, WALKS=WALKS,
            )  # fmt: skip
        o, lse = finish_rows(m_i, l_i, acc)
        split64 = split.to(tl.int64)
        o_rows = o_ptr + split64 * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            o_rows + offs_d[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
        tl.store(lse_ptr + split64 * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


# per-step values, not specialised on (docs/kernels.md §2.9); a decode step's one query tile is the
# constexpr ONE_TILE instead: q_tiles == 1 folded in measured 14% faster at B=64
@triton.jit(do_not_specialize=["q_tiles", "split_size", "stride_bt"])
def _paged_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,
    q_tiles,
    split_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    out_ptr,  # MERGE: the final [T, Hq, D]
    out_lse_ptr,  # MERGE and WANT_LSE: the final [T, Hq] fp32
    count_ptr,  # MERGE: [S * Hkv] int32 zeros, each back at zero after its merge
    stride_out_t,
    stride_out_h,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    ONE_TILE: tl.constexpr = False,  # q_tiles == 1 (every decode step)
    MERGE: tl.constexpr = False,  # a decode step's splits merged by the last of them to finish
    BLOCK_G: tl.constexpr = 16,  # MERGE: GROUP rounded up to a power of two
    WANT_LSE: tl.constexpr = False,
    MERGE_UNROLL: tl.constexpr = 8,  # MERGE: splits a merge turn loads together
    PAGES_AHEAD: tl.constexpr = 0,
    WALKS: tl.constexpr = 0,
):
    """Grid (sequences x query tiles, KV heads, KV splits); arguments as ``paged_program``'s, and with
    ``MERGE`` (decode steps: one query a sequence) the merge of the splits' partials (``merge_last``)."""
    if ONE_TILE:
        q_tiles = 1
    paged_program(
        tl.program_id(0),
        tl.program_id(1),
        tl.program_id(2),
        tl.num_programs(2),
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        seq_lens_ptr,
        qsl_ptr,
        o_ptr,
        lse_ptr,
        qk_scale,
        q_tiles,
        split_size,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        GROUP,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_SIZE,
        DOT_PREC,
        UPCAST,
        PAGES_AHEAD,
        WALKS,
    )
    if MERGE:
        merge_last(
            qsl_ptr, o_ptr, lse_ptr, out_ptr, out_lse_ptr, count_ptr,
            stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_out_t, stride_out_h,
            GROUP, BLOCK_G, HEAD_DIM, WANT_LSE, MERGE_UNROLL,
        )  # fmt: skip


# splits a merge turn loads together (``merge_last``); measured on an H200 at B=1: docs/kernels.md §6
MERGE_UNROLL = 8
# the most block ids a program reads before its walk (``attend_range_ahead``; 0: each tile loads its own),
# and the pipeline depth that walk runs at: measured on an H200 at B=1, docs/kernels.md §6
PAGES_AHEAD, AHEAD_STAGES = 256, 3

BALANCE_CHUNK = 1024  # a prefill step of few programs: no KV split longer than this (0: off)


def choose_split(
    max_kv: int,
    base_programs: int,
    device: torch.device,
    block_n: int,
    min_chunk: int = 256,
    prefill: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """(num_splits, split_size): enough KV splits that ~2 waves of programs cover the SMs; a decode
    step over an e4m3 cache (``kv_dtype``) whose splits can be cut into walks: one wave of those
    (``e4m3_wave_splits``).

    ``prefill``: the step's sequences have many query rows, so a program's time is its KV length, and
    with few programs (a Prompt Cache first token recomputing the heads of ten modules: 320) the
    longest sequence's programs run alone at the end; cutting every sequence's KV into chunks of at
    most ``BALANCE_CHUNK`` keeps the programs even.
    """
    if max_kv <= 0:
        return 1, block_n
    sms = num_sms(device)
    e4m3_decode = kv_dtype == torch.float8_e4m3fn and not prefill
    splits = e4m3_wave_splits(max_kv, base_programs, sms) if e4m3_decode else 0
    if not splits:
        want = max(1, math.ceil(2 * sms / max(1, base_programs)))
        if prefill and BALANCE_CHUNK and base_programs <= 4 * sms:
            want = max(want, math.ceil(max_kv / BALANCE_CHUNK))
        splits = max(1, min(want, math.ceil(max_kv / min_chunk), 64))
    split_size = math.ceil(math.ceil(max_kv / splits) / block_n) * block_n
    return math.ceil(max_kv / split_size), split_size


def walk_pages(
    split_size: int, num_splits: int, width: int, block_size: int, block_n: int, limit: int
) -> int:
    """Block ids a program of the paged kernel reads before its walk (a power of two covering the
    blocks its KV run can span), or 0 where that is more than ``limit``: then each tile loads its own.

    A run starts at a multiple of its length: ``split_size``, or, where that is 0 (a graph's splits
    sized per sequence in the kernel), a multiple of the tile width the launch ends up with, which
    ``fit_tiles`` or the out-of-resources retry may narrow below ``block_n`` down to ``MIN_BLOCK_N``
    (a narrower tile only shortens the run, bounded here by the table's width, but may start it
    inside a block: one block more), or ``block_n`` itself where a caller asks for one narrower."""
    if limit <= 0:
        return 0
    if split_size:
        run, aligned = split_size, split_size % block_size == 0
    else:
        run = math.ceil(math.ceil(width * block_size / max(num_splits, 1)) / block_n) * block_n
        aligned = min(block_n, MIN_BLOCK_N) % block_size == 0  # the narrowest tile it may run
    pages = triton.next_power_of_2(math.ceil(run / block_size) + (not aligned))
    return pages if pages <= limit else 0


def decode_ids_ahead(
    split_size: int,
    num_splits: int,
    width: int,
    block_size: int,
    block_n: int,
    pages_ahead: int | None = None,
) -> int:
    """Block ids a decode launch's programs read before their walks (``walk_pages``): a decode step's
    splits only, few programs each walking long (one split a sequence at B=64 took 1.23x its time with
    the ids ahead at 4K: 3 stages cost occupancy where programs are many). ``pages_ahead``: the most
    (None: ``PAGES_AHEAD``)."""
    limit = (PAGES_AHEAD if pages_ahead is None else pages_ahead) if num_splits > 1 else 0
    return walk_pages(split_size, num_splits, width, block_size, block_n, limit)


def fetches_tiles(kv_dtype: torch.dtype, block_m: int, ahead: int) -> bool:
    """Whether a launch's walk takes a tile's ids at a time over an e4m3 cache, fetching each next
    tile into registers: the only walk that reads the ``WALKS`` form or takes the register cap."""
    return kv_dtype == torch.float8_e4m3fn and block_m <= 16 and not ahead


def pick_block_m(rows_per_seq: int, group: int) -> int:
    """16 rows for decode (GQA group padded), 64 for prefill chunks."""
    base = 16 if rows_per_seq <= 16 else 64
    return max(base, triton.next_power_of_2(group))


def _check_int32(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dtype != torch.int32 or t.dim() != dims or t.stride(-1) != 1:
        raise TypeError(f"{name} must be a {dims}-d int32 tensor with a contiguous last dim")


def _strides(q, k_cache, v_cache, tables, o_dst, lse_dst, split_o: int, split_lse: int) -> tuple[int, ...]:
    """The element strides the paged kernels take, in their parameter order."""
    return (
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        tables.stride(0),
        split_o,
        o_dst.stride(0),
        o_dst.stride(1),
        split_lse,
        lse_dst.stride(0),
    )


def launch_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    num_splits: int,
    split_size: int,
    o_dst: torch.Tensor,  # [T, Hq, D] view of split 0
    lse_dst: torch.Tensor,  # [T, Hq] view of split 0
    split_stride_o: int,
    split_stride_lse: int,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pack: int = 1,
    merged: Merged | None = None,
    pages_ahead: int | None = None,
    max_registers: int | None = None,
    walks: int | None = None,
) -> Launch | None:
    """Launch the kernel; split k of row t goes to o_dst + k * split_stride_o (element strides).

    ``merged`` = (out, out_lse or None, counts) on a decode step with splits: the splits' partials are
    merged into ``out`` by the last program of each (sequence, KV head) (``merge_last``), with no
    second kernel; ``counts`` is [S * Hkv] int32 zeros, left at zero. Its ``out`` is argument
    ``MERGED_OUT`` of the launch (``step_launch.PAGED_MERGED``).

    ``pack > 1`` on a decode step (``max_query_len == 1``) runs ``pack`` sequences per program
    (``packed_decode_program``), each contributing ``block_n // pack`` tokens to a KV tile.
    ``pages_ahead``: the most block ids a decode split's program reads before its walk (None:
    ``PAGES_AHEAD``; 0: a tile at a time). ``max_registers``: ptxas's cap a thread, and ``walks``: the
    form of an e4m3 decode walk, as ``e4m3_walks`` gives it (a decode graph's key holds it, probes set
    it; None: ``e4m3_walks`` of the table's width over the splits), read only where a walk takes a
    tile's ids at a time.
    Returns the recorded launch (None when there was nothing to do): args 0-2 are q, k_cache,
    v_cache and 6-7 o_dst, lse_dst, for ``relaunch``.
    """
    q_heads, kv_heads, dim, block_size = check_cache(q, k_cache, v_cache)
    _check_int32("block_tables", block_tables, 2)
    _check_int32("seq_lens", seq_lens, 1)
    _check_int32("query_start_loc", query_start_loc, 1)
    if o_dst.stride(2) != 1 or lse_dst.stride(1) != 1:
        raise ValueError("outputs need a contiguous head_dim (o) and head (lse) dimension")
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return None
    group = q_heads // kv_heads
    ahead = 0
    if pack == 1 and max_query_len == 1:
        ahead = decode_ids_ahead(
            split_size, num_splits, block_tables.shape[1], block_size, block_n, pages_ahead
        )
    stages = num_stages or (AHEAD_STAGES if ahead else 2)  # measured on H200 (bf16): docs/kernels.md §2.1
    strides = _strides(q, k_cache, v_cache, block_tables, o_dst, lse_dst, split_stride_o, split_stride_lse)
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, o_dst, lse_dst, scale * LOG2E)
    if merged is not None and (pack > 1 or out_not_rows(merged[0])):
        raise ValueError("a merged launch takes pack 1 and an output with a contiguous head_dim")
    if pack > 1 and max_query_len == 1:
        splits = (num_splits, split_size)
        return launch_packed_decode(tensors, strides, *splits, pack, block_n, num_warps, stages)
    block_m = pick_block_m(max_query_len * group, group)
    elt, limit = q.element_size(), smem_limit(q.device)
    block_m, block_n, stages = fit_tiles(block_m, block_n, stages, dim, elt, limit)
    q_tiles = math.ceil(max_query_len / (block_m // group))
    grid = (num_seqs * q_tiles, kv_heads, num_splits)
    # an e4m3 decode walk a tile's ids at a time: the only launch that reads ``walks`` (elsewhere one
    # value, so no compiled variant more) or takes the register cap
    fetched = fetches_tiles(k_cache.dtype, block_m, ahead)
    if not fetched:
        walks = 1
    elif walks is None:
        run = split_size or block_tables.shape[1] * block_size // num_splits
        walks = e4m3_walks(num_splits, run, math.prod(grid), num_sms(q.device))
    if merged is not None and (max_query_len != 1 or num_splits == 1):
        raise ValueError("a merged launch is for a decode step's splits (one query a sequence, splits > 1)")
    out, out_lse, counts = merged if merged is not None else (q, None, seq_lens)
    if merged is not None and (counts.dtype != torch.int32 or counts.numel() < num_seqs * kv_heads):
        raise ValueError(f"counts must be >= {num_seqs * kv_heads} int32 zeros")
    return launch_fitting(
        _paged_kernel,
        grid,
        (
            *tensors,
            q_tiles,
            split_size,
            *strides,
            out,
            out if out_lse is None else out_lse,
            counts,
            out.stride(0),
            out.stride(1),
        ),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=interpreter_upcast(q.dtype),
        ONE_TILE=q_tiles == 1,
        MERGE=merged is not None,
        BLOCK_G=triton.next_power_of_2(group),
        WANT_LSE=out_lse is not None,
        MERGE_UNROLL=MERGE_UNROLL,
        PAGES_AHEAD=ahead,
        WALKS=walks,
        num_warps=num_warps or 4,  # measured on H200: docs/kernels.md §2.1
        num_stages=stages,
        **register_cap(max_registers, one_walk=fetched and walks == 1),
    )


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    scale: float,
    max_query_len: int,
    *,
    max_seq_len: int | None = None,  # host bound on seq_lens (avoids a device sync)
    num_splits: int | None = None,  # KV splits; None = chosen to fill the SMs
    out: torch.Tensor | None = None,  # [T, Hq, D] q.dtype
    block_n: int = 64,
    pack: int = 1,  # decode sequences per program (``packed_decode_program``); 1 = one each
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sequence's new queries over its paged KV: (o [T,Hq,D], lse [T,Hq] fp32)."""
    q_heads, kv_heads, dim, _ = check_cache(q, k_cache, v_cache)
    tokens = q.shape[0]
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(tokens, q_heads, dtype=torch.float32, device=q.device)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    group = q_heads // kv_heads
    block_m = pick_block_m(max_query_len * group, group)
    base = seq_lens.shape[0] * math.ceil(max_query_len / (block_m // group)) * kv_heads
    if pack > 1 and max_query_len == 1:
        base = math.ceil(seq_lens.shape[0] / pack) * kv_heads
    if num_splits is None:
        num_splits, split_size = choose_split(
            max_seq_len, base, q.device, block_n, prefill=max_query_len > 1, kv_dtype=k_cache.dtype
        )
    else:
        split_size = math.ceil(math.ceil(max(max_seq_len, 1) / num_splits) / block_n) * block_n
        num_splits = max(1, math.ceil(max_seq_len / split_size))
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len)
    if num_splits == 1:
        launch_paged(*args, 1, split_size, out, lse, 0, 0, block_n, pack=pack)
        return out, lse
    o_part = torch.empty(num_splits * tokens, q_heads, dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_splits * tokens, q_heads, dtype=torch.float32, device=q.device)
    split_o, split_lse = o_part.stride(0) * tokens, q_heads * tokens
    counts = (
        merge_counts(q.device, seq_lens.shape[0] * kv_heads) if max_query_len == 1 and pack == 1 else None
    )
    if counts is not None:  # a decode step: the last split of each head merges (no second kernel)
        merged = (out, lse, counts)
        launch_paged(
            *args, num_splits, split_size, o_part, lse_part, split_o, split_lse, block_n, merged=merged
        )
        return out, lse
    launch_paged(*args, num_splits, split_size, o_part, lse_part, split_o, split_lse, block_n, pack=pack)
    merge_partials(o_part, lse_part, tokens, num_parts=num_splits, part_stride=tokens, out=out, out_lse=lse)
    return out, lse


_COUNTS: dict[torch.device, torch.Tensor] = {}


def merge_counts(device: torch.device, n: int) -> torch.Tensor | None:
    """A device's zeroed merge counts for ``n`` (sequence, KV head) pairs, kept between calls (each
    merged launch leaves them at zero); None while a CUDA graph is captured and they would have to
    grow (a graph keeps its own: ``graph_attention.PagedGraph``)."""
    have = _COUNTS.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        have = _COUNTS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return have


def out_not_rows(out: torch.Tensor) -> bool:
    return out.dim() != 3 or out.stride(2) != 1


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``paged_attention``: (o [T,Hq,D] compute_dtype, lse [T,Hq])."""
    from prefixserve.attention.reference import attention_with_lse

    block_size = k_cache.shape[1]
    tokens, q_heads, dim = q.shape
    out = torch.zeros(tokens, q_heads, dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((tokens, q_heads), -math.inf, dtype=compute_dtype, device=q.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        nblk = math.ceil(seq_len / block_size)
        blocks = block_tables[s, :nblk].long()
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
        limits = torch.arange(seq_len - (hi - lo) + 1, seq_len + 1, device=q.device)
        o, l_ = attention_with_lse(q[lo:hi], k, v, scale, limits, compute_dtype)
        out[lo:hi] = o
        lse[lo:hi] = l_
    return out, lse


__all__ = ["MERGED_OUT", "merge_counts", "paged_attention", "paged_attention_ref"]
