"""Exact LSE merge of partial attention states (torch; CPU and GPU).

Attention of a query over its whole KV equals the merge of its attention over any partition of that
KV, weighted by each part's log-sum-exp (docs/architecture.md). With ``m = max_i lse_i``:
``o = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m)`` and ``lse = m + log(sum_i exp(lse_i - m))``.
A part that saw no key has ``lse = -inf`` and weight 0; when every part is empty the max is guarded
(``m = 0``), so the result is ``o = 0, lse = -inf`` and never NaN. Math is fp32 (or wider).
"""

from __future__ import annotations

import torch


def merge_attention_states(
    o_a: torch.Tensor,  # [M, H, D]
    lse_a: torch.Tensor,  # [M, H]
    o_b: torch.Tensor,  # [M, H, D]
    lse_b: torch.Tensor,  # [M, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two aligned partial states; returns (o [M, H, D], lse [M, H]) in fp32 (fp64 stays fp64)."""
    dtype = torch.promote_types(torch.promote_types(o_a.dtype, o_b.dtype), torch.float32)
    lse_a = lse_a.to(dtype)
    lse_b = lse_b.to(dtype)
    m = torch.maximum(lse_a, lse_b)  # [M, H]
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # both empty: keep exp() finite
    w_a = torch.exp(lse_a - m)  # exp(-inf) = 0 drops an empty part
    w_b = torch.exp(lse_b - m)
    denom = w_a + w_b  # [M, H]; 0 only when both parts are empty
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    o = (o_a.to(dtype) * (w_a / safe)[..., None]) + (o_b.to(dtype) * (w_b / safe)[..., None])
    lse = m + torch.log(denom)  # log(0) = -inf for an empty row
    return o, lse


def scatter_merge_(
    o_acc: torch.Tensor,  # [T, H, D] fp32 running outputs of every query row
    lse_acc: torch.Tensor,  # [T, H] fp32 running LSEs
    rows: torch.Tensor,  # [M] int: distinct rows of the accumulators that the part belongs to
    o_part: torch.Tensor,  # [M, H, D]
    lse_part: torch.Tensor,  # [M, H]
) -> None:
    """Fold one part (e.g. a shared segment's stacked rows) into the accumulators, in place.

    ``rows`` must not repeat (a segment's holders are distinct sequences): each row is read once,
    merged, and written back once.
    """
    rows = rows.to(device=o_acc.device, dtype=torch.long)
    o, lse = merge_attention_states(
        o_acc.index_select(0, rows), lse_acc.index_select(0, rows), o_part, lse_part
    )
    o_acc.index_copy_(0, rows, o.to(o_acc.dtype))
    lse_acc.index_copy_(0, rows, lse.to(lse_acc.dtype))


def merge_many(
    o_parts: list[torch.Tensor],  # each [M, H, D]
    lse_parts: list[torch.Tensor],  # each [M, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of aligned parts at once (one max, one weighted sum)."""
    if not o_parts:
        raise ValueError("merge_many needs at least one part")
    dtype = torch.promote_types(o_parts[0].dtype, torch.float32)
    lse = torch.stack([x.to(dtype) for x in lse_parts])  # [K, M, H]
    m = lse.max(dim=0).values
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)  # [K, M, H]
    denom = w.sum(0)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    o = sum(op.to(dtype) * (wi / safe)[..., None] for op, wi in zip(o_parts, w, strict=True))
    return o, m + torch.log(denom)
