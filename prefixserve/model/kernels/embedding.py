"""A vocabulary shard's embedding lookup, written where the ranks' sum will read it: one kernel.

Under tensor parallelism each rank holds the embedding rows of its vocabulary span; a token outside
it looks up zeros here and its row on the rank that holds it, and the ranks' lookups are summed. The
torch path is two compares, an and, a where, a subtract, the lookup and a multiply by the mask (eight
launches at decode sizes), then a copy into the all-reduce buffer. Here one program per token reads
its row (or writes zeros) straight into the buffer the sum reads: at two ranks a product slot that
the first layer's norm sums over NVLink (``peer_allreduce.PeerSum``).
"""

from __future__ import annotations

import torch

from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, tl = require_triton()

BLOCK = 1024  # columns per program


@triton.jit
def _shard_embedding_kernel(
    ids_ptr,  # [T] token ids over the whole vocabulary
    weight_ptr,  # [V_shard, N] this rank's rows
    out_ptr,  # [T, N]
    start,  # the first vocabulary id this rank holds
    shard_rows,  # V_shard
    stride_w,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    local = tl.load(ids_ptr + row).to(tl.int64) - start
    mine = (local >= 0) & (local < shard_rows)
    local = tl.where(mine, local, 0)
    vals = tl.load(weight_ptr + local * stride_w + cols, mask=mask & mine, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, vals.to(out_ptr.dtype.element_ty), mask=mask)


_bound = BoundKernel(_shard_embedding_kernel)


def shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, out: torch.Tensor) -> torch.Tensor:
    """``out[t] = weight[ids[t] - start]`` where this shard holds the id, else zeros; returns ``out``."""
    tokens = ids.shape[0]
    rows, n = weight.shape
    if ids.dim() != 1 or out.shape != (tokens, n) or out.dtype != weight.dtype:
        raise ValueError(
            f"ids {tuple(ids.shape)} and out {tuple(out.shape)} {out.dtype} must be [T] and "
            f"[T, {n}] {weight.dtype}"
        )
    if weight.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("shard_embedding needs contiguous rows")
    if tokens:
        _bound(
            (tokens, triton.cdiv(n, BLOCK)),
            ids,
            weight,
            out,
            start,
            rows,
            weight.stride(0),
            out.stride(0),
            n,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out


def shard_embedding_ref(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Torch reference: the masked lookup of ``VocabParallelEmbedding``'s torch path."""
    local = ids - start
    mine = (local >= 0) & (local < weight.shape[0])
    return torch.nn.functional.embedding(torch.where(mine, local, 0), weight) * mine[:, None].to(weight.dtype)


__all__ = ["shard_embedding", "shard_embedding_ref"]
