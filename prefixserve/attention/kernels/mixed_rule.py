"""When a decode step runs as one mixed launch (``mixed_gluon.py``), and with which own tiles: host rules.

``use_mixed`` takes a decode step on the shared Gluon kernel's path whose own KV reads take long
enough next to the shared products to be hidden under them; ``own_tiling`` picks the KV heads per own
ticket and the padded query heads of an own tile; ``own_rows_for`` the own tile height;
``mixed_rows`` is the one call the backend and the graph planner make. PREFIXSERVE_MIXED
(``config.mixed_mode``) turns the launch off, on wherever eligible, or leaves it to the rule.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve import config
from prefixserve.attention.kernels import _ptxas, shared_gluon

OWN_MAX_N = 32  # query heads of an own tile (padded to 8s: wgmma's N)
OWN_M = 64  # rows of an own tile: one warpgroup's wgmma M
# Own tiles of 128 rows (two wgmma M blocks) where own parts are short: half the own warpgroup's
# chains (products, row max, P^T store) per byte, for one shared ring slot less. Measured at B=1024
# (docs/kernels.md §2.5): GQA 4 -4 to -5% at S=128 (d 128), -4 to -9% at S=128-192 (d 64), level at
# S=192 (d 128), +1-2% at S=512 (long tickets) and +11% at B=256, P=16K, S=512; GQA 3 and GQA 8 (d 128)
# +2 to +6% at S=128-192. So at SHORT_OWN_GROUP only, below SHORT_OWN_TOKENS own tokens a sequence
# (mean), and only where ptxas >= 12.9 builds the kernel (``_ptxas``).
SHORT_OWN_M = 128
SHORT_OWN_GROUP = 4
SHORT_OWN_TOKENS = 192
GLUON_TFLOPS = 640.0  # the shared Gluon kernel's measured rate (docs/kernels.md §2.3, §2.5)
COPY_TBPS = 4.0  # what the own KV streams at, about (H200)
MIN_OWN_SHARE = 0.5  # own time / shared time from which the mixed kernel pays
# own tokens per sequence (mean) from which it pays: each own ticket costs about 1 us beyond its
# tiles. One-tile tickets of one head (S=128) lost at every point measured; tickets of several heads
# won there (docs/kernels.md §2.5); shorter own parts are not measured
MIN_OWN_TOKENS = 128


def own_tiling(q_heads: int, kv_heads: int, block_size: int, own_m: int = OWN_M) -> tuple[int, int]:
    """(KV heads per own tile, padded query heads of an own tile: wgmma's N), or (0, 0) where the
    mixed kernel cannot take the shape.

    Two heads where they divide the KV heads and a head's ``OWN_M / 2`` tokens are whole cache blocks
    (2 x GROUP query heads: at GQA 4 wgmma's N = 8 with no padding, and the per-ticket work of query
    loads and partial stores shared by two heads), else one."""
    group = q_heads // kv_heads
    for ht in (2, 1):
        rows = -(-ht * group // 8) * 8
        if kv_heads % ht == 0 and (own_m // ht) % block_size == 0 and rows <= OWN_MAX_N:
            return ht, rows
    return 0, 0


def own_rows_for(own_tokens: int, num_seqs: int, group: int) -> int:
    """Rows of the own tiles of a mixed step with ``own_tokens`` own KV tokens over ``num_seqs``
    sequences and ``group`` query heads a KV head: ``SHORT_OWN_M`` where own parts are short (mean
    under ``SHORT_OWN_TOKENS``) at GQA ``SHORT_OWN_GROUP`` and ptxas >= 12.9 builds the kernel, else
    ``OWN_M``."""
    short = own_tokens < SHORT_OWN_TOKENS * max(num_seqs, 1) and group == SHORT_OWN_GROUP
    return SHORT_OWN_M if short and _ptxas.newer_ptxas() is not None else OWN_M


def eligible(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int, block_n: int
) -> bool:
    """True when the mixed kernel can run a decode step: the shared Gluon kernel's conditions and an
    own tiling (``own_tiling``)."""
    return shared_gluon.eligible(q, k_cache, v_cache, block_m, block_n) and bool(
        own_tiling(q.shape[1], k_cache.shape[2], k_cache.shape[1])[0]
    )


def use_mixed(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    work: Any,
    max_query_len: int,
    shared_row_tokens: int,
    own_tokens: int,
    num_seqs: int,
    mode: str | None = None,
    block_size: int = 16,
) -> bool:
    """True when a step runs as one mixed launch: a decode step on the shared Gluon kernel's path
    (TMA work list of 128 x 128 tiles; ``shape`` = (Hq, Hkv, D)) whose own KV (``own_tokens`` over
    ``num_seqs`` sequences, at least ``MIN_OWN_TOKENS`` each on average) takes long enough next to
    the shared products to be worth hiding under them; ``block_size`` = the cache's (``own_tiling``).
    ``mode`` (default ``config.mixed_mode()``, PREFIXSERVE_MIXED): "0" never, "1" whenever eligible,
    "auto" the rule."""
    mode = config.mixed_mode() if mode is None else mode
    q_heads, kv_heads, dim = shape
    if (
        mode == "0"
        or max_query_len != 1
        or not own_tiling(q_heads, kv_heads, block_size)[0]
        or own_tokens == 0
    ):
        return False
    if not (work.tma and work.block_m == 128 and work.block_n == 128):
        return False
    if not shared_gluon.eligible_for(device, dtype, dim):
        return False
    if mode == "1":
        return True
    if own_tokens < MIN_OWN_TOKENS * num_seqs:
        return False
    elt = torch.empty(0, dtype=dtype).element_size()
    own_ms = 2 * elt * kv_heads * dim * own_tokens / (COPY_TBPS * 1e9)
    shared_ms = 4 * q_heads * dim * shared_row_tokens / (GLUON_TFLOPS * 1e9)
    return own_ms >= MIN_OWN_SHARE * shared_ms


def mixed_rows(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    work: Any,
    max_query_len: int,
    shared_row_tokens: int,
    own_tokens: int,
    num_seqs: int,
    mode: str | None = None,
    block_size: int = 16,
) -> int:
    """Own tile rows of a step's mixed launch, or 0 where the step runs two kernels: ``use_mixed``
    (same arguments) decides the launch, ``own_rows_for`` its tile height."""
    step = (max_query_len, shared_row_tokens, own_tokens, num_seqs, mode)
    if not use_mixed(device, dtype, shape, work, *step, block_size=block_size):
        return 0
    return own_rows_for(own_tokens, num_seqs, shape[0] // shape[1])


__all__ = ["eligible", "mixed_rows", "own_rows_for", "own_tiling", "use_mixed"]
