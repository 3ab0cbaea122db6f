"""The greedy argmax's kernels (``argmax.py``), imported at their first use (they import Triton).

``chunk_argmax`` writes each chunk's (max, first index of it, first NaN), ``pick_rows`` each row's
winner; ``flagged_chunk_argmax`` is the first under a token bitmask in pinned host memory that another
process fills (a grammar's mask, ``structured/gate.py``), read once the fill's flag is set.
"""

from __future__ import annotations

from prefixserve.triton_support import require_triton
from prefixserve.triton_support.host_flag import wait_for_word

triton, tl = require_triton()


@triton.jit
def take(v, idx, best, best_i, first_nan, vocab, NONE: tl.constexpr):
    """A block's logits ``v`` at ``idx`` into the lanes' (max, first index of it, first NaN)."""
    nan = v != v
    first_nan = tl.where(nan & (first_nan == NONE), idx, first_nan)
    better = v > best  # strict: each lane keeps the first index of its maximum
    best_i = tl.where(better | ((best_i == NONE) & (idx < vocab)), idx, best_i)
    best = tl.where(better, v, best)
    return best, best_i, first_nan


@triton.jit
def store_chunk(best, best_i, first_nan, out, max_ptr, idx_ptr, nan_ptr, NONE: tl.constexpr):
    """The chunk's (max, first index of it, first NaN) from its lanes', at ``out``."""
    top = tl.max(best)
    tl.store(max_ptr + out, top)
    tl.store(idx_ptr + out, tl.min(tl.where(best == top, best_i, NONE)))
    tl.store(nan_ptr + out, tl.min(first_nan))


@triton.jit
def chunk_argmax(
    x_ptr,
    stride_x,
    vocab,
    chunk,
    max_ptr,
    idx_ptr,
    nan_ptr,
    splits,
    BLOCK: tl.constexpr,
    NONE: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo = part * chunk
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], NONE, tl.int32)
    first_nan = tl.full([BLOCK], NONE, tl.int32)
    base = x_ptr + row.to(tl.int64) * stride_x
    for start in range(lo, tl.minimum(lo + chunk, vocab), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        v = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        best, best_i, first_nan = take(v, idx, best, best_i, first_nan, vocab, NONE)
    store_chunk(best, best_i, first_nan, row * splits + part, max_ptr, idx_ptr, nan_ptr, NONE)


@triton.jit(do_not_specialize=["number", "limit"])
def flagged_chunk_argmax(
    x_ptr, stride_x, vocab, chunk, max_ptr, idx_ptr, nan_ptr, splits,
    words_ptr, stride_w, masked_rows, flag_ptr, number, limit, seen_ptr, late_ptr, spins_ptr, go_ptr,
    BLOCK: tl.constexpr, NONE: tl.constexpr, TIMED: tl.constexpr,
):  # fmt: skip
    """``chunk_argmax`` over the logits that rows ``< masked_rows`` of the host bitmask allow, once
    the host flag holds ``number``: program 0 waits for it and passes its verdict to the others
    through ``go`` (device memory: one program polls the host, not thousands)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    masked = row < masked_rows
    if (row == 0) & (part == 0):
        flag, spins = wait_for_word(flag_ptr, number, limit, TIMED)
        tl.store(seen_ptr, flag)
        tl.store(spins_ptr, spins)
        tl.store(go_ptr, tl.where(flag == number, number, -number))
    elif masked:  # program 0 runs first (the lowest block index); bounded all the same
        go, _ = wait_for_word(go_ptr, number, limit.to(tl.int64) * 2, TIMED)  # (an i32 limit would wrap)
        if (go != number) & (go != -number):
            tl.store(late_ptr, 1)  # masked by a slot whose fill it never saw: ``check`` fails it
    WORDS: tl.constexpr = BLOCK // 32
    w = tl.arange(0, WORDS)
    bit = tl.arange(0, 32)
    lo = part * chunk
    best = tl.full([WORDS, 32], float("-inf"), tl.float32)
    best_i = tl.full([WORDS, 32], NONE, tl.int32)
    first_nan = tl.full([WORDS, 32], NONE, tl.int32)
    base = x_ptr + row.to(tl.int64) * stride_x
    words_row = words_ptr + row.to(tl.int64) * stride_w
    for start in range(lo, tl.minimum(lo + chunk, vocab), BLOCK):
        word = start // 32 + w
        idx = word[:, None] * 32 + bit[None, :]
        v = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        # plain loads, issued only after the verdict (the polls are volatile): volatile word loads
        # (``ld.volatile``, one 32-bit PCIe read each) took the 135M shape's ratio from 0.905 to 0.685
        allowed = tl.load(words_row + word, mask=masked & (word * 32 < vocab), other=-1)
        v = tl.where(((allowed[:, None] >> bit[None, :]) & 1) == 0, float("-inf"), v)
        best, best_i, first_nan = take(v, idx, best, best_i, first_nan, vocab, NONE)
    store_chunk(best, best_i, first_nan, row * splits + part, max_ptr, idx_ptr, nan_ptr, NONE)


@triton.jit
def pick_rows(max_ptr, idx_ptr, nan_ptr, out_ptr, splits, SPLITS: tl.constexpr, NONE: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, SPLITS)
    ok = parts < splits
    m = tl.load(max_ptr + row * splits + parts, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * splits + parts, mask=ok, other=NONE)
    n = tl.min(tl.load(nan_ptr + row * splits + parts, mask=ok, other=NONE), 0)
    top = tl.max(m, 0)
    winner = tl.min(tl.where(m == top, i, NONE), 0)
    tl.store(out_ptr + row, tl.where(n < NONE, n, winner).to(tl.int64))


__all__ = ["chunk_argmax", "flagged_chunk_argmax", "pick_rows"]
