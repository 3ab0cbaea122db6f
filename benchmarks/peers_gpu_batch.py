"""The points of ``peers_gpu.py``: one paged KV cache a point, as a tree of shared segments, seen two ways.

A point is a tree of ``levels``: level 0 holds ``fanouts[0]`` nodes, each node of level l has
``fanouts[l]`` children, and the leaves are the decode sequences (one query token each). A node's
length is a token count (its level's ``lengths`` entry: an int, or a (lo, hi) range drawn per node);
the non-leaf nodes hold whole pages (a shared prompt's last partial page is copied per sequence, so
only whole pages are shared). Plain decode is one level of B leaves; one shared prefix is [1, B];
the tree is [1, prompts, samples].

Our side reads the block tables (``build_metadata``: the plan finds the shared runs itself); FlashInfer's
reads the same pages as CSR page lists: whole tables for its batch decode, one list a level for its
multi-level cascade. ``levels_reference`` computes attention from the cascade's lists in torch, so the
CPU smoke run checks those lists too, not only our kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from benchmarks.attention_grid import BS

BF16_TOL = 1e-2  # relative L2 error two bf16 attention outputs of the same inputs stay within


@dataclass
class Csr:
    """FlashInfer's paged-KV description of one batch (or one cascade level): int32 tensors."""

    qo_indptr: torch.Tensor  # [groups + 1]: query rows of each group (a level's node)
    kv_indptr: torch.Tensor  # [groups + 1]
    kv_indices: torch.Tensor  # [pages]
    last_page_len: torch.Tensor  # [groups]


@dataclass
class Batch:
    """One point: caches, queries, our metadata, and FlashInfer's page lists (host int32 tensors)."""

    kind: str
    heads: tuple[int, int, int]  # (q heads, kv heads, head dim)
    k_cache: torch.Tensor  # [blocks, BS, Hkv, D]
    v_cache: torch.Tensor
    q: torch.Tensor  # [B, Hq, D]
    meta: Any  # AttentionMetadata
    whole: Csr  # every sequence's whole table (batch decode)
    levels: list[Csr]  # one a tree level (cascade)
    unique_tokens: int  # KV tokens stored: each node once
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.heads[2])

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def min_bytes(self) -> int:
        """KV read once (each shared node once, every own part) + q read + o written."""
        hq, hkv, d = self.heads
        kv_item, q_item = self.k_cache.element_size(), self.q.element_size()
        return self.unique_tokens * hkv * d * 2 * kv_item + 2 * self.batch * hq * d * q_item


def _node_lengths(fanouts: list[int], lengths: list[Any], gen: torch.Generator) -> list[np.ndarray]:
    out, count = [], 1
    for depth, (fan, spec) in enumerate(zip(fanouts, lengths, strict=True)):
        count *= fan
        if isinstance(spec, tuple):
            lens = torch.randint(spec[0], spec[1] + 1, (count,), generator=gen).numpy()
        else:
            lens = np.full(count, spec)
        if depth < len(fanouts) - 1 and (lens % BS).any():
            raise ValueError(f"shared level {depth} must hold whole pages of {BS}")
        out.append(lens.astype(np.int64))
    return out


