"""Triton device building blocks of the attention kernels: one online-softmax step, the two products,
a paged KV walk, and a tile's (o, lse).

Scores are fp32, the softmax runs in base 2 with log2(e) folded into the scale, and the LSE comes out
in natural log; a row that sees no key gets o = 0 and lse = -inf (true -inf, guarded so that it never
produces NaN). The paged kernel (``paged_attention.py``), the packed decode kernel
(``packed_decode.py``) and the shared-segment kernel (``shared_attention.py``) are built from these.

An e4m3 KV cache (``kv_quant.py``) is read as it is: each K / V tile is widened to q's dtype after its
load (exact), its scales already folded into q and the output by the caller.
"""

from __future__ import annotations

import os

from prefixserve.triton_support import require_triton

triton, tl = require_triton()

# Whether Triton's CPU interpreter runs these kernels (it cannot run inline PTX). Read when this module
# loads, as Triton reads it when it decorates the kernels below.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
# e4m3 tiles widened by inline PTX that Triton keeps where it is (see ``widened_kv``); a probe sets it
# False, before the first launch in its process, to time Triton's own cast beside it.
OPAQUE_WIDENING = tl.constexpr(True)

# e4m3 tiles loaded into registers a tile ahead of their use (``attend_range_fetched``) rather than by
# the software pipeline through shared memory; a probe sets it False to time the pipeline beside it.
FETCH_E4M3_AHEAD = tl.constexpr(True)
# Independent walks a fetched e4m3 program cuts its tiles into, one a warp (``attend_range_walks``),
# where its caller leaves the count to this module (``WALKS=0``) and it walks a tile's ids at a time
# (a split's walk with its ids ahead keeps one: measured slower cut, docs/kernels.md §2.13); 1: one
# walk over whole tiles. A probe sets it. The paged kernel's launcher picks per launch (``e4m3_walks``).
E4M3_WALKS = tl.constexpr(4)

# cvt.rn.f16x2.e4m3x2 widens two codes (a .b16) to two fp16 values (a .b32), the low byte to the low
# half: four codes in a register come out as two registers, in order.
E4M3X4_TO_F16X4 = tl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)

# The same, each fp16 value its own .b16 output (``widened_words``: a word of four codes in, four out).
E4M3X4_TO_F16_EACH = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 p, q; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 p, lo; "
    "cvt.rn.f16x2.e4m3x2 q, hi; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }"
)


@triton.jit
def widened_q(q, k_ptr):
    """q in the dtype an e4m3 cache's tiles are widened to: fp16 where q is bf16 (e4m3 -> fp16 is one
    instruction for two values on sm_89+, e4m3 -> bf16 several, and decode over an FP8 cache was
    bound by them: docs/kernels.md §2.13), q's own dtype otherwise. bf16 -> fp16 is exact for
    normal values in fp16's range (fp16 has the longer mantissa); larger ones are clamped to it,
    values under 2^-14 keep fewer bits (a product's terms that small do not move an fp32 sum)."""
    if k_ptr.dtype.element_ty == tl.float8e4nv:  # noqa: SIM102 (compile-time branches, one a dtype)
        if q.dtype == tl.bfloat16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # fp16's largest
    return q


