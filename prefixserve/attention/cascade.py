"""Cascade attention in plain torch: shared segments once with stacked queries, own parts per sequence.

Per step (``prepare``) the plan finds the KV segments that several sequences hold; per layer
(``forward``) each segment is gathered once and attended by all its holders' query rows together
(GQA: a KV head's query heads are stacked as well, so one segment costs one [rows * group, N] product
per KV head), each sequence attends to the rest of its KV causally, and the parts are merged exactly
by their log-sum-exps. The same code serves decode, prefill chunks and mixed batches.

On CPU the kernel is torch's fused flash-attention op, which returns the LSE; elsewhere (or when the
op is missing) it is matmul + logsumexp in fp32, split over the KV so the score matrix stays small.
CPU shortcuts, each exact: a segment in consecutive blocks is attended in place in the cache (no
gathered copy per layer), a segment that every query row holds is merged without gathering and
scattering rows, and a prefill chunk's own part uses the op's causal rule instead of a mask tensor.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from prefixserve.attention.backend import AttentionBackend, register_backend
from prefixserve.attention.kv_quant import widen
from prefixserve.attention.merge import merge_attention_states, scatter_merge_
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.attention.planning.plan import SharedPlan, make_plan

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_MAX_SCORES = 1 << 24  # matmul path: score elements per KV chunk (64 MiB in fp32)
_GATHER_BYTES = 16 << 20  # KV bytes gathered per piece (K and V each); see attend_blocks


def attend(
    q: torch.Tensor,  # [B, H, M, D]
    k: torch.Tensor,  # [B, H, N, D]
    v: torch.Tensor,  # [B, H, N, D]
    scale: float,
    visible: torch.Tensor | None = None,  # [B, 1, M or 1, N] bool: key n visible to row m
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its LSE: (o [B, H, M, D] fp32, lse [B, H, M] fp32).

    A row that sees no key gets o = 0, lse = -inf (so an LSE merge ignores it).
    """
    q, k, v = q.float(), k.float(), v.float()
    if _CPU_FLASH is not None and q.device.type == "cpu" and k.shape[2] > 0:
        bias = None
        if visible is not None:
            bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
        o, lse = _CPU_FLASH(q, k, v, attn_mask=bias, scale=scale)
        if visible is not None:  # the fused op reports lse = 0 for a row with no visible key
            empty = ~visible.any(dim=-1)  # [B, 1, M or 1]
            lse = lse.masked_fill(empty, float("-inf"))
            o = o.masked_fill(empty[..., None], 0.0)
        return o, lse
    return _attend_matmul(q, k, v, scale, visible)


