"""A packed token bitmask applied to a step's logits in one kernel (a grammar's mask, before sampling).

The bitmask is xgrammar's int32 [rows, ceil(vocab / 32)], bit ``t % 32`` of word ``t // 32`` set where
token ``t`` is allowed; disallowed logits become -inf in place. In torch that is an unpacking into
[rows, words, 32], a compare and a masked fill (and, for some rows only, an index select and copy):
four to six launches on the host's critical path of a constrained step, whose sampling waits for its
mask. Here one program unpacks a block of words and stores -inf at the blocked tokens only; some rows
are picked by a device index. The launch is recorded once per shape and relaunched
(``triton_support/bound.py``): a few microseconds of host time. The torch form is the fallback (CPU,
no Triton) and the tests' second opinion.
"""

from __future__ import annotations

import functools

import torch

BLOCK_WORDS = 64  # mask words a program unpacks (2,048 tokens)
_SHIFTS: dict[torch.device, torch.Tensor] = {}


@functools.cache
def _kernel():
    """(triton, the kernel bound for relaunches: ``triton_support.bound``), made at the first use (the
    engine imports no Triton kernel until a step needs one)."""
    from prefixserve.triton_support import require_triton
    from prefixserve.triton_support.bound import BoundKernel

    triton, tl = require_triton()

    @triton.jit
    def apply_token_mask(
        logits_ptr, mask_ptr, index_ptr, stride_l, stride_m, vocab,
        HAS_INDEX: tl.constexpr, BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        if HAS_INDEX:
            row = tl.load(index_ptr + tl.program_id(0)).to(tl.int64)
        else:
            row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        # (a gated step's mask is pinned host memory another process fills, read after the wait
        # kernel: plain loads too; volatile ones, a 32-bit PCIe read each, cost a small model's step
        # 0.8 ms, docs/kernels.md §2.15)
        words = tl.load(mask_ptr + row * stride_m + offs, mask=offs * 32 < vocab, other=-1)
        bit = tl.arange(0, 32)
        tok = offs[:, None] * 32 + bit[None, :]
        blocked = ((words[:, None] >> bit[None, :]) & 1) == 0  # arithmetic shift: bit 31 too
        tl.store(logits_ptr + row * stride_l + tok, float("-inf"), mask=blocked & (tok < vocab))

    return triton, BoundKernel(apply_token_mask)


def blocked_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab], True where the token is not allowed (torch: unpack, compare)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return (bits == 0).view(bitmask.shape[0], bitmask.shape[1] * 32)[:, :vocab]


@torch.inference_mode()  # the logits are inference tensors: updating them in place needs the mode
def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor | None) -> None:
    """Rows ``index`` (a device int64 tensor; None: every row of ``logits``) of ``logits`` keep only
    the tokens the same rows of ``bitmask`` allow; both on the same device, nothing waits for the host."""
    from prefixserve.triton_support import triton_available

    if logits.is_cuda and logits.stride(1) == 1 and bitmask.stride(1) == 1 and triton_available():
        kernel_token_mask(logits, bitmask, index)
        return
    vocab = logits.shape[-1]
    if index is None:
        logits.masked_fill_(blocked_tokens(bitmask[: logits.shape[0]], vocab), float("-inf"))
        return
    picked = logits.index_select(0, index)
    picked.masked_fill_(blocked_tokens(bitmask.index_select(0, index), vocab), float("-inf"))
    logits.index_copy_(0, index, picked)


def kernel_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor | None) -> None:
    """``apply_token_mask`` by the kernel (on CUDA, or on the CPU under the Triton interpreter); the
    rows' last dimension contiguous. ``bitmask`` may be pinned host memory (``structured/gate.py``)."""
    rows = logits.shape[0] if index is None else index.shape[0]
    if rows == 0:
        return
    triton, kernel = _kernel()
    words = bitmask.shape[1]
    index_arg = index if index is not None else bitmask  # no index: never read, any aligned tensor
    kernel(
        (rows, triton.cdiv(words, BLOCK_WORDS)), logits, bitmask, index_arg, logits.stride(0),
        bitmask.stride(0), logits.shape[1], HAS_INDEX=index is not None, BLOCK_W=BLOCK_WORDS,
        num_warps=4,
    )  # fmt: skip


__all__ = ["apply_token_mask", "blocked_tokens", "kernel_token_mask"]