@triton.jit
def widened_kv(x, dtype):
    """A K / V tile in q's ``dtype`` (``widened_q``'s): an e4m3 tile widened (exact), else a no-op.

    Triton moves its own e4m3 cast past the tile's staging in shared memory (that halves the staged
    bytes), so every MMA operand is then built from scalar ``ld.shared`` (sm_90 has no ``ldmatrix``
    for 8-bit transposed operands) and widened again at each use. The same widening as inline PTX
    with side effects cannot be moved: the tile is widened once in registers, staged as fp16 and read
    by ``ldmatrix`` like a bf16 cache's (``benchmarks/probes/ptx_census.py``; docs/kernels.md §2.13)."""
    if x.dtype == tl.float8e4nv and dtype == tl.float16 and OPAQUE_WIDENING and not INTERPRETED:
        codes = x.to(tl.uint8, bitcast=True)
        return tl.inline_asm_elementwise(
            E4M3X4_TO_F16X4, "=r,=r,r", [codes], dtype=tl.float16, is_pure=False, pack=4
        )
    return x.to(dtype)


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
    lower=None,  # [BLOCK_M] int32 with WINDOWED: row m sees tokens n >= lower[m] too (a sliding window)
    WINDOWED: tl.constexpr = False,
    WALKS: tl.constexpr = 0,  # a fetched e4m3 walk's runs (``attend_range_walks``); 0: E4M3_WALKS
):
    """Online softmax of a query tile over KV tokens [kv_lo, kv_hi) of a paged run (shared by kernels).

    ``MASKED=False`` is for callers that guarantee whole tiles every row may see (the shared kernel's
    non-causal body): no per-element masks or selects, which cost ALU time on the compute-bound path.
    ``STAGES`` overrides the kernel's pipelining depth for this loop (None: the kernel's): a loop of at
    most one tile gains nothing from it, and its buffers would take shared memory from the main loop.
    """
    if MASKED and STAGES is None and fetches_ahead(q, k_base):  # a caller's STAGES: its short tail
        walks: tl.constexpr = E4M3_WALKS if WALKS == 0 else WALKS
        return attend_range_fetched(
            q, m_i, l_i, acc, k_base, v_base, table_ptr, kv_lo, kv_hi, limit, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, 0, lower, WINDOWED, walks,
        )  # fmt: skip
    for start in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=STAGES):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_base, v_base, table_ptr, start, kv_hi, limit, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, MASKED, lower, WINDOWED,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def fetches_ahead(q, k_base):
    """Whether a walk over this cache loads its tiles into registers a tile ahead: a decode tile (16
    rows; measured there only) over an e4m3 cache. Triton's pipeline stages a tile's codes in shared
    memory, reads them back to widen them and stages them again for the MMA; that shared-memory
    traffic, not DRAM, bounded decode over an FP8 cache (docs/kernels.md §2.13)."""
    return FETCH_E4M3_AHEAD and q.shape[0] <= 16 and k_base.dtype.element_ty == tl.float8e4nv


