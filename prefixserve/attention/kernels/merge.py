"""LSE merge: combine partial attention outputs of one query row into the exact full attention.

Attention over a partition of the KV is exact once the parts are merged with their log-sum-exps
(docs/architecture.md): with ``m = max_i lse_i``,
``o = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m)`` and ``lse = m + log(sum_i exp(lse_i - m))``.
A part that saw no key has ``lse = -inf`` and adds nothing; a row whose parts are all empty outputs
zeros with ``lse = -inf`` (the max is guarded, so ``-inf - -inf`` never turns into NaN).

Two ways to name a row's parts:
  * regular: row ``t`` has ``num_parts`` parts at slots ``t + k * part_stride`` (split-KV of one kernel);
  * CSR: row ``t`` has parts ``part_idx[row_ptr[t]:row_ptr[t+1]]`` (own splits + any number of segments).
``merge_last`` is the paged decode kernel's own merge of its splits, run by their last program.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from prefixserve.triton_support import require_triton
from prefixserve.triton_support.launch import Launch, record

triton, tl = require_triton()


# Elements of o a merge program combines per part (heads x head_dim). One program per row took
# 16-25 us for 256-1024 rows of 32 x 128 on the H200, several times the bytes' time: a program walks
# its parts one load after another, so more, smaller programs keep more loads in flight.
MERGE_ELEMENTS = 1024


@triton.jit(do_not_specialize=["num_parts", "part_stride"])  # per-step values (compile_watch)
def _merge_kernel(
    o_part_ptr,  # [P, H, D] fp32
    lse_part_ptr,  # [P, H] fp32
    row_ptr_ptr,  # [T+1] int32 (CSR mode)
    part_idx_ptr,  # [nnz] int32 (CSR mode)
    out_ptr,  # [T, H, D] any float dtype
    out_lse_ptr,  # [T, H] fp32
    num_parts,  # regular mode: parts per row
    part_stride,  # regular mode: slot distance between a row's parts
    stride_pp,
    stride_ph,
    stride_lp,
    stride_ot,
    stride_oh,
    stride_lt,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    REGULAR: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    row = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_mask = offs_h < NUM_HEADS
    if REGULAR:
        first = 0
        count = num_parts
    else:
        first = tl.load(row_ptr_ptr + row)
        count = tl.load(row_ptr_ptr + row + 1) - first

    # one pass with a running max (as flash attention does over keys): a part's lse and o are loaded
    # together, so a row waits for memory count times, not 2 x count as with a max pass first
    # (measured 5-8% faster over 64-1024 rows of 32 x 128; docs/kernels.md §2.6)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    for i in range(0, count):
        slot = row + i * part_stride if REGULAR else tl.load(part_idx_ptr + first + i)
        slot = slot.to(tl.int64)
        lse = tl.load(lse_part_ptr + slot * stride_lp + offs_h, mask=h_mask, other=float("-inf"))
        o = tl.load(
            o_part_ptr + slot * stride_pp + offs_h[:, None] * stride_ph + offs_d[None, :],
            mask=h_mask[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no part yet: alpha and w stay 0
        alpha = tl.exp2((m - m_use) * 1.4426950408889634)
        w = tl.exp2((lse - m_use) * 1.4426950408889634)  # exp2(-inf) = 0 drops empty parts exactly
        acc = acc * alpha[:, None] + o * w[:, None]
        denom = denom * alpha + w
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    empty = denom == 0.0
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    row64 = row.to(tl.int64)
    tl.store(
        out_ptr + row64 * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None],
    )
    if WRITE_LSE:
        lse_out = tl.where(
            empty, float("-inf"), m_safe + tl.log2(tl.where(empty, 1.0, denom)) * 0.6931471805599453
        )
        tl.store(out_lse_ptr + row64 * stride_lt + offs_h, lse_out, mask=h_mask)


def csr_by_row(part_rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The merge CSR of partial slots: ``part_rows[i]`` is the output row of slot i.

    Returns (row_ptr [num_rows + 1], order): row t's slots are ``order[row_ptr[t]:row_ptr[t+1]]``,
    in slot order (int64, host; callers pack them for the device).
    """
    order = np.argsort(part_rows, kind="stable")
    row_ptr = np.zeros(num_rows + 1, dtype=np.int64)
    row_ptr[1:] = np.cumsum(np.bincount(part_rows, minlength=num_rows))
    return row_ptr, order


