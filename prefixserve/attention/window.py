"""Attention of a sliding-window layer: query i of a sequence sees its keys j with i - window < j <= i.

Indices are cache indices, as causality is (``metadata.py``). A query reads at most ``window`` keys, so
a sequence's blocks wholly behind its first query's window are never touched, whatever its length.
In a decode step whose backend planned shared segments, the segments that lie wholly inside their
holders' windows are read once for all of them (``planning/window_plan.py``), as in a full layer; a segment
behind a window is skipped for that row, one across the window's start is masked by the row's walk.
On CUDA the Triton kernels run it (``kernels/window_attention.py``); elsewhere, and for steps holding
Prompt Cache module blocks (holes to skip), the torch path below does, one sequence at a time, fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.attention.graph import WindowedGraphAttention
from prefixserve.attention.kv_quant import turn_query, unfold_output
from prefixserve.attention.merge import scatter_merge_
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.window_plan import WindowPlan, window_plan


def attend_layer(
    backend: Any,  # AttentionBackend
    q: torch.Tensor,  # [T, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # a sliding layer's window; None: a full layer
    sinks: torch.Tensor | None = None,  # [q_heads]: gpt-oss's per-head sink logits
    kv_scales: torch.Tensor | None = None,  # [2, kv_heads] fp32: an e4m3 cache's K and V scales
    q_turned: bool = False,  # q already turned and times K's scales (``fused.rope_qkv``'s)
) -> torch.Tensor:  # [T, q_heads, head_dim]
    """One layer's attention: the backend's ``forward``, or for a sliding layer whose window the step's
    longest sequence outgrows, attention within the window. A window that covers every sequence masks
    nothing, so the layer keeps the backend's shared-segment path, unless the layer reads a sliding
    group's pages (the backend's plan names the block table's).

    Over an e4m3 cache with ``kv_scales``: q times K's scales before, the output times V's after
    (``kv_quant.turn_query``, unless ``q_turned``: the RoPE kernel that wrote the layer's K turned q
    too), so every path reads the stored values as they are."""
    if kv_scales is not None:  # K is stored rotated: q turns with it (``kv_quant.rotate``)
        q = q if q_turned else turn_query(q, kv_scales[0])
        out = _attend_layer(backend, q, k_cache, v_cache, meta, scale, window, sinks)
        return unfold_output(out, kv_scales[1])
    return _attend_layer(backend, q, k_cache, v_cache, meta, scale, window, sinks)


def _attend_layer(
    backend: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``attend_layer`` over the values the cache holds."""
    if sinks is not None:
        return attend_with_sinks(backend, q, k_cache, v_cache, meta, scale, window, sinks)
    if window is not None and isinstance(backend, WindowedGraphAttention):  # inside a decode graph
        return backend.window_forward(q, k_cache, v_cache, meta, scale, window)
    if covers_every_sequence(window, meta):
        return backend.forward(q, k_cache, v_cache, meta, scale)
    return window_attention(q, k_cache, v_cache, meta, scale, window)


def covers_every_sequence(window: int | None, meta: AttentionMetadata) -> bool:
    """Does the layer's window (None: a full layer) mask nothing this step, and read the block table's
    pages (no sliding group's)? Then the backend's own path attends it."""
    return window is None or (window >= meta.max_seq_len and meta.full is None)


def attend_with_sinks(
    backend: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    sinks: torch.Tensor,  # [q_heads]
) -> torch.Tensor:
    """Attention with a sink per head: a logit beside the keys that takes its share of the softmax
    and adds nothing, so ``o_sinks = o * e^lse / (e^lse + e^sink) = o * sigmoid(lse - sink)`` from
    the attention's own output and log-sum-exp (``forward_with_lse``: the torch backends', the Triton
    ones' final merge or kernel; a sliding layer's walk and merge alike)."""
    if covers_every_sequence(window, meta):
        o, lse = backend.forward_with_lse(q, k_cache, v_cache, meta, scale)
    else:
        o, lse = window_attention(q, k_cache, v_cache, meta, scale, window, with_lse=True)
    return (o.float() * torch.sigmoid(lse - sinks.float())[..., None]).to(q.dtype)