@triton.jit
def tile_ids(table_ptr, ids, page0, n, kv_hi, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr):
    """Block ids (int64) of tokens n: loaded from the table, or (PAGES > 0) picked out of ``ids``, the
    run's PAGES ids from block ``page0`` on (``attend_range_ahead``)."""
    if PAGES > 0:
        page = tl.minimum(n // BLOCK_SIZE - page0, PAGES - 1)  # past kv_hi: clamped, and masked later
        return tl.gather(ids, page, 0).to(tl.int64)
    return tl.load(table_ptr + n // BLOCK_SIZE, mask=n < kv_hi, other=0).to(tl.int64)


@triton.jit
def fetch_kv_words(
    k_base, v_base, blk, n, kv_hi, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The e4m3 K and V tiles of tokens n (blocks ``blk``) as int32 words of four codes each, zeros at
    or past kv_hi. Words, not bytes: a tile of bytes carried from one loop turn to the next is a
    register per byte after LLVM, repacked by hundreds of ``prmt`` before its widening."""
    offs_w = tl.arange(0, HEAD_DIM // 4)
    n_ok = (n < kv_hi)[:, None]
    within = (n % BLOCK_SIZE).to(tl.int64)
    k_words = k_base.to(tl.pointer_type(tl.int32))
    v_words = v_base.to(tl.pointer_type(tl.int32))
    k_ptrs = k_words + blk[:, None] * (stride_kb // 4) + within[:, None] * (stride_kt // 4) + offs_w[None, :]
    v_ptrs = v_words + blk[:, None] * (stride_vb // 4) + within[:, None] * (stride_vt // 4) + offs_w[None, :]
    return tl.load(k_ptrs, mask=n_ok, other=0), tl.load(v_ptrs, mask=n_ok, other=0)


@triton.jit
def e4m3_code(words, shift: tl.constexpr):
    """The fp16 value of the code ``shift`` bits up each word (the interpreter's widening)."""
    return ((words >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def widened_words(words, dtype):
    """[N, W] int32 words of e4m3 codes (``fetch_kv_words``) -> the [N, 4W] tile in ``dtype``, each
    word's codes in memory order (low byte first); [WALKS, N, W] -> [WALKS, N, 4W] likewise."""
    if INTERPRETED:
        a, b = e4m3_code(words, 0), e4m3_code(words, 8)
        c, d = e4m3_code(words, 16), e4m3_code(words, 24)
    else:
        a, b, c, d = tl.inline_asm_elementwise(
            E4M3X4_TO_F16_EACH, "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4, is_pure=False, pack=1
        )
    x = tl.join(tl.join(a, c), tl.join(b, d))  # [..., W, 2, 2]: [w, i, j] is code 2 * i + j of word w
    if len(words.shape) == 3:
        x = tl.reshape(x, (words.shape[0], words.shape[1], words.shape[2] * 4))
    else:
        x = tl.reshape(x, (words.shape[0], words.shape[1] * 4))
    if not INTERPRETED:
        # Triton halves an MMA operand's assumed load width for each join it finds behind it (wider
        # register fragments, read by ld.shared.v2 instead of ldmatrix): an opaque copy hides the joins
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2)
    return x.to(dtype)


@triton.jit
def attend_range_fetched(
    q, m_i, l_i, acc, k_base, v_base, table_ptr, kv_lo, kv_hi, limit, qk_scale, stride_kb, stride_kt,
    stride_vb, stride_vt, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, PAGES: tl.constexpr, lower, WINDOWED: tl.constexpr,
    WALKS: tl.constexpr,
):  # fmt: skip
    """``attend_range`` (masked) with each tile's K / V codes loaded into registers while the tile
    before it is computed, and its block ids a tile earlier still; no software pipeline (its stages
    would put the codes through shared memory). ``PAGES``: as ``attend_range_ahead``'s; ``WALKS`` > 1:
    ``attend_range_walks`` where it applies."""
    # a product's tokens 16 at least; a warp's [16, 256] accumulator would spill (255 registers)
    if WALKS > 1 and PAGES == 0 and BLOCK_N // WALKS >= 16 and HEAD_DIM <= 128:
        return attend_range_walks(
            q, m_i, l_i, acc, k_base, v_base, table_ptr, kv_lo, kv_hi, limit, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, PAGES, lower, WINDOWED,
            WALKS,
        )  # fmt: skip
    page0 = kv_lo // BLOCK_SIZE
    ids = page0  # unused where PAGES == 0
    if PAGES > 0:
        offs_p = tl.arange(0, PAGES)
        ids = tl.load(table_ptr + page0 + offs_p, mask=(page0 + offs_p) * BLOCK_SIZE < kv_hi, other=0)
    n = kv_lo + tl.arange(0, BLOCK_N)
    k, v = fetch_kv_words(
        k_base, v_base, tile_ids(table_ptr, ids, page0, n, kv_hi, BLOCK_SIZE, PAGES), n, kv_hi, stride_kb,
        stride_kt, stride_vb, stride_vt, BLOCK_SIZE, HEAD_DIM,
    )  # fmt: skip
    blk_next = tile_ids(table_ptr, ids, page0, n + BLOCK_N, kv_hi, BLOCK_SIZE, PAGES)
    for start in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=1):
        n = start + tl.arange(0, BLOCK_N)
        k_next, v_next = fetch_kv_words(
            k_base, v_base, blk_next, n + BLOCK_N, kv_hi, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_SIZE, HEAD_DIM,
        )  # fmt: skip
        blk_next = tile_ids(table_ptr, ids, page0, n + 2 * BLOCK_N, kv_hi, BLOCK_SIZE, PAGES)
        p, alpha, m_i, l_i = tile_softmax(
            q, widened_words(k, q.dtype), m_i, l_i, n, kv_hi, limit, qk_scale, DOT_PREC, UPCAST, True, lower,
            WINDOWED,
        )  # fmt: skip
        acc = accumulate_pv(acc, alpha, p, widened_words(v, q.dtype), DOT_PREC, UPCAST)
        k, v = k_next, v_next
    return m_i, l_i, acc


@triton.jit
def fetch_walk_words(
    k_base, v_base, table_ptr, ids, page0, n, kv_hi, stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGES: tl.constexpr, WALKS: tl.constexpr,
):  # fmt: skip
    """``fetch_kv_words`` for a tile's tokens n [BLOCK_N] cut into WALKS runs: [WALKS, BLOCK_N / WALKS,
    HEAD_DIM / 4] words each of K and V."""
    sub: tl.constexpr = n.shape[0] // WALKS
    blk = tl.reshape(tile_ids(table_ptr, ids, page0, n, kv_hi, BLOCK_SIZE, PAGES), (WALKS, sub))
    n2 = tl.reshape(n, (WALKS, sub))
    offs_w = tl.arange(0, HEAD_DIM // 4)[None, None, :]
    ok = (n2 < kv_hi)[:, :, None]
    within = (n2 % BLOCK_SIZE).to(tl.int64)[:, :, None]
    blk = blk[:, :, None]
    k_ptrs = k_base.to(tl.pointer_type(tl.int32)) + blk * (stride_kb // 4) + within * (stride_kt // 4)
    v_ptrs = v_base.to(tl.pointer_type(tl.int32)) + blk * (stride_vb // 4) + within * (stride_vt // 4)
    return tl.load(k_ptrs + offs_w, mask=ok, other=0), tl.load(v_ptrs + offs_w, mask=ok, other=0)


@triton.jit
def attend_range_walks(
    q, m_i, l_i, acc, k_base, v_base, table_ptr, kv_lo, kv_hi, limit, qk_scale, stride_kb, stride_kt,
    stride_vb, stride_vt, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, PAGES: tl.constexpr, lower, WINDOWED: tl.constexpr,
    WALKS: tl.constexpr,
):  # fmt: skip
    """``attend_range_fetched`` with each tile cut into WALKS runs of BLOCK_N / WALKS tokens, each run
    the next stretch of its own walk: batched products over the walks put one a warp, so a row's
    softmax is reduced within a warp and P stays in its registers, and the walks' (m, l, acc) are
    merged once at the end (with the incoming state)."""
    sub: tl.constexpr = BLOCK_N // WALKS
    page0 = kv_lo // BLOCK_SIZE
    ids = page0  # unused where PAGES == 0
    if PAGES > 0:
        offs_p = tl.arange(0, PAGES)
        ids = tl.load(table_ptr + page0 + offs_p, mask=(page0 + offs_p) * BLOCK_SIZE < kv_hi, other=0)
    rows: tl.constexpr = q.shape[0]
    q3 = tl.broadcast_to(q[None, :, :], (WALKS, rows, HEAD_DIM))
    m3 = tl.full((WALKS, rows), float("-inf"), tl.float32)
    l3 = tl.zeros((WALKS, rows), tl.float32)
    acc3 = tl.zeros((WALKS, rows, HEAD_DIM), tl.float32)
    n = kv_lo + tl.arange(0, BLOCK_N)
    k, v = fetch_walk_words(
        k_base, v_base, table_ptr, ids, page0, n, kv_hi, stride_kb, stride_kt, stride_vb, stride_vt,
        BLOCK_SIZE, HEAD_DIM, PAGES, WALKS,
    )  # fmt: skip
    for start in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=1):
        n = start + tl.arange(0, BLOCK_N)
        k_next, v_next = fetch_walk_words(
            k_base, v_base, table_ptr, ids, page0, n + BLOCK_N, kv_hi, stride_kb, stride_kt, stride_vb,
            stride_vt, BLOCK_SIZE, HEAD_DIM, PAGES, WALKS,
        )  # fmt: skip
        kw = widened_words(k, q.dtype)
        if UPCAST:
            s = tl.dot(q3.to(tl.float32), tl.permute(kw.to(tl.float32), (0, 2, 1)), input_precision="ieee")
        else:
            s = tl.dot(q3, tl.permute(kw, (0, 2, 1)), input_precision=DOT_PREC)
        n3 = tl.reshape(n, (WALKS, sub))[:, None, :]
        visible = (n3 < limit[None, :, None]) & (n3 < kv_hi)
        if WINDOWED:
            visible = visible & (n3 >= lower[None, :, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m3, tl.max(s, 2) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m3 - m_safe)
        p = tl.exp2(s * qk_scale - m_safe[:, :, None])
        l3 = l3 * alpha + tl.sum(p, 2)
        m3 = m_new
        vw = widened_words(v, q.dtype)
        acc3 = acc3 * alpha[:, :, None]
        if UPCAST:
            acc3 = tl.dot(p.to(vw.dtype).to(tl.float32), vw.to(tl.float32), acc3, input_precision="ieee")
        else:
            acc3 = tl.dot(p.to(vw.dtype), vw, acc3, input_precision=DOT_PREC)
        k, v = k_next, v_next
    m_all = tl.maximum(tl.max(m3, 0), m_i)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w3 = tl.exp2(m3 - m_safe[None, :])
    w_in = tl.exp2(m_i - m_safe)
    l_i = l_i * w_in + tl.sum(l3 * w3, 0)
    acc = acc * w_in[:, None] + tl.sum(acc3 * w3[:, :, None], 0)
    return m_all, l_i, acc


@triton.jit
def attend_range_ahead(
    q, m_i, l_i, acc, k_base, v_base, table_ptr, kv_lo, kv_hi, limit, qk_scale, stride_kb, stride_kt,
    stride_vb, stride_vt, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, PAGES: tl.constexpr,
):  # fmt: skip
    """``attend_range`` with the run's block ids read in one load before its first tile, PAGES of them
    (the caller's bound: PAGES >= the blocks [kv_lo, kv_hi) spans). Each tile picks its ids out of
    registers, so its K / V loads wait on no table load of their own and the software pipeline can
    issue them further ahead (a B=1 decode's splits walk hundreds of tokens: docs/kernels.md §6)."""
    if fetches_ahead(q, k_base):
        return attend_range_fetched(
            q, m_i, l_i, acc, k_base, v_base, table_ptr, kv_lo, kv_hi, limit, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, PAGES, limit, False, 1,
        )  # fmt: skip
    page0 = kv_lo // BLOCK_SIZE
    offs_p = tl.arange(0, PAGES)
    ids = tl.load(table_ptr + page0 + offs_p, mask=(page0 + offs_p) * BLOCK_SIZE < kv_hi, other=0)
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(kv_lo, kv_hi, BLOCK_N):
        n = start + offs_n
        # a gather: 6% faster than a compare-and-sum pick (H200, 4K)
        blk = tile_ids(table_ptr, ids, page0, n, kv_hi, BLOCK_SIZE, PAGES)
        m_i, l_i, acc = attend_blocks(
            q, m_i, l_i, acc, k_base, v_base, blk, n, kv_hi, limit, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, True, limit, False,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def attend_tile(
    q, m_i, l_i, acc, k_base, v_base, table_ptr, start, kv_hi, limit, qk_scale, stride_kb, stride_kt,
    stride_vb, stride_vt, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr, lower, WINDOWED: tl.constexpr,
):  # fmt: skip
    """One KV tile, tokens [start, start + BLOCK_N) less those at or past kv_hi (``attend_range``'s step)."""
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        blk = tl.load(table_ptr + n // BLOCK_SIZE, mask=n < kv_hi, other=0).to(tl.int64)
    else:
        blk = tl.load(table_ptr + n // BLOCK_SIZE).to(tl.int64)
    return attend_blocks(
        q, m_i, l_i, acc, k_base, v_base, blk, n, kv_hi, limit, qk_scale, stride_kb, stride_kt, stride_vb,
        stride_vt, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, MASKED, lower, WINDOWED,
    )  # fmt: skip


@triton.jit
def attend_blocks(
    q, m_i, l_i, acc, k_base, v_base, blk, n, kv_hi, limit, qk_scale, stride_kb, stride_kt, stride_vb,
    stride_vt, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, MASKED: tl.constexpr, lower, WINDOWED: tl.constexpr,
):  # fmt: skip
    """``attend_tile`` for tokens n [BLOCK_N] whose blocks ``blk`` (int64) are already known."""
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        n_ok = n < kv_hi
    within = (n % BLOCK_SIZE).to(tl.int64)
    k_ptrs = k_base + blk[:, None] * stride_kb + within[:, None] * stride_kt + offs_d[None, :]
    if MASKED:  # noqa: SIM108 (a constexpr branch: no masks compiled in)
        k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    p, alpha, m_i, l_i = tile_softmax(
        q, widened_kv(k, q.dtype), m_i, l_i, n, kv_hi, limit, qk_scale, DOT_PREC, UPCAST, MASKED, lower,
        WINDOWED,
    )  # fmt: skip
    v_ptrs = v_base + blk[:, None] * stride_vb + within[:, None] * stride_vt + offs_d[None, :]
    if MASKED:  # noqa: SIM108
        v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    v = widened_kv(v, q.dtype)
    acc = accumulate_pv(acc, alpha, p, v, DOT_PREC, UPCAST)
    return m_i, l_i, acc


@triton.jit
def tile_softmax(
    q, k, m_i, l_i, n, kv_hi, limit, qk_scale, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr, lower, WINDOWED: tl.constexpr,
):  # fmt: skip
    """A tile's scores against its widened keys k, masked where MASKED (tokens n at or past kv_hi or
    ``limit``, or before ``lower`` where WINDOWED), and their online-softmax step."""
    s = qk_scores(q, k, DOT_PREC, UPCAST)
    if MASKED:
        visible = (n[None, :] < limit[:, None]) & (n[None, :] < kv_hi)
        if WINDOWED:
            visible = visible & (n[None, :] >= lower[:, None])
        s = tl.where(visible, s, float("-inf"))
    return softmax_step(s, m_i, l_i, qk_scale)


@triton.jit
def attend_two_runs(
    q, m_i, l_i, acc, k_base, v_base, table_ptr, lo1, hi1, lo2, hi2, limit, lower, qk_scale, stride_kb,
    stride_kt, stride_vb, stride_vt, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Tokens [lo1, hi1) then [lo2, hi2) of a paged run in one pipelined loop (a sliding row's walk
    around its shared run): two loops would drain the pipeline between them, where the first run is
    a tile or two."""
    tiles1 = tl.cdiv(tl.maximum(hi1 - lo1, 0), BLOCK_N)
    tiles2 = tl.cdiv(tl.maximum(hi2 - lo2, 0), BLOCK_N)
    for i in tl.range(0, tiles1 + tiles2):
        first = i < tiles1
        start = tl.where(first, lo1 + i * BLOCK_N, lo2 + (i - tiles1) * BLOCK_N)
        end = tl.where(first, hi1, hi2)
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_base, v_base, table_ptr, start, end, limit, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DOT_PREC, UPCAST, True, lower, True,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def finish_rows(m_i, l_i, acc):
    """(o, natural-log lse) of a tile; rows that saw nothing give o = 0, lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return o, lse
