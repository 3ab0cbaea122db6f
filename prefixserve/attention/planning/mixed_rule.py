"""When a decode step runs as one mixed launch (``mixed_gluon.py``), and with which own tiles: host rules.

``may_mix`` says whether a decode step could take it (the shared planner asks first, to prefer tall
tiles for such a step): with one shared segment, own parts of 64+ tokens, a segment under 512
times the own parts (``LONG_SHARED``) and, where 192-row shared tiles fit the rows, products per
query head under 1,024 times the own parts (``WIDE_SHARED``); with several, own KV reads long
enough next to the shared products to be hidden under them. ``use_mixed`` adds the work list's
condition (128 x 128 TMA tiles); ``own_tiling`` picks the KV heads per own ticket and the padded
query heads of an own tile; ``own_rows_for`` the own tile height and ``shared_tokens_for`` the
shared tiles' tokens; ``mixed_rows`` (a ``MixedTiles``, or None for two kernels) is what the backend
and the graph planner call after planning. PREFIXSERVE_MIXED (``config.mixed_mode``) turns the
launch off, on wherever eligible, or leaves it to the rules.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from prefixserve import config
from prefixserve.attention import _ptxas
from prefixserve.attention.kernels import shared_gluon
from prefixserve.attention.planning import shared_plan

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
# ...but not where the shared products are this many times the own tokens (holder rows x segment
# tokens vs own tokens): 128-row own tiles leave the shared ring two slots instead of three, and whole
# decode runs (H200, own 65-192 tokens) took 64-row tiles 0.6-1.2% faster at B=64 and 256 on a 16K
# prefix (ratio 128), level at B=256 on 4K (ratio 32); the kernel alone at B=1024 favoured 128 rows
# at ratios 8 and 32 (-5.6%, -2%)
SHARED_HEAVY = 64
# Shared tiles: 64 tokens, so that both rings stay three slots deep beside 64-row own tiles (calls
# timed 128-token tiles in 2 + 2 slots 2-4% slower, docs/kernels.md §4), except in SHARED_HEAVY steps
# with 64-row own tiles: there whole decode steps at the board's power cap ran 2.2-2.4% faster at
# B=256 and 3.9-4.0% faster at B=1024 on a 16K prefix with 128-token tiles in 2 + 2 slots (H200,
# ``step_modes.py``, two runs of 64-token tiles around one of 128; docs/kernels.md §2.5): half the
# rescales of O and the ring's waits a key
SHARED_N = 64
HEAVY_SHARED_N = 128
# When a step takes the mixed launch (docs/kernels.md §2.5). One shared segment: from
# ONE_SEGMENT_OWN_TOKENS own tokens a sequence (mean). Whole decode runs (64 own prompt tokens + 128
# generated, H200) were 1.01-1.05x faster on it than on two kernels at every such point measured,
# shared-heavy ones included (B=64 and 256, P=16K: +1.9%, +0.9%; B=1024, P=16K: +1.0%): the own
# kernel's time at short own parts is mostly latency (about 12 us whatever B), which a bytes-based
# estimate does not see. Several segments (n=8 samples of 32 prompts: a 4K prefix and 32 small
# segments) ran 7.6% slower on it with 64-128 own tokens, so there the launch keeps its first rule:
# own parts of MIN_OWN_TOKENS, own bytes' time >= MIN_OWN_SHARE x the shared products' time.
ONE_SEGMENT_OWN_TOKENS = 64
# ...up to a segment this many times the own parts (holder rows x segment tokens vs own tokens): past
# it the two kernels are faster again. H100, whole decode runs (64 own prompt tokens + 128 generated):
# B=64, P=64K 5,711 vs 5,537 tok/s (+3.1%), B=256, P=64K 9,689 vs 8,949 (+8.3%), B=64, P=32K level
# (6,926 vs 6,941); calls (``benchmarks/probes/launch_modes.py``, us): ratio 512 two kernels 84.7 vs
# 87.2 (64 x 32K, S=64), 142.6 vs 158.5 (64 x 64K, S=128), 442 vs 522 (256 x 64K, S=64: 1024), 937 vs
# 1,008 (1024 x 32K, S=64); ratio 256 the mixed kernel 56.4 vs 60.7 (64 x 16K, S=64), 282.6 vs 296.3
# (256 x 32K, S=128), and at 128 (16K, S=128) 63.4 / 161.4 / 561.7 vs 69.6 / 169.2 / 596.5 at B = 64
# / 256 / 1024 (docs/kernels.md §2.5)
LONG_SHARED = 512
# ...and from a segment whose products per query head (GQA group x holder rows x segment tokens) are
# WIDE_SHARED times the own tokens, where the shared tiles can be 192 rows (``shared_plan``'s
# ``wide_tiles_pay``; the mixed kernel has no registers for a third shared warpgroup): two kernels on
# them read the segment 1.5x less often. Calls (``launch_modes.call``, H200, back to back at the
# power cap, us, mixed / two kernels on 192-row tiles, 16K prefix, 128 own tokens; docs/kernels.md
# §2.3): at GQA 8 (1,024) 147.7 / 144.2 (32/4 heads, B=256: the 70B's TP=2 shard), 282.9 / 277.5
# (B=512), 285.2 / 280.1 (64/8, B=256); at GQA 4 (512) the mixed kernel stays ahead: 298.2 / 317.2
# (32/8, B=512), 577.4 / 623.2 (B=1024), 295.6 / 315.7 (16/4, B=1024). Only GQA 8 and up was measured
# at 1,024 (GQA 4 reaches it from a 32K prefix: H100 calls had the mixed kernel 5% ahead of two kernels
# on 128-row tiles there, about what 192-row ones gain), so the rule stops at WIDE_GROUP
WIDE_SHARED = 1024
WIDE_GROUP = 8
MIN_OWN_TOKENS = 128  # each own ticket costs about 1 us beyond its tiles
MIN_OWN_SHARE = 0.5
GLUON_TFLOPS = 640.0  # the shared Gluon kernel's measured rate (docs/kernels.md §2.3, §2.5)
COPY_TBPS = 4.0  # what the own KV streams at, about (H200)


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


def own_rows_for(own_tokens: int, num_seqs: int, group: int, shared_row_tokens: int = 0) -> int:
    """Rows of the own tiles of a mixed step with ``own_tokens`` own KV tokens over ``num_seqs``
    sequences, ``group`` query heads a KV head and ``shared_row_tokens`` (holder rows x segment tokens,
    summed): ``SHORT_OWN_M`` where own parts are short (mean under ``SHORT_OWN_TOKENS``) at GQA
    ``SHORT_OWN_GROUP``, the shared part is not ``SHARED_HEAVY`` times the own one, and ptxas >= 12.9
    builds the kernel; else ``OWN_M``."""
    short = own_tokens < SHORT_OWN_TOKENS * max(num_seqs, 1) and group == SHORT_OWN_GROUP
    light = shared_row_tokens < SHARED_HEAVY * own_tokens
    return SHORT_OWN_M if short and light and _ptxas.newer_ptxas() is not None else OWN_M


def shared_tokens_for(own_m: int, own_tokens: int, shared_row_tokens: int) -> int:
    """Tokens of the shared tiles of a mixed step with own tiles of ``own_m`` rows: ``HEAVY_SHARED_N``
    where the shared part is ``SHARED_HEAVY`` times the ``own_tokens`` or more (``shared_row_tokens``:
    holder rows x segment tokens) and own tiles are ``OWN_M`` rows (two 64 KB shared slots and two own
    ones fit; beside 128-row own tiles they would not), else ``SHARED_N``."""
    heavy = shared_row_tokens >= SHARED_HEAVY * own_tokens
    return HEAVY_SHARED_N if heavy and own_m == OWN_M else SHARED_N


class MixedTiles(NamedTuple):
    """A mixed launch's tiles: own tile rows, shared tile tokens (rings: ``mixed_gluon.ring_stages``)."""

    own_m: int
    shared_n: int