def _check_parts(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[int, int, int]:
    if o_part.dtype != torch.float32 or lse_part.dtype != torch.float32:
        raise TypeError("partials must be fp32 (o and lse)")
    if o_part.dim() != 3 or lse_part.shape != o_part.shape[:2]:
        raise ValueError(f"o_part {tuple(o_part.shape)} must be [P, H, D] and lse_part [P, H]")
    _, heads, dim = o_part.shape
    if o_part.stride(2) != 1 or lse_part.stride(1) != 1:
        raise ValueError("partials need a contiguous last dimension (o: D, lse: H)")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"head_dim {dim} must be a power of two >= 16")
    return o_part.shape[0], heads, dim


def merge_partials(
    o_part: torch.Tensor,  # [P, H, D] fp32
    lse_part: torch.Tensor,  # [P, H] fp32
    num_rows: int,
    *,
    row_ptr: torch.Tensor | None = None,  # [T+1] int32 (CSR)
    part_idx: torch.Tensor | None = None,  # [nnz] int32 (CSR)
    num_parts: int | None = None,  # regular: parts per row
    part_stride: int | None = None,  # regular: default num_rows
    out: torch.Tensor | None = None,  # [T, H, D]; written in place when given
    out_dtype: torch.dtype = torch.float32,
    out_lse: torch.Tensor | None = None,  # [T, H] fp32
    want_lse: bool = True,
    launches: list[Launch] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge each row's partials; returns (o [T, H, D], lse [T, H] fp32 natural log, or None).

    ``launches``, when given, receives the recorded launch (arg 4 is ``out``) so that later layers of
    a step can ``relaunch`` it without Triton's per-call binding cost.
    """
    _, heads, dim = _check_parts(o_part, lse_part)
    regular = row_ptr is None
    if regular:
        if num_parts is None:
            raise ValueError("give either row_ptr + part_idx (CSR) or num_parts (regular)")
        part_stride = num_rows if part_stride is None else part_stride
    else:
        if part_idx is None or row_ptr.dtype != torch.int32 or part_idx.dtype != torch.int32:
            raise TypeError("CSR merge needs int32 row_ptr and part_idx")
        if row_ptr.numel() != num_rows + 1:
            raise ValueError(f"row_ptr has {row_ptr.numel()} entries, expected {num_rows + 1}")
    if out is None:
        out = torch.empty(num_rows, heads, dim, dtype=out_dtype, device=o_part.device)
    if out.shape != (num_rows, heads, dim) or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be [{num_rows}, {heads}, {dim}], last dim contiguous")
    if want_lse and out_lse is None:
        out_lse = torch.empty(num_rows, heads, dtype=torch.float32, device=o_part.device)
    if out_lse is not None and (out_lse.shape != (num_rows, heads) or out_lse.stride(1) != 1):
        raise ValueError("out_lse must be [T, H] fp32 with a contiguous last dim")
    if num_rows == 0:
        return out, out_lse
    dummy = row_ptr if row_ptr is not None else torch.zeros(1, dtype=torch.int32, device=o_part.device)
    args = (
        o_part,
        lse_part,
        dummy if regular else row_ptr,
        dummy if regular else part_idx,
        out,
        out_lse if out_lse is not None else lse_part,
        num_parts or 0,
        part_stride or 0,
        o_part.stride(0),
        o_part.stride(1),
        lse_part.stride(0),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0) if out_lse is not None else 0,
    )
    block_h = min(triton.next_power_of_2(heads), max(1, MERGE_ELEMENTS // dim))
    kw = {
        "NUM_HEADS": heads,
        "BLOCK_H": block_h,
        "HEAD_DIM": dim,
        "REGULAR": regular,
        "WRITE_LSE": out_lse is not None,
        "num_warps": 4,
    }
    grid = (num_rows, triton.cdiv(heads, block_h))
    compiled = _merge_kernel[grid](*args, **kw)
    if launches is not None:
        launches.append(record(_merge_kernel, grid, args, kw, compiled))
    return out, out_lse


def merge_partials_ref(
    o_parts: list[torch.Tensor],  # each [M, H, D]
    lse_parts: list[torch.Tensor],  # each [M, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: merge aligned partials elementwise (fp64 math), exact with -inf parts."""
    lse = torch.stack([x.double() for x in lse_parts])  # [K, M, H]
    o = torch.stack([x.double() for x in o_parts])  # [K, M, H, D]
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # exp(-inf) = 0
    denom = w.sum(0)
    out = (w[..., None] * o).sum(0) / torch.where(denom == 0, torch.ones_like(denom), denom)[..., None]
    lse_out = torch.where(denom == 0, torch.full_like(m, -math.inf), m_safe + torch.log(denom))
    return out, lse_out


@triton.jit
def merge_last(
    qsl_ptr,
    o_ptr,
    lse_ptr,
    out_ptr,
    out_lse_ptr,
    count_ptr,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_out_t,
    stride_out_h,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WANT_LSE: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """The last program of a (sequence, KV head) to finish merges its splits' partials into the output.

    At B = 1 a decode step is one sequence's KV cut into dozens of splits, and the merge as a second
    kernel cost about one launch and pass in a graph (docs/kernels.md, FlashInfer side by side). Each
    program counts itself in ``count_ptr`` after its partials are written (a barrier, then an
    acquire-release add); the one that finds every other counted reads the partials through L2 and
    writes the final rows, then sets the count back to zero for the next step or replay.

    One pass with a running max, in split order, as ``merge.py``'s kernel: a split's LSE and partial
    are loaded together, ``UNROLL`` splits a turn (independent loads the compiler issues together), so
    the tail that runs after the slowest split waits for L2 about splits / UNROLL times, not twice a
    split (a max pass, then a sum pass). Wider turns hold more partials in registers, which are the
    whole kernel's: every split program pays them in occupancy (docs/kernels.md §6)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    splits = tl.num_programs(2)
    slot = count_ptr + seq * tl.num_programs(1) + kvh
    tl.debug_barrier()  # every thread's partial stores issued before the count says so
    done = tl.atomic_add(slot, 1, sem="acq_rel")
    q_start = tl.load(qsl_ptr + seq)
    if (done == splits - 1) & (tl.load(qsl_ptr + seq + 1) > q_start):
        tok = q_start.to(tl.int64)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        g_ok = offs_g < GROUP
        head = kvh * GROUP + offs_g
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for s0 in range(0, splits, UNROLL):
            for j in tl.static_range(UNROLL):
                s = s0 + j
                ok = g_ok & (s < splits)
                lse_s = tl.load(
                    lse_ptr + s * stride_ls + tok * stride_lt + head, mask=ok, other=float("-inf"),
                    cache_modifier=".cg",
                )  # fmt: skip
                part = tl.load(
                    o_ptr + s * stride_os + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                    mask=ok[:, None], other=0.0, cache_modifier=".cg",
                )  # fmt: skip
                m_new = tl.maximum(m, lse_s)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no part yet: alpha and w stay 0
                alpha = tl.exp2((m - m_use) * 1.4426950408889634)
                w = tl.exp2((lse_s - m_use) * 1.4426950408889634)  # exp2(-inf) = 0: empty parts add 0
                acc = acc * alpha[:, None] + part * w[:, None]
                denom = denom * alpha + w
                m = m_new
        o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(
            out_ptr + tok * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None],
        )  # fmt: skip
        if WANT_LSE:
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            lse = tl.where(denom > 0, m_safe + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf"))
            q_heads = tl.num_programs(1) * GROUP  # the final LSE is a contiguous [T, Hq]
            tl.store(out_lse_ptr + tok * q_heads + head, lse, mask=g_ok)
    if done == splits - 1:
        tl.atomic_xchg(slot, 0)


__all__ = ["merge_last", "merge_partials", "merge_partials_ref"]
