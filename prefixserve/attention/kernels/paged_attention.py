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
import os
from collections.abc import Callable
from typing import Any

import torch

from prefixserve.attention.kernels import require_triton
from prefixserve.attention.kernels.launch import Launch, record
from prefixserve.attention.kernels.merge import merge_partials

triton, tl = require_triton()

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def softmax_step(s, m_i, l_i, qk_scale):
    """One online-softmax update from unscaled fp32 scores s: (p, alpha, new max, new sum).

    The scale is applied inside the exponent (one FMA per score, not a multiply and a subtract);
    rows with no visible key so far keep max -inf and get p = 0, never NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def qk_scores(q, k, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Unscaled fp32 scores q @ k^T ([BLOCK_M, BLOCK_N])."""
    if UPCAST:  # the CPU interpreter's dot mishandles bf16: same values, fp32 product
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k), input_precision=DOT_PREC)


@triton.jit
def accumulate_pv(acc, alpha, p, v, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc * alpha + p @ v, with the product accumulated in place (no second accumulator tile)."""
    acc = acc * alpha[:, None]
    if UPCAST:
        return tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)


@triton.jit
def attend_range(
    q,  # [BLOCK_M, HEAD_DIM] input dtype
    m_i,  # [BLOCK_M] fp32, running max (base-2 units)
    l_i,  # [BLOCK_M] fp32, running sum
    acc,  # [BLOCK_M, HEAD_DIM] fp32
    k_base,  # k_cache pointer at this KV head
    v_base,
    table_ptr,  # block ids of this KV run: token n lives in block table_ptr[n // BLOCK_SIZE]
    kv_lo,
    kv_hi,  # tokens [kv_lo, kv_hi) of the run
    limit,  # [BLOCK_M] int32: row m sees tokens n < limit[m]
    qk_scale,  # softmax scale * log2(e)
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    MASKED: tl.constexpr = True,
    STAGES: tl.constexpr = None,
):
    """Online softmax of a query tile over KV tokens [kv_lo, kv_hi) of a paged run (shared by kernels).

    ``MASKED=False`` is for callers that guarantee whole tiles every row may see (the shared kernel's
    non-causal body): no per-element masks or selects, which cost ALU time on the compute-bound path.
    ``STAGES`` overrides the kernel's pipelining depth for this loop (None: the kernel's): a loop of at
    most one tile gains nothing from it, and its buffers would take shared memory from the main loop.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=STAGES):
        n = start + offs_n
        if MASKED:
            n_ok = n < kv_hi
            blk = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(table_ptr + n // BLOCK_SIZE).to(tl.int64)
        within = (n % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + blk[:, None] * stride_kb + within[:, None] * stride_kt + offs_d[None, :]
        if MASKED:  # noqa: SIM108 (a constexpr branch: no masks compiled in)
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = qk_scores(q, k, DOT_PREC, UPCAST)
        if MASKED:
            visible = (n[None, :] < limit[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
        v_ptrs = v_base + blk[:, None] * stride_vb + within[:, None] * stride_vt + offs_d[None, :]
        if MASKED:  # noqa: SIM108
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = accumulate_pv(acc, alpha, p, v, DOT_PREC, UPCAST)
    return m_i, l_i, acc


@triton.jit
def finish_rows(m_i, l_i, acc):
    """(o, natural-log lse) of a tile; rows that saw nothing give o = 0, lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return o, lse


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
):
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
        m_i, l_i, acc = attend_range(
            q,
            m_i,
            l_i,
            acc,
            k_ptr + kvh * stride_kh,
            v_ptr + kvh * stride_vh,
            bt_ptr + seq.to(tl.int64) * stride_bt,
            kv_lo,
            kv_hi,
            limit,
            qk_scale,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            BLOCK_N,
            BLOCK_SIZE,
            HEAD_DIM,
            DOT_PREC,
            UPCAST,
        )
        o, lse = finish_rows(m_i, l_i, acc)
        split64 = split.to(tl.int64)
        o_rows = o_ptr + split64 * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            o_rows + offs_d[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
        tl.store(lse_ptr + split64 * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


@triton.jit
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
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (sequences x query tiles, KV heads, KV splits); arguments as ``paged_program``'s."""
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
    )


@triton.jit
def packed_decode_program(
    pid,  # group of PACK sequences
    kvh,
    split,
    num_splits,
    num_seqs,
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    bt_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    qsl_ptr,  # [S+1] int32: at most one query per sequence
    o_ptr,  # split 0 of [splits, T, Hq, D] (or the final [T, Hq, D] when there is one split)
    lse_ptr,  # split 0 of [splits, T, Hq]
    qk_scale,
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
    PACK: tl.constexpr,  # sequences per program
    BLOCK_M: tl.constexpr,  # >= PACK x GROUP, >= 16
    CHUNK: tl.constexpr,  # KV tokens of each sequence per tile: BLOCK_N = PACK x CHUNK
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Decode over PACK sequences at once: row m is sequence m // GROUP, column n sequence n // CHUNK.

    One query per sequence fills only GROUP rows of a tensor-core tile (padded to 16), so one
    sequence per program leaves most rows empty and walks a short KV run (S=128: two 64-token
    tiles) with a pipeline that barely fills. Packing PACK sequences makes the tile block-diagonal:
    each KV tile holds CHUNK tokens of every packed sequence, the scores outside a row's own
    sequence are masked, and the loop is PACK times longer for the same MMA work per token.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, PACK * CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    # rows: query heads of the packed sequences
    seq_m = pid * PACK + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    live_m = (offs_m < PACK * GROUP) & (seq_m < num_seqs)
    q_start = tl.load(qsl_ptr + seq_m, mask=live_m, other=0)
    q_len = tl.load(qsl_ptr + seq_m + 1, mask=live_m, other=0) - q_start
    row_ok = live_m & (q_len > 0)
    tok = q_start.to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    # columns: CHUNK-token slices of each packed sequence's KV split
    seq_n = pid * PACK + offs_n // CHUNK
    live_n = seq_n < num_seqs
    # (a sequence without a query still walks its KV, unseen: no row of the tile belongs to it)
    len_n = tl.load(seq_lens_ptr + seq_n, mask=live_n, other=0)
    even = tl.cdiv(tl.cdiv(len_n, num_splits), CHUNK) * CHUNK
    size_n = tl.where(split_size > 0, split_size, even)
    lo_n = split * size_n
    hi_n = tl.minimum(lo_n + size_n, len_n)
    steps = tl.max(tl.cdiv(tl.maximum(hi_n - lo_n, 0), CHUNK), 0)
    table_n = bt_ptr + seq_n.to(tl.int64) * stride_bt
    same = seq_m[:, None] == seq_n[None, :]
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for it in tl.range(0, steps):
        n = lo_n + it * CHUNK + offs_n % CHUNK
        n_ok = n < hi_n
        blk = tl.load(table_n + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        within = (n % BLOCK_SIZE).to(tl.int64)
        k = tl.load(
            k_base + blk[:, None] * stride_kb + within[:, None] * stride_kt + offs_d[None, :],
            mask=n_ok[:, None],
            other=0.0,
        )
        s = qk_scores(q, k, DOT_PREC, UPCAST)
        s = tl.where(same & n_ok[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
        v = tl.load(
            v_base + blk[:, None] * stride_vb + within[:, None] * stride_vt + offs_d[None, :],
            mask=n_ok[:, None],
            other=0.0,
        )
        acc = accumulate_pv(acc, alpha, p, v, DOT_PREC, UPCAST)
    o, lse = finish_rows(m_i, l_i, acc)
    split64 = split.to(tl.int64)
    o_rows = o_ptr + split64 * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_rows + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + split64 * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _packed_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,
    num_seqs,
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
    GROUP: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (sequence packs, KV heads, KV splits); arguments as ``packed_decode_program``'s."""
    packed_decode_program(
        tl.program_id(0),
        tl.program_id(1),
        tl.program_id(2),
        tl.num_programs(2),
        num_seqs,
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        seq_lens_ptr,
        qsl_ptr,
        o_ptr,
        lse_ptr,
        qk_scale,
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
        PACK,
        BLOCK_M,
        CHUNK,
        HEAD_DIM,
        BLOCK_SIZE,
        DOT_PREC,
        UPCAST,
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the 1e-5 promise), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """Triton 3.x's CPU interpreter computes bf16 tl.dot wrongly; upcast the tiles there only."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill (a fixed small number on the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


SMEM_LIMIT_HOPPER = 232_448  # opt-in shared memory per block on the H100 / H200 (bytes)


def smem_limit(device: torch.device) -> int:
    """Shared memory one program may use: read off the GPU, the Hopper value elsewhere (interpreter)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", SMEM_LIMIT_HOPPER))
    return SMEM_LIMIT_HOPPER


def tile_smem_bytes(block_m: int, block_n: int, dim: int, elt: int, stages: int) -> int:
    """Shared memory of ``attend_range``'s pipelined loop: ``stages`` copies of the K and V tiles, plus q.

    The K/V term is what Triton 3.6 reported on the H200 (fp32, 128 x 128 tiles, d=128, 2 stages:
    2 x 2 x 128 x 128 x 4 = 262,144 B); the q tile is added because wgmma may read it from shared
    memory. Scores and probabilities stay in registers.
    """
    return stages * 2 * block_n * dim * elt + block_m * dim * elt


def fit_tiles(
    block_m: int, block_n: int, stages: int, dim: int, elt: int, limit: int = SMEM_LIMIT_HOPPER
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages) shrunk until ``tile_smem_bytes`` fits ``limit``.

    Why this order: pipelining depth beyond 2 is a tuning gain, BLOCK_N only sets how many keys one
    iteration covers, while BLOCK_M sets how often the KV is re-read, so it is given up last. fp32
    (4-byte elements, the exactness path) is where the bf16-tuned 128 x 128 tiles overflow.
    """
    while tile_smem_bytes(block_m, block_n, dim, elt, stages) > limit:
        if stages > 2:
            stages -= 1
        elif block_n > 64:
            block_n //= 2
        elif block_m > 64:
            block_m //= 2
        elif block_n > 16:
            block_n //= 2
        elif stages > 1:
            stages -= 1
        elif block_m > 16:
            block_m //= 2
        else:
            break
    return block_m, block_n, stages


def _out_of_resources() -> type[Exception]:
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - older Triton
        return RuntimeError
    return OutOfResources


_FALLBACK: dict[tuple[Any, ...], tuple[int, int]] = {}  # (kernel, constexprs) -> (BLOCK_N, stages) that fit


def launch_fitting(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    args_for: Callable[[dict[str, Any]], tuple[Any, ...]] | None = None,
    **kw: Any,
) -> Launch:
    """Launch ``kernel``; if Triton still runs out of shared memory, retry with fewer stages, then a
    narrower BLOCK_N (both keep the result: KV ranges are walked in any tile width).

    ``args_for(kw)``, when given, remakes the arguments for the tiles being tried (TMA descriptors
    carry BLOCK_N in their block shape). Returns the launch that ran, recorded so that later layers
    can ``relaunch`` it cheaply.

    ``fit_tiles`` is a model of Triton's allocator, and this is the safety net for where the model is
    off; the config that fitted is remembered, so the retry costs one failed compile per shape.
    """
    fixed = sorted((k, v) for k, v in kw.items() if k not in ("num_stages", "BLOCK_N"))
    key = (id(kernel), str(args[0].dtype), *fixed)  # args[0] is q: its dtype sets the tile bytes
    if key in _FALLBACK:
        kw["BLOCK_N"], kw["num_stages"] = _FALLBACK[key]
    while True:
        try:
            if args_for is not None:
                args = args_for(kw)
            compiled = kernel[grid](*args, **kw)
            return record(kernel, grid, args, kw, compiled)
        except _out_of_resources():
            if kw["num_stages"] > 1:
                kw["num_stages"] -= 1
            elif kw["BLOCK_N"] > 16:
                kw["BLOCK_N"] //= 2
            else:
                raise
            _FALLBACK[key] = (kw["BLOCK_N"], kw["num_stages"])


def choose_split(
    max_kv: int, base_programs: int, device: torch.device, block_n: int, min_chunk: int = 256
) -> tuple[int, int]:
    """(num_splits, split_size): enough KV splits that ~2 waves of programs cover the SMs."""
    if max_kv <= 0:
        return 1, block_n
    want = max(1, math.ceil(2 * num_sms(device) / max(1, base_programs)))
    splits = max(1, min(want, math.ceil(max_kv / min_chunk), 64))
    split_size = math.ceil(math.ceil(max_kv / splits) / block_n) * block_n
    return math.ceil(max_kv / split_size), split_size


def decode_pack(group: int, max_query_len: int) -> int:
    """Sequences per program for a decode step: enough to fill 16 tensor-core rows with GQA groups.

    A power of two (tile widths are), 1 for prefill rows or groups of more than 8 heads. Measured at
    G=4 (H200, NOTES.md v6): 4 per program is 7% faster at B=256, S=512 and even at B=1024.
    """
    if max_query_len != 1 or group > 8:
        return 1
    return 1 << ((16 // group).bit_length() - 1)


def pick_block_m(rows_per_seq: int, group: int) -> int:
    """16 rows for decode (GQA group padded), 64 for prefill chunks."""
    base = 16 if rows_per_seq <= 16 else 64
    return max(base, triton.next_power_of_2(group))


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q / cache dtypes, shapes and strides; return (Hq, Hkv, D, block_size)."""
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one of {_DTYPES}; got {q.dtype}/{k_cache.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("q must be [T, Hq, D]; k_cache and v_cache [num_blocks, block_size, Hkv, D]")
    _, q_heads, dim = q.shape
    _, block_size, kv_heads, kdim = k_cache.shape
    if kdim != dim or q_heads % kv_heads:
        raise ValueError(f"head_dim {dim} vs {kdim}, q_heads {q_heads} must be a multiple of {kv_heads}")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"head_dim {dim} must be a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim")
    if q.device != k_cache.device or q.device != v_cache.device:
        raise ValueError("q and the caches must be on one device")
    return q_heads, kv_heads, dim, block_size


def _check_int32(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dtype != torch.int32 or t.dim() != dims or t.stride(-1) != 1:
        raise TypeError(f"{name} must be a {dims}-d int32 tensor with a contiguous last dim")


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
) -> Launch | None:
    """Launch the kernel; split k of row t goes to o_dst + k * split_stride_o (element strides).

    ``pack > 1`` on a decode step (``max_query_len == 1``) runs ``pack`` sequences per program
    (``packed_decode_program``), each contributing ``block_n // pack`` tokens to a KV tile.
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
    stages = num_stages or 2  # measured on H200 (bf16): NOTES.md
    elt, limit = q.element_size(), smem_limit(q.device)
    strides = (
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        split_stride_o,
        o_dst.stride(0),
        o_dst.stride(1),
        split_stride_lse,
        lse_dst.stride(0),
    )
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, o_dst, lse_dst, scale * LOG2E)
    if pack > 1 and max_query_len == 1:
        chunk = max(1, block_n // pack)
        block_m = max(16, triton.next_power_of_2(pack * group))
        block_m, _, stages = fit_tiles(block_m, pack * chunk, stages, dim, elt, limit)
        return launch_fitting(
            _packed_decode_kernel,
            (math.ceil(num_seqs / pack), kv_heads, num_splits),
            (*tensors, num_seqs, split_size, *strides),
            GROUP=group,
            PACK=pack,
            BLOCK_M=block_m,
            CHUNK=chunk,
            HEAD_DIM=dim,
            BLOCK_SIZE=block_size,
            DOT_PREC=dot_precision(q.dtype),
            UPCAST=interpreter_upcast(q.dtype),
            num_warps=num_warps or 4,
            num_stages=stages,
        )
    block_m = pick_block_m(max_query_len * group, group)
    block_m, block_n, stages = fit_tiles(block_m, block_n, stages, dim, elt, limit)
    q_tiles = math.ceil(max_query_len / (block_m // group))
    grid = (num_seqs * q_tiles, kv_heads, num_splits)
    return launch_fitting(
        _paged_kernel,
        grid,
        (
            *tensors,
            q_tiles,
            split_size,
            *strides,
        ),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=interpreter_upcast(q.dtype),
        num_warps=num_warps or 4,  # measured on H200: NOTES.md
        num_stages=stages,
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
        num_splits, split_size = choose_split(max_seq_len, base, q.device, block_n)
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
    launch_paged(*args, num_splits, split_size, o_part, lse_part, split_o, split_lse, block_n, pack=pack)
    merge_partials(o_part, lse_part, tokens, num_parts=num_splits, part_stride=tokens, out=out, out_lse=lse)
    return out, lse


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


__all__ = ["paged_attention", "paged_attention_ref"]
