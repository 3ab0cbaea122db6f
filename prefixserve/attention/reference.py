"""Reference attention: plain PyTorch, one sequence at a time, fp32 math. The oracle.

Every faster backend is tested against ``ReferenceBackend``; ``attention_with_lse`` is also the
building block of the cascade backend (shared segments and own parts each return an LSE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixserve.attention.backend import AttentionBackend, register_backend
from prefixserve.attention.metadata import AttentionMetadata


def attention_with_lse(
    q: torch.Tensor,  # [M, q_heads, D]
    k: torch.Tensor,  # [N, kv_heads, D]
    v: torch.Tensor,  # [N, kv_heads, D]
    scale: float,
    kv_limit: torch.Tensor | None = None,  # [M] int: row m sees keys 0 .. kv_limit[m]-1
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (o [M, q_heads, D] in compute_dtype, lse [M, q_heads]).

    A row that sees no key returns o = 0 and lse = -inf, so an LSE merge ignores it.
    """
    m_rows, q_heads, dim = q.shape
    n_keys, kv_heads, _ = k.shape
    group = q_heads // kv_heads
    qf = q.to(compute_dtype).reshape(m_rows, kv_heads, group, dim)
    kf = k.to(compute_dtype)
    vf = v.to(compute_dtype)
    # scores: [kv_heads, group, M, N]
    scores = torch.einsum("mhgd,nhd->hgmn", qf, kf) * scale
    if kv_limit is not None:
        visible = torch.arange(n_keys, device=q.device)[None, :] < kv_limit.to(q.device)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kv_heads, group, M]
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse[..., None])  # exp(-inf) = 0 on masked keys
    out = torch.einsum("hgmn,nhd->mhgd", probs, vf).reshape(m_rows, q_heads, dim)
    return out, lse.permute(2, 0, 1).reshape(m_rows, q_heads)


def gather_kv(
    cache: torch.Tensor, block_table: list[int], num_tokens: int
) -> torch.Tensor:  # [num_tokens, kv_heads, D]
    """Copy a sequence's first ``num_tokens`` KV rows out of the paged cache."""
    blocks = torch.tensor(block_table, dtype=torch.long, device=cache.device)
    return cache.index_select(0, blocks).flatten(0, 1)[:num_tokens]


def causal_limits(seq_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """Keys visible to each of a sequence's new queries: the j-th sees seq_len - query_len + j + 1."""
    return torch.arange(seq_len - query_len + 1, seq_len + 1, device=device)


@register_backend
class ReferenceBackend(AttentionBackend):
    """Per-sequence attention over each sequence's whole KV (what a non-sharing engine does).

    Math in fp32 through torch's scaled_dot_product_attention with an explicit causal mask; the
    einsum oracle ``attention_with_lse`` checks it in tests.
    """

    name = "reference"
    takes_sinks = True

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        math_dtype = torch.promote_types(q.dtype, torch.float32)
        start = 0
        for s, (q_len, s_len, table) in enumerate(
            zip(meta.query_lens_host, meta.seq_lens_host, meta.block_tables_host, strict=True)
        ):
            k = gather_kv(k_cache, table, s_len).transpose(0, 1).to(math_dtype)  # [Hkv, N, D]
            v = gather_kv(v_cache, table, s_len).transpose(0, 1).to(math_dtype)
            qs = q[start : start + q_len].transpose(0, 1).to(math_dtype)  # [Hq, M, D]
            mask = None
            if q_len > 1:
                limits = causal_limits(s_len, q_len, q.device)
                mask = torch.arange(s_len, device=q.device)[None, :] < limits[:, None]  # [M, N]
            valid = meta.valid_kv(s)  # [N] False at the holes of partly filled module blocks
            if valid is not None:  # attend only the rows that exist
                valid = valid.to(q.device)
                k, v = k[:, valid], v[:, valid]
                if mask is not None:
                    mask = mask[:, valid]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
            start += q_len
        return out

    def forward_with_lse(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """Per sequence through the einsum oracle, causal, holes of module blocks left out."""
        o_out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse_out = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        start = 0
        for s, (q_len, s_len, table) in enumerate(
            zip(meta.query_lens_host, meta.seq_lens_host, meta.block_tables_host, strict=True)
        ):
            k, v = gather_kv(k_cache, table, s_len), gather_kv(v_cache, table, s_len)
            limits = causal_limits(s_len, q_len, q.device)
            valid = meta.valid_kv(s)
            if valid is not None:  # keys at holes dropped; each row's limit counts the kept keys
                keep = valid.to(q.device)
                limits = torch.cumsum(keep.long(), 0)[limits - 1]
                k, v = k[keep], v[keep]
            rows = slice(start, start + q_len)
            o_out[rows], lse_out[rows] = attention_with_lse(q[rows], k, v, scale, limits)
            start += q_len
        return o_out, lse_out