def build(
    kind: str,
    fanouts: list[int],
    lengths: list[Any],
    heads: tuple[int, int, int],
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> Batch:
    """A point's tree: the shared levels' pages consecutive (a prompt's blocks from a fresh pool), the
    leaves' pages scattered over the rest of the pool (allocated a decode step at a time).
    ``kv_dtype`` torch.float8_e4m3fn: the caches hold the values' e4m3 roundings (unit scales: an
    FP8 cache's scales are folded into q and the output outside the kernels, both sides alike)."""
    from prefixserve.attention.metadata import build_metadata

    gen = torch.Generator().manual_seed(seed)
    lens = _node_lengths(fanouts, lengths, gen)
    pages = [-(-ln // BS) for ln in lens]  # pages a node, per level
    n_shared = int(sum(p.sum() for p in pages[:-1]))
    total = n_shared + int(pages[-1].sum())
    ids = np.concatenate(
        [np.arange(n_shared), n_shared + torch.randperm(total - n_shared, generator=gen).numpy()]
    )
    node_pages: list[list[np.ndarray]] = []
    at = 0
    for p in pages:
        starts = at + np.concatenate([[0], np.cumsum(p)[:-1]])
        node_pages.append([ids[s : s + n] for s, n in zip(starts, p, strict=True)])
        at += int(p.sum())
    b = len(lens[-1])
    spans = [b // len(ln) for ln in lens]  # leaves under one node of each level
    tables = [np.concatenate([node_pages[lv][s // spans[lv]] for lv in range(len(lens))]) for s in range(b)]
    seq_lens = [int(sum(lens[lv][s // spans[lv]] for lv in range(len(lens)))) for s in range(b)]
    width = max(len(t) for t in tables)
    table_arr = np.zeros((b, width), dtype=np.int64)
    for s, t in enumerate(tables):
        table_arr[s, : len(t)] = t
    hq, hkv, d = heads
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # up to 64 GiB of KV: drawn in place
    k_cache, v_cache = (
        torch.randn(total, BS, hkv, d, device=device, dtype=dtype, generator=dev_gen).to(kv_dtype or dtype)
        for _ in "kv"
    )
    q = torch.randn(b, hq, d, device=device, dtype=dtype, generator=dev_gen)
    meta = build_metadata(BS, [1] * b, seq_lens, table_arr, device)
    whole = _csr(np.arange(b + 1), tables, np.asarray(seq_lens))
    levels = [_csr(np.arange(0, b + 1, spans[lv]), node_pages[lv], lens[lv]) for lv in range(len(lens))]
    unique = int(sum(ln.sum() for ln in lens))
    info = {"kind": kind, "B": b, "fanouts": fanouts, "lengths": [str(x) for x in lengths]}
    info["kv_dtype"] = str(k_cache.dtype).removeprefix("torch.")
    info |= {"heads": list(heads), "kv_tokens": int(sum(seq_lens)), "unique_kv_tokens": unique}
    return Batch(kind, heads, k_cache, v_cache, q, meta, whole, levels, unique, info)


def _csr(qo_indptr: np.ndarray, page_lists: list[np.ndarray], tokens: np.ndarray) -> Csr:
    counts = np.array([len(p) for p in page_lists])
    indptr = np.concatenate([[0], np.cumsum(counts)])
    last = tokens - (counts - 1) * BS

    def t(a: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=torch.int32)

    return Csr(t(qo_indptr), t(indptr), t(np.concatenate(page_lists)), t(last))


# --- our side ----------------------------------------------------------------------------------------
def ours(batch: Batch, shared: bool) -> tuple[Any, float]:
    """(forward closure, host plan ms): "triton" (shared segments, the side stream as in the engine's
    graphs) or "triton_paged" (every table whole)."""
    from benchmarks.attention import backend_fn

    name = "triton" if shared else "triton_paged"
    return backend_fn(name, batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, overlap=shared)


# --- references and agreement -----------------------------------------------------------------------
def reference(batch: Batch) -> torch.Tensor:
    """fp32 attention over each sequence's whole table (the engine's oracle): [B, Hq, D]."""
    from prefixserve.attention.reference import ReferenceBackend

    return ReferenceBackend().forward_with_lse(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )[0]


def levels_reference(batch: Batch) -> torch.Tensor:
    """fp32 attention from the cascade's page lists: each level's node over its rows, LSE-merged."""
    from prefixserve.attention.merge import merge_attention_states
    from prefixserve.attention.reference import attention_with_lse

    o = lse = None
    for lv in batch.levels:
        o_lv = torch.zeros(batch.q.shape, dtype=torch.float32, device=batch.q.device)
        lse_lv = torch.full(batch.q.shape[:2], float("-inf"), device=batch.q.device)
        qo, kv, idx, last = (
            x.tolist() for x in (lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.last_page_len)
        )
        for g in range(len(last)):
            pages = torch.tensor(idx[kv[g] : kv[g + 1]], dtype=torch.long, device=batch.q.device)
            n = (len(pages) - 1) * BS + last[g]
            k = batch.k_cache.index_select(0, pages).flatten(0, 1)[:n]
            v = batch.v_cache.index_select(0, pages).flatten(0, 1)[:n]
            rows = slice(qo[g], qo[g + 1])
            o_lv[rows], lse_lv[rows] = attention_with_lse(batch.q[rows], k, v, batch.scale)
        o, lse = (o_lv, lse_lv) if o is None else merge_attention_states(o, lse, o_lv, lse_lv)
    assert o is not None
    return o


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error (nan where ``x`` has a non-finite value)."""
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("nan")
    return float((x - ref).norm() / ref.norm())


def agree(x: torch.Tensor, ref: torch.Tensor, tol: float = BF16_TOL) -> tuple[bool, float]:
    """Whether two attention outputs agree within bf16 tolerance, and their relative error."""
    err = rel_err(x, ref)
    return err <= tol, err
