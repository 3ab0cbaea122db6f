"""Long prefills through torch's fused attention: cuDNN's kernel (or FlashAttention-2's) behind SDPA.

A prefill of thousands of tokens is compute-bound, and there our Triton paged kernel is far from the
tensor cores' rate: one 8,192-token causal prefill at the Llama-3.1-8B heads runs at 239 TFLOP/s on
an H200 through it and at 534 through this path (cuDNN's kernel: 614 alone; docs/kernels.md §2.14).
A step takes this path when it is a few long prefills and nothing else: at most ``MAX_SEQS``
sequences, each with at least ``MIN_ROWS`` query rows and at least ``MIN_WORK`` query-key-head
products (below it cuDNN's per-call cost loses: one 2,048-token prefill of 32 heads took 1.40x our
kernel's time, of 64 heads 0.75x), full attention, no LSE asked (attention sinks). Each sequence's KV
is gathered from its blocks into contiguous rows (one copy of its K and V, widened to q's dtype from
an FP8 cache exactly as the paged kernel widens its tiles), then one SDPA call: causal from the top
left when the sequence has no earlier context, from the bottom right (FlashAttention-2's alignment,
``causal_lower_right``: torch sends it to FA2, not cuDNN, so such chunks run at FA2's 304-339 TFLOP/s)
when it has (a chunk after a prefix-cache hit or an earlier chunk). A sequence's context is at most
``MAX_CONTEXT`` tokens here, so the gathered copy stays within what ``gather_bytes`` reserves. Decode,
mixed and shared-segment steps never come here: the one idea (shared segments read once) lives in
our kernels.

On a GPU only cuDNN's and FlashAttention-2's kernels are allowed (never the math fallback, which
would hold every head's score matrix); where neither takes the shape (a head of 512, say) the step
falls back to the paged kernel.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from prefixserve.attention.kv_quant import as_bytes
from prefixserve.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

MIN_ROWS = 1024  # query rows of every sequence in the step (below: the paged kernel)
MIN_WORK = 2048 * 2048 * 64  # query rows x KV tokens x query heads of every sequence (H200, measured)
MAX_SEQS = 8  # sequences in the step (one SDPA call each: many short ones are the paged kernel's)
MAX_CONTEXT = 32768  # KV tokens of a sequence (its gathered K/V copy: ``gather_bytes``)


@dataclass(frozen=True, slots=True)
class DenseSequence:
    """One sequence of a dense prefill step."""

    index: int  # its row in the block tables
    row: int  # its first query row in the step
    q_len: int
    seq_len: int  # KV tokens, this step's included


def plan(meta: AttentionMetadata) -> tuple[DenseSequence, ...] | None:
    """The step's sequences when it takes the dense path (host values only), else None."""
    q_lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
    if not q_lens or len(q_lens) > MAX_SEQS or min(q_lens) < MIN_ROWS or max(seq_lens) > MAX_CONTEXT:
        return None
    if meta.table_base is not None or meta.has_module_blocks():  # a sliding group's view; modules
        return None
    rows, seqs = 0, []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        seqs.append(DenseSequence(i, rows, q_len, seq_len))
        rows += q_len
    return tuple(seqs)


def takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this layer's shapes go through SDPA: 16-bit q, a cache of q's dtype or e4m3, heads <= 256."""
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and q.shape[1] % k_cache.shape[2] == 0
    )


_REFUSED: set[tuple] = set()  # layer shapes SDPA had no kernel for, this process (``run``'s key)


def gather_bytes(config: Any, dtype: torch.dtype, context: int) -> int:
    """The most a dense step's gathered K/V copy of one sequence holds at once (``config``: the
    model's ``ModelConfig``; attention sits below the model package): ``context`` tokens
    (at most ``MAX_CONTEXT``) of the widest layer's KV heads, K and V in ``dtype`` and one e4m3
    intermediate (an FP8 cache): what a GPU's step reserve adds for this path."""
    item = torch.tensor([], dtype=dtype).element_size()
    widest = max(s.kv_heads * s.head_dim for s in map(config.layer_spec, range(config.num_hidden_layers)))
    return min(context, MAX_CONTEXT) * widest * (2 * item + 1)


def run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: tuple[DenseSequence, ...],
    scale: float,
) -> torch.Tensor | None:
    """``attend`` into a new tensor where this layer's shapes go through SDPA on a GPU, else None (the
    caller's kernel runs): shapes it refused once are not tried again; an out-of-memory error only
    sends this step to the caller's kernel."""
    after_context = any(s.q_len != s.seq_len for s in seqs)  # FA2's bottom-right variant
    key = (q.shape[-1], q.dtype, q.shape[1], k_cache.shape[2], k_cache.dtype, after_context)
    if not q.is_cuda or key in _REFUSED or not takes(q, k_cache):
        return None
    if min(s.q_len * s.seq_len for s in seqs) * q.shape[1] < MIN_WORK:
        return None
    try:
        return attend(q, k_cache, v_cache, meta, seqs, scale, torch.empty_like(q))
    except torch.cuda.OutOfMemoryError:
        log.warning("a long prefill's gathered KV did not fit: this step's attention on the paged kernel")
        return None
    except (RuntimeError, TypeError) as exc:  # no SDPA kernel for this shape here
        _REFUSED.add(key)
        log.warning("long prefills of %s stay on the paged kernel: SDPA refused them (%s)", key, exc)
        return None


def _backends(device: torch.device) -> list:
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    return [SDPBackend.MATH]  # the CPU tests' path: the same gathers and masks, exact math


def _kernels(device: torch.device):
    """SDPA limited to ``_backends``, in that order where this torch can say so (``set_priority``:
    torch 2.6 on; before it torch's own order, FlashAttention-2 before cuDNN)."""
    from torch.nn.attention import sdpa_kernel

    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return sdpa_kernel(_backends(device), set_priority=True)
    return sdpa_kernel(_backends(device))


def gather_kv(cache: torch.Tensor, table: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """A sequence's first ``seq_len`` tokens of ``cache`` [blocks, block_size, Hkv, D] through its
    block-table row, as [Hkv, seq_len, D] in ``dtype`` (a view of one gathered copy; an e4m3 cache's
    codes widened, exact, their scales left to the caller as the paged kernel leaves them)."""
    block_size = cache.shape[1]
    blocks = table[: -(-seq_len // block_size)].long()
    raw = as_bytes(cache).index_select(0, blocks).view(cache.dtype)  # e4m3 gathered as bytes
    return raw.flatten(0, 1)[:seq_len].to(dtype).transpose(0, 1)


def attend(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: tuple[DenseSequence, ...],
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its KV into ``out`` (see the module)."""
    from torch.nn.attention.bias import causal_lower_right

    with _kernels(q.device):
        for s in seqs:
            qs = q[s.row : s.row + s.q_len].transpose(0, 1)[None]  # [1, Hq, Lq, D]
            k = gather_kv(k_cache, meta.block_tables[s.index], s.seq_len, q.dtype)[None]
            v = gather_kv(v_cache, meta.block_tables[s.index], s.seq_len, q.dtype)[None]
            if s.q_len == s.seq_len:
                o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = causal_lower_right(s.q_len, s.seq_len)
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s.row : s.row + s.q_len] = o[0].transpose(0, 1)
    return out


__all__ = [
    "MAX_CONTEXT",
    "MAX_SEQS",
    "MIN_ROWS",
    "MIN_WORK",
    "DenseSequence",
    "attend",
    "gather_bytes",
    "gather_kv",
    "plan",
    "run",
    "takes",
]