def _attend_matmul(
    q: torch.Tensor,  # [B, H, M, D] fp32
    k: torch.Tensor,  # [B, H, N, D] fp32
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,  # [B, 1, M or 1, N] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 matmul + logsumexp, KV split into chunks merged by LSE (bounds the score memory)."""
    b, h, m, _ = q.shape
    n = k.shape[2]
    chunk = max(1, min(n, _MAX_SCORES // max(1, b * h * m)))
    o_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((b, h, m), float("-inf"), dtype=torch.float32, device=q.device)
    for n0 in range(0, n, chunk):
        scores = torch.matmul(q, k[:, :, n0 : n0 + chunk].transpose(-1, -2)) * scale  # [B, H, M, n]
        if visible is not None:
            scores = scores.masked_fill(~visible[..., n0 : n0 + chunk], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, M]
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        o = torch.matmul(torch.exp(scores - safe[..., None]), v[:, :, n0 : n0 + chunk])
        if n0 == 0:
            o_acc, lse_acc = o, lse
        else:
            o_acc, lse_acc = merge_attention_states(o_acc, lse_acc, o, lse)
    return o_acc, lse_acc


def _stack_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[M, q_heads, D] -> [kv_heads, M * group, D]: a KV head's query heads become extra rows."""
    m, q_heads, d = q.shape
    return q.reshape(m, kv_heads, q_heads // kv_heads, d).transpose(0, 1).reshape(kv_heads, -1, d)


def _unstack_heads(o: torch.Tensor, lse: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``_stack_heads`` for o [kv_heads, M * group, D] and lse [kv_heads, M * group]."""
    kv_heads, rows, d = o.shape
    group = rows // m
    o = o.reshape(kv_heads, m, group, d).transpose(0, 1).reshape(m, kv_heads * group, d)
    lse = lse.reshape(kv_heads, m, group).transpose(0, 1).reshape(m, kv_heads * group)
    return o, lse


def _block_run(tables: torch.Tensor) -> int | None:
    """The first block when ``tables`` [1, nblk] (on the CPU) names consecutive blocks, else None.

    Long prompts get consecutive block ids (``BlockPool.allocate``), so a shared prefix is usually one
    row range of the cache, which attention can read in place instead of gathering a copy every layer.
    """
    if tables.shape[0] != 1 or tables.device.type != "cpu":
        return None
    ids = tables[0].numpy()
    first = int(ids[0])
    if int(ids[-1]) - first != len(ids) - 1 or (len(ids) > 2 and not bool((np.diff(ids) == 1).all())):
        return None
    return first


def _all_rows_in_order(rows: torch.Tensor, total: int) -> bool:
    """Are a segment's query rows (distinct, in [0, total)) every row of the step, in order (on the CPU)?

    Then its merge is a plain aligned merge, without gathering and scattering the accumulators' rows.
    """
    if rows.numel() != total or rows.device.type != "cpu":
        return False
    return total < 2 or bool((np.diff(rows.numpy()) > 0).all())


def attend_blocks(
    q: torch.Tensor,  # [B, kv_heads, M, D] (query heads of a KV head stacked into M)
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [B, nblk] long: the blocks each batch row attends to, in order
    scale: float,
    num_keys: torch.Tensor | None = None,  # [B] long: valid keys per row (the rest is masked and zeroed)
    visible: torch.Tensor | None = None,  # [B or 1, 1, M or 1, nblk * block_size] bool, extra mask
) -> tuple[torch.Tensor, torch.Tensor]:  # o [B, kv_heads, M, D] fp32, lse [B, kv_heads, M]
    """Attention over paged KV, gathered in pieces of at most ``_GATHER_BYTES`` and merged by LSE.

    Bounded pieces keep the gathered copies small enough for the allocator to reuse (fresh large
    allocations cost page faults that can dwarf the copy) and bound memory at any segment length.
    """
    nrows, nblk = tables.shape
    _, bs, kv_heads, d = k_cache.shape
    first = _block_run(tables) if num_keys is None else None
    if first is not None:  # one row over consecutive blocks: the cache rows themselves, no copy
        k = k_cache[first : first + nblk].view(1, nblk * bs, kv_heads, d)
        v = v_cache[first : first + nblk].view(1, nblk * bs, kv_heads, d)
        return attend(q, k.transpose(1, 2), v.transpose(1, 2), scale, visible)
    row_bytes = nrows * bs * kv_heads * d * k_cache.element_size()
    piece = max(1, _GATHER_BYTES // max(1, row_bytes))  # blocks per piece
    o_acc = lse_acc = None
    for j0 in range(0, nblk, piece):
        part = tables[:, j0 : j0 + piece]  # [B, nb]
        n = part.shape[1] * bs
        k = widen(k_cache.index_select(0, part.flatten()), q.dtype).view(nrows, n, kv_heads, d)
        v = widen(v_cache.index_select(0, part.flatten()), q.dtype).view(nrows, n, kv_heads, d)
        mask = None if visible is None else visible[..., j0 * bs : j0 * bs + n]
        if num_keys is not None:
            valid = torch.arange(j0 * bs, j0 * bs + n, device=q.device)[None, :] < num_keys[:, None]  # [B, n]
            if not bool(valid.all()):
                # slots past a row's end (a last block's tail, padding entries pointing at block 0) may
                # hold anything: zero them, so that masked keys never turn 0 * NaN into NaN
                tail = torch.nonzero(~valid.flatten()).flatten()
                k = k.view(-1, kv_heads, d).index_fill_(0, tail, 0.0).view(nrows, n, kv_heads, d)
                v = v.view(-1, kv_heads, d).index_fill_(0, tail, 0.0).view(nrows, n, kv_heads, d)
                valid = valid[:, None, None, :]
                mask = valid if mask is None else mask & valid
        o, lse = attend(q, k.transpose(1, 2), v.transpose(1, 2), scale, mask)
        if o_acc is None:
            o_acc, lse_acc = o, lse
        else:
            o_acc, lse_acc = merge_attention_states(o_acc, lse_acc, o, lse)
    assert o_acc is not None and lse_acc is not None, "attend_blocks needs at least one block"
    return o_acc, lse_acc


def segment_attention(
    q_rows: torch.Tensor,  # [M, q_heads, D] every holder's query rows, stacked
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [nblk] long: the segment's blocks, in order
    scale: float,
    num_tokens: int | None = None,  # KV rows, when the last block is a partly filled module block
) -> tuple[torch.Tensor, torch.Tensor]:  # o [M, q_heads, D] fp32, lse [M, q_heads]
    """One non-causal attention of all rows over a shared segment; its KV is read once."""
    qs = _stack_heads(q_rows, k_cache.shape[2])  # [kv_heads, M * group, D]
    keys = None
    if num_tokens is not None and num_tokens < blocks.numel() * k_cache.shape[1]:
        keys = torch.tensor([num_tokens], device=q_rows.device)
    o, lse = attend_blocks(qs[None], k_cache, v_cache, blocks[None], scale, keys)
    return _unstack_heads(o[0], lse[0], q_rows.shape[0])


def own_attention(
    q: torch.Tensor,  # [T, q_heads, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: SharedPlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, q_heads, D] fp32, lse [T, q_heads]
    """Each sequence over its own compacted table, causally; decode rows batched a few at a time."""
    t, q_heads, d = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    o_out = torch.empty(t, q_heads, d, dtype=torch.float32, device=q.device)
    lse_out = torch.empty(t, q_heads, dtype=torch.float32, device=q.device)
    starts = meta.query_start_loc.tolist()
    own_tables = plan.own_block_tables.to(q.device).long()  # [S, max_own_blocks]
    own_lens = plan.own_seq_lens.to(q.device).long()  # [S]
    decode = [s for s, n in enumerate(meta.query_lens_host) if n == 1]
    # one query per sequence: batch sequences (own tables padded to the batch's longest) so that a
    # batch's gathered KV stays near _GATHER_BYTES
    longest = max((plan.own_seq_lens_host[s] for s in decode), default=0)
    seq_bytes = max(1, longest * kv_heads * d * k_cache.element_size())
    per_batch = max(1, _GATHER_BYTES // seq_bytes)
    for i in range(0, len(decode), per_batch):
        seqs = decode[i : i + per_batch]
        idx = torch.tensor(seqs, dtype=torch.long, device=q.device)
        nblk = -(-max(plan.own_seq_lens_host[s] for s in seqs) // bs)
        rows = torch.tensor([starts[s] for s in seqs], dtype=torch.long, device=q.device)
        qd = q.index_select(0, rows).reshape(len(seqs), kv_heads, group, d)  # [nd, kvh, g, D]
        o, lse = attend_blocks(
            qd,
            k_cache,
            v_cache,
            own_tables.index_select(0, idx)[:, :nblk],
            scale,
            own_lens.index_select(0, idx),
        )
        o_out.index_copy_(0, rows, o.reshape(len(seqs), q_heads, d))
        lse_out.index_copy_(0, rows, lse.reshape(len(seqs), q_heads))
    for s, q_len in enumerate(meta.query_lens_host):
        if q_len == 1:
            continue
        own_len = plan.own_seq_lens_host[s]
        nblk = -(-own_len // bs)
        if _causal_fits(q, own_len, k_cache):
            rows = slice(starts[s], starts[s] + q_len)
            table = own_tables[s, :nblk]
            o_out[rows], lse_out[rows] = _own_causal(q[rows], k_cache, v_cache, table, own_len, scale)
            continue
        # row (j, g) sees own keys 0 .. own_len - q_len + j (the same causal rule, shorter KV)
        limits = torch.arange(own_len - q_len + 1, own_len + 1, device=q.device).repeat_interleave(group)
        visible = torch.arange(nblk * bs, device=q.device)[None, :] < limits[:, None]  # [q_len * g, N]
        qs = _stack_heads(q[starts[s] : starts[s] + q_len], kv_heads)  # [kvh, q_len * g, D]
        o, lse = attend_blocks(
            qs[None],
            k_cache,
            v_cache,
            own_tables[s : s + 1, :nblk],
            scale,
            own_lens[s : s + 1],
            visible[None, None],
        )
        o, lse = _unstack_heads(o[0], lse[0], q_len)
        o_out[starts[s] : starts[s] + q_len] = o
        lse_out[starts[s] : starts[s] + q_len] = lse
    return o_out, lse_out


_CAUSAL_BYTES = 64 << 20  # the causal own path's K and V, expanded to every query head, at most this


@functools.cache
def _flash_takes_gqa() -> bool:
    """Does the CPU flash op attend several query heads to one KV head itself (head h to KV head
    h // group, as ``repeat_interleave`` lays them out)? Checked once against the expanded call on
    tiny inputs: where it does, K and V are never copied to every query head (docs/architecture.md,
    Backends, has the time it saved)."""
    if _CPU_FLASH is None:
        return False
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 3, 4, generator=gen) for heads in (4, 2, 2))
    try:
        o, _ = _CPU_FLASH(q, k, v, is_causal=True, scale=0.5)
    except RuntimeError:
        return False
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    return bool(torch.equal(o, _CPU_FLASH(q, k, v, is_causal=True, scale=0.5)[0]))


def _causal_fits(q: torch.Tensor, own_len: int, k_cache: torch.Tensor) -> bool:
    """Can a prefill chunk's own part take ``_own_causal`` (CPU flash op, bounded fp32 K/V copies:
    at the KV heads, or expanded to the query heads where the op cannot group them itself)?"""
    if _CPU_FLASH is None or q.device.type != "cpu":
        return False
    heads = k_cache.shape[2] if _flash_takes_gqa() else q.shape[1]
    return own_len * heads * q.shape[2] * max(4, k_cache.element_size()) <= _CAUSAL_BYTES


def _own_causal(
    q: torch.Tensor,  # [q_len, q_heads, D]: a prefill chunk's rows, the last q_len of its own part
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [nblk] long: the sequence's own blocks
    own_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [q_len, q_heads, D] fp32, lse [q_len, q_heads]
    """A prefill chunk over its own part without a mask tensor: its own keys before the chunk, which
    every row sees, then the chunk's own keys under the flash op's causal rule; merged by LSE.

    With stacked heads the causal rule needs an explicit [rows * group, N] mask, which at a
    1.5K-token prompt cost more to build and apply than the attention (and the op cannot skip the
    masked half); here the op groups the query heads itself (``_flash_takes_gqa``), or K and V are
    expanded to the query heads where it cannot (at most ``_CAUSAL_BYTES`` either way).
    Only the own part's valid rows are read, so the slots past its end are never touched.
    """
    q_len, q_heads, _ = q.shape
    kv_heads = k_cache.shape[2]
    first = _block_run(table[None])
    if first is not None:
        k = k_cache[first : first + table.numel()].flatten(0, 1)[:own_len]
        v = v_cache[first : first + table.numel()].flatten(0, 1)[:own_len]
    else:
        k = k_cache.index_select(0, table).flatten(0, 1)[:own_len]  # [own_len, kv_heads, D]
        v = v_cache.index_select(0, table).flatten(0, 1)[:own_len]
    group = 1 if _flash_takes_gqa() else q_heads // kv_heads
    qh = q.transpose(0, 1)[None].float()  # [1, q_heads, q_len, D]
    kh, vh = k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float()  # [1, kv_heads, own_len, D]
    if group > 1:  # to the query heads (a repeat of 1 would copy them for nothing)
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    ctx = own_len - q_len
    o, lse = _CPU_FLASH(qh, kh[:, :, ctx:], vh[:, :, ctx:], is_causal=True, scale=scale)
    if ctx > 0:
        o_ctx, lse_ctx = _CPU_FLASH(qh, kh[:, :, :ctx], vh[:, :, :ctx], scale=scale)
        o, lse = merge_attention_states(o_ctx, lse_ctx, o, lse)
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)


def cascade_attention(
    q: torch.Tensor,  # [T, q_heads, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: SharedPlan,
    scale: float,
) -> torch.Tensor:  # [T, q_heads, D], q's dtype
    """``cascade_attention_lse``'s output in q's dtype."""
    return cascade_attention_lse(q, k_cache, v_cache, meta, plan, scale)[0].to(q.dtype)


def cascade_attention_lse(
    q: torch.Tensor,  # [T, q_heads, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: SharedPlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, q_heads, D] fp32, lse [T, q_heads]
    """Own parts first, then fold in each shared segment by its LSE.

    Segments of the same length (whole blocks) are attended in one batched call: a long shared
    prefix usually comes with a tail of one-block segments that a few sequences share (prompts
    whose next words agree), and one call each cost more than the reads they save (CPU: nine
    such segments took 20% of a B=32 decode step, 1.4K-token prefix, default model).
    """
    o_acc, lse_acc = own_attention(q, k_cache, v_cache, meta, plan, scale)
    blk_start = plan.seg_block_start_host
    row_start = plan.seg_row_start_host
    bs = k_cache.shape[1]
    alike: dict[int, list[int]] = {}  # segment length in blocks -> segments (whole blocks only)
    t = q.shape[0]
    for g in range(plan.num_segments):
        nblk = blk_start[g + 1] - blk_start[g]
        n_tok = plan.seg_num_tokens_host[g] if plan.seg_num_tokens_host else None
        rows = plan.seg_rows[row_start[g] : row_start[g + 1]].to(q.device).long()
        if n_tok is None or n_tok == nblk * bs:
            alike.setdefault(nblk, []).append(g)
            continue
        blocks = plan.seg_blocks[blk_start[g] : blk_start[g + 1]].to(q.device).long()
        o, lse = segment_attention(q.index_select(0, rows), k_cache, v_cache, blocks, scale, n_tok)
        scatter_merge_(o_acc, lse_acc, rows, o, lse)
    for segs in alike.values():
        for rows, o, lse in _segments_attention(q, k_cache, v_cache, plan, segs, scale):
            if _all_rows_in_order(rows, t):  # a prefix every sequence holds: an aligned merge
                o_acc, lse_acc = merge_attention_states(o_acc, lse_acc, o, lse)
            else:
                scatter_merge_(o_acc, lse_acc, rows, o, lse)
    return o_acc, lse_acc


def _segments_attention(
    q: torch.Tensor,  # [T, q_heads, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    plan: SharedPlan,
    segs: list[int],  # segments of one length in whole blocks
    scale: float,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # per segment: rows, o [M, H, D], lse [M, H]
    """Several segments of the same length as one batch (holders padded to the most; padding rows
    attend too and are dropped); a segment alone goes through ``segment_attention``."""
    blk_start, row_start = plan.seg_block_start_host, plan.seg_row_start_host
    rows = [plan.seg_rows[row_start[g] : row_start[g + 1]].to(q.device).long() for g in segs]
    if len(segs) == 1:
        blocks = plan.seg_blocks[blk_start[segs[0]] : blk_start[segs[0] + 1]].to(q.device).long()
        return [(rows[0], *segment_attention(q.index_select(0, rows[0]), k_cache, v_cache, blocks, scale))]
    _, q_heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    most = max(len(r) for r in rows)
    padded = torch.zeros(len(segs), most, dtype=torch.long, device=q.device)  # [G, M]: row 0 pads
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    tables = torch.stack([plan.seg_blocks[blk_start[g] : blk_start[g + 1]] for g in segs]).to(q.device).long()
    qs = q.index_select(0, padded.flatten()).reshape(len(segs), most, kv_heads, group, d)
    qs = qs.transpose(1, 2).reshape(len(segs), kv_heads, most * group, d)  # [G, kvh, M * g, D]
    o, lse = attend_blocks(qs, k_cache, v_cache, tables, scale)
    o = o.reshape(len(segs), kv_heads, most, group, d).transpose(1, 2).reshape(len(segs), most, q_heads, d)
    lse = lse.reshape(len(segs), kv_heads, most, group).transpose(1, 2).reshape(len(segs), most, q_heads)
    return [(r, o[i, : len(r)], lse[i, : len(r)]) for i, r in enumerate(rows)]


@register_backend
class CascadeBackend(AttentionBackend):
    """Shared segments attended once per step with stacked queries; exact LSE merge with own parts."""

    name = "cascade"
    takes_sinks = True

    def prepare(self, meta: AttentionMetadata) -> None:
        plan = make_plan(meta)
        meta.plan = plan
        meta.stats["kv_tokens_read"] = float(plan.kv_tokens_read)
        meta.stats["kv_tokens_logical"] = float(meta.logical_kv_tokens())
        meta.stats["shared_segments"] = float(plan.num_segments)
        meta.stats["cascade"] = 1.0 if plan.num_segments else 0.0

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = meta.plan if isinstance(meta.plan, SharedPlan) else make_plan(meta)
        return cascade_attention(q, k_cache, v_cache, meta, plan, scale)

    def forward_with_lse(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        plan = meta.plan if isinstance(meta.plan, SharedPlan) else make_plan(meta)
        return cascade_attention_lse(q, k_cache, v_cache, meta, plan, scale)