def window_attention(
    q: torch.Tensor,  # [T, q_heads, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    with_lse: bool = False,
) -> Any:  # [T, q_heads, D], q's dtype; with_lse: (o, lse [T, q_heads] fp32)
    holes = meta.has_module_blocks()
    plan = None if holes else window_plan(meta, window)
    if q.is_cuda and not holes:
        from prefixserve.attention.kernels import window_attention as kernels

        if plan is not None:
            return kernels.window_shared_attention(q, k_cache, v_cache, meta, plan, scale, window, with_lse)
        return kernels.window_attention(q, k_cache, v_cache, meta, scale, window, with_lse)
    return window_attention_torch(q, k_cache, v_cache, meta, scale, window, plan, with_lse)


def window_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    plan: WindowPlan | None = None,
    with_lse: bool = False,
) -> Any:  # [T, q_heads, D] in q's dtype; with_lse: (o fp32, lse [T, q_heads])
    """The reference: per sequence, the keys its queries' windows cover (less the run ``plan`` gives
    its segments), masked per row, fp32; then the plan's segments, merged by LSE."""
    t, q_heads, d = q.shape
    bs = meta.block_size
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    o_acc = torch.empty(t, q_heads, d, dtype=torch.float32, device=q.device)
    lse_acc = torch.empty(t, q_heads, dtype=torch.float32, device=q.device)
    start = 0
    for s, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        first_query = s_len - q_len
        keys = torch.arange(max(0, first_query - window + 1), s_len, device=q.device)  # [N]
        if plan is not None and plan.skip_hi[s] > plan.skip_lo[s]:  # the segments' run is merged below
            keys = keys[(keys < int(plan.skip_lo[s])) | (keys >= int(plan.skip_hi[s]))]
        table = torch.as_tensor(meta.block_tables_host[s], dtype=torch.long, device=q.device)
        slots = table[keys // bs] * bs + keys % bs
        k = flat_k.index_select(0, slots).transpose(0, 1).float().repeat_interleave(group, 0)  # [Hq, N, D]
        v = flat_v.index_select(0, slots).transpose(0, 1).float().repeat_interleave(group, 0)
        queries = torch.arange(first_query, s_len, device=q.device)[:, None]  # [M, 1]
        visible = (keys[None, :] <= queries) & (keys[None, :] > queries - window)  # [M, N]
        valid = meta.valid_kv(s)  # False at the holes of partly filled module blocks
        if valid is not None:
            visible &= valid.to(q.device)[keys][None, :]
        qs = q[start : start + q_len].transpose(0, 1).float()  # [Hq, M, D]
        scores = (qs @ k.transpose(1, 2)) * scale  # [Hq, M, N]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [Hq, M]; -inf where nothing is visible
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        o_acc[start : start + q_len] = (torch.exp(scores - safe[..., None]) @ v).transpose(0, 1)
        lse_acc[start : start + q_len] = lse.transpose(0, 1)
        start += q_len
    if plan is not None:
        for g in range(plan.num_segments):
            rows = torch.from_numpy(plan.seg_rows[plan.seg_row_start[g] : plan.seg_row_start[g + 1]]).long()
            blocks = torch.from_numpy(plan.seg_blocks[plan.seg_block_start[g] : plan.seg_block_start[g + 1]])
            rows, blocks = rows.to(q.device), blocks.long().to(q.device)
            k = k_cache.index_select(0, blocks).flatten(0, 1).float()  # [N, Hkv, D]: the segment, once
            v = v_cache.index_select(0, blocks).flatten(0, 1).float()
            qs = q.index_select(0, rows).float().view(-1, kv_heads, group, d)  # [M, Hkv, G, D]
            scores = torch.einsum("mhgd,nhd->mhgn", qs, k) * scale
            lse = torch.logsumexp(scores, dim=-1)  # [M, Hkv, G]
            o = torch.einsum("mhgn,nhd->mhgd", torch.exp(scores - lse[..., None]), v)
            scatter_merge_(o_acc, lse_acc, rows, o.reshape(-1, q_heads, d), lse.reshape(-1, q_heads))
    return (o_acc, lse_acc) if with_lse else o_acc.to(q.dtype)