def eligible(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int, block_n: int
) -> bool:
    """True when the mixed kernel can run a decode step: the shared Gluon kernel's conditions, the caches
    of q's dtype (its own tiles take no e4m3) and an own tiling (``own_tiling``)."""
    return (
        k_cache.dtype == q.dtype
        and shared_gluon.eligible(q, k_cache, v_cache, block_m, block_n)
        and bool(own_tiling(q.shape[1], k_cache.shape[2], k_cache.shape[1])[0])
    )


def may_mix(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    max_query_len: int,
    shared_row_tokens: int,
    own_tokens: int,
    num_seqs: int,
    mode: str | None = None,
    block_size: int = 16,
    segments: int = 1,
) -> bool:
    """True when a step would run as one mixed launch if its shared work list takes 128 x 128 TMA
    tiles: a decode step (``shape`` = (Hq, Hkv, D)) on a GPU the shared Gluon kernel runs on whose own
    parts (``own_tokens`` over ``num_seqs`` sequences) pass the rule above for its number of shared
    ``segments`` (``shared_row_tokens``: holder rows x segment tokens, summed); ``block_size`` = the
    cache's (``own_tiling``). The shared planner asks first, to prefer tall tiles for such a step
    (``shared_plan.pick_shared_tiles``). ``mode`` (default ``config.mixed_mode()``, PREFIXSERVE_MIXED):
    "0" never, "1" whenever eligible, "auto" the rule."""
    mode = config.mixed_mode() if mode is None else mode
    q_heads, kv_heads, dim = shape
    if (
        mode == "0"
        or max_query_len != 1
        or not own_tiling(q_heads, kv_heads, block_size)[0]
        or own_tokens == 0
        or not shared_gluon.eligible_for(device, dtype, dim)
    ):
        return False
    if mode == "1":
        return True
    if segments == 1:
        long_segment = shared_row_tokens >= LONG_SHARED * own_tokens
        group = q_heads // kv_heads
        wide = (
            group >= WIDE_GROUP
            and group * shared_row_tokens >= WIDE_SHARED * own_tokens
            and shared_plan.wide_tiles_pay([num_seqs * group])
        )
        return own_tokens >= ONE_SEGMENT_OWN_TOKENS * num_seqs and not (long_segment or wide)
    if own_tokens < MIN_OWN_TOKENS * num_seqs:
        return False
    elt = torch.empty(0, dtype=dtype).element_size()
    own_ms = 2 * elt * kv_heads * dim * own_tokens / (COPY_TBPS * 1e9)
    shared_ms = 4 * q_heads * dim * shared_row_tokens / (GLUON_TFLOPS * 1e9)
    return own_ms >= MIN_OWN_SHARE * shared_ms


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
    segments: int = 1,
) -> bool:
    """True when a step runs as one mixed launch: ``may_mix`` (same arguments) and a shared work list
    of 128 x 128 TMA tiles."""
    if not (work.tma and work.block_m == 128 and work.block_n == 128):
        return False
    step = (max_query_len, shared_row_tokens, own_tokens, num_seqs, mode, block_size, segments)
    return may_mix(device, dtype, shape, *step)


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
    segments: int = 1,
) -> MixedTiles | None:
    """A step's mixed launch tiles, or None where the step runs two kernels: ``use_mixed`` (same
    arguments) decides the launch, ``own_rows_for`` its own tile rows, ``shared_tokens_for`` its
    shared tile tokens."""
    step = (max_query_len, shared_row_tokens, own_tokens, num_seqs, mode)
    if not use_mixed(device, dtype, shape, work, *step, block_size=block_size, segments=segments):
        return None
    own_m = own_rows_for(own_tokens, num_seqs, shape[0] // shape[1], shared_row_tokens)
    return MixedTiles(own_m, shared_tokens_for(own_m, own_tokens, shared_row_tokens))


__all__ = [
    "MixedTiles",
    "eligible",
    "may_mix",
    "mixed_rows",
    "own_rows_for",
    "own_tiling",
    "shared_tokens_for",
    "use_mixed",
]
