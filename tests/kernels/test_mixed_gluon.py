"""The mixed Gluon kernel (a decode step's shared and own tiles in one launch; Hopper): its rule on
any machine, and on an H100/H200 the engine's decode step through it against the two-kernel path
and the reference, for GQA 1-8, d 64/128, bf16/fp16, ragged own lengths, several segments, grids
with own-only programs and with more shared tickets than programs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _kernel_helpers import rel_err

from prefixserve.attention import _ptxas
from prefixserve.attention.kernels import mixed_gluon, shared_gluon
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning import mixed_rule, tiles
from prefixserve.attention.planning.shared_plan import SharedWork
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.attention.triton_backend import TritonBackend

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _work(tma: bool = True, block_m: int = 128, block_n: int = 128) -> SharedWork:
    return SharedWork(torch.zeros(1, 7), 0, block_m, block_n, 3, [], [], torch.zeros(0), tma=tma)


def test_own_tiling() -> None:
    """Own tiles of two KV heads where heads and cache blocks allow, else one."""
    assert mixed_rule.own_tiling(32, 8, 16) == (2, 8)  # GQA 4: two heads x 4 query heads
    assert mixed_rule.own_tiling(64, 8, 16) == (2, 16)  # GQA 8
    assert mixed_rule.own_tiling(8, 8, 16) == (2, 8)  # GQA 1: 2 query heads, padded to wgmma's N = 8
    assert mixed_rule.own_tiling(32, 8, 32) == (2, 8)  # 32 tokens a head: whole 32-token blocks
    assert mixed_rule.own_tiling(32, 8, 64) == (1, 8)  # 32 tokens a head would split a 64-token block
    assert mixed_rule.own_tiling(32, 2, 16) == (2, 32)  # GQA 16
    assert mixed_rule.own_tiling(64, 2, 16) == (1, 32)  # GQA 32: two heads would be N = 64
    assert mixed_rule.own_tiling(32, 1, 16) == (1, 32)  # one KV head
    assert mixed_rule.own_tiling(128, 2, 16) == (0, 0)  # GQA 64: N = 64 > OWN_MAX_N


def test_rule(monkeypatch) -> None:
    """Decode steps on the Gluon path take the mixed kernel: one shared segment from
    ONE_SEGMENT_OWN_TOKENS own tokens a sequence, up to a segment LONG_SHARED times the own parts
    or, where 192-row shared tiles fit, WIDE_SHARED times per query head; several by the first rule
    (MIN_OWN_TOKENS and the own-bytes / shared-FLOPs ratio)."""
    monkeypatch.setattr(shared_gluon, "eligible_for", lambda *a: True)
    monkeypatch.setenv("PREFIXSERVE_MIXED", "auto")
    dev, bf16, shape = torch.device("cuda"), torch.bfloat16, (32, 8, 128)
    # B=1024 rows on a 4K prefix, 512 own tokens each: own bytes 2.1 GB vs 0.55 TFLOP
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 4096, 1024 * 512, 1024)
    # the same rows on a 16K prefix with 128 own tokens: FLOP-bound, and still mixed (measured +1.0%)
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 16384, 1024 * 128, 1024)
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 64 * 16384, 64 * 100, 64)
    # own-heavy (a 1K prefix) with 128 own tokens a sequence: four tiles per four-head ticket
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 1024, 1024 * 128, 1024)
    # own parts shorter than any decode run measured; exactly 64 a sequence mixes
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 1024, 1024 * 63, 1024)
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 1024, 1024 * 64, 1024)
    # a 64K document with 128 own tokens a sequence (ratio 512): two kernels; 32K (256): mixed
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 64 * 65536, 64 * 128, 64)
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 64 * 32768, 64 * 128, 64)
    long = mixed_rule.LONG_SHARED * 64 * 100
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, long - 1, 64 * 100, 64)  # the boundary
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, long, 64 * 100, 64)
    # GQA 8 (the 70B's TP=2 shard, 32 / 4 heads): 256 rows on a 16K prefix with 128 own tokens
    # (products per query head 1,024 x the own tokens) run two kernels on 192-row tiles; 128 rows
    # (1,024 stacked: 192-row tiles would pad 12%) or an 8K prefix (512 x) stay mixed
    gqa8 = (32, 4, 128)
    assert not mixed_rule.use_mixed(dev, bf16, gqa8, _work(), 1, 256 * 16384, 256 * 128, 256)
    assert mixed_rule.use_mixed(dev, bf16, gqa8, _work(), 1, 128 * 16384, 128 * 128, 128)
    assert mixed_rule.use_mixed(dev, bf16, gqa8, _work(), 1, 256 * 8192, 256 * 128, 256)
    # GQA 4 at the same products per query head (a 32K prefix, 512 rows) was not measured: mixed
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 512 * 32768, 512 * 128, 512)
    # several segments (n=8 samples of 32 prompts): own parts of 128 whose bytes' time is at least
    # half the shared products' time
    many = {"segments": 2}
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 256 * 4096, 256 * 100, 256, **many)
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 16384, 1024 * 128, 1024, **many)
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 1024, 1024 * 128, 1024, **many)
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 1024, 1024 * 512, 1024)
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 2, 1024 * 4096, 1024 * 512, 1024)  # prefill
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(tma=False), 1, 1024 * 4096, 1024 * 512, 1024)
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(block_n=64), 1, 1024 * 4096, 1024 * 512, 1024)
    assert mixed_rule.use_mixed(dev, bf16, (32, 2, 128), _work(), 1, 1024 * 4096, 1024 * 512, 1024)  # G 16
    assert mixed_rule.use_mixed(dev, bf16, (32, 1, 128), _work(), 1, 1024 * 4096, 1024 * 512, 1024)  # MQA
    assert not mixed_rule.use_mixed(
        dev, bf16, (128, 2, 128), _work(), 1, 1024 * 4096, 1024 * 512, 1024
    )  # GQA 64: no own tiling
    monkeypatch.setenv("PREFIXSERVE_MIXED", "1")
    assert mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 16384, 1024 * 128, 1024)
    assert mixed_rule.may_mix(dev, bf16, shape, 1, 1024 * 4096, 1024 * 16, 1024)  # forced: any own part
    assert not mixed_rule.may_mix(dev, bf16, shape, 1, 1024 * 4096, 0, 1024)
    monkeypatch.setenv("PREFIXSERVE_MIXED", "0")
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 4096, 1024 * 512, 1024)
    monkeypatch.setattr(shared_gluon, "eligible_for", lambda *a: False)
    monkeypatch.setenv("PREFIXSERVE_MIXED", "1")
    assert not mixed_rule.use_mixed(dev, bf16, shape, _work(), 1, 1024 * 4096, 1024 * 512, 1024)


def test_own_rows_rule(monkeypatch) -> None:
    """128-row own tiles where they measured faster: GQA 4 with short own parts (S=128 steps) and a
    shared part under SHARED_HEAVY times the own one, and ptxas >= 12.9 to build the kernel; 64 rows
    otherwise."""
    monkeypatch.setattr(_ptxas, "newer_ptxas", lambda: ("ptxas", "12.9"))
    assert mixed_rule.own_rows_for(1024 * 128, 1024, 4) == 128
    assert mixed_rule.own_rows_for(256 * 150, 256, 4) == 128
    assert mixed_rule.own_rows_for(1024 * 192, 1024, 4) == 64  # measured level there
    assert mixed_rule.own_rows_for(1024 * 512, 1024, 4) == 64  # long tickets
    assert mixed_rule.own_rows_for(1024 * 128, 1024, 8) == 64  # GQA 8 measured slower
    assert mixed_rule.own_rows_for(1024 * 128, 1024, 3) == 64  # and GQA 3
    # shared-heavy steps keep three shared ring slots: 64-row own tiles on a 16K prefix, 128 on 4K
    assert mixed_rule.own_rows_for(64 * 128, 64, 4, 64 * 16384) == 64
    assert mixed_rule.own_rows_for(1024 * 128, 1024, 4, 1024 * 4096) == 128
    heavy = mixed_rule.SHARED_HEAVY * 64 * 128
    assert mixed_rule.own_rows_for(64 * 128, 64, 4, heavy - 1) == 128  # the boundary
    assert mixed_rule.own_rows_for(64 * 128, 64, 4, heavy) == 64
    monkeypatch.setattr(_ptxas, "newer_ptxas", lambda: None)  # Triton's ptxas 12.8 only
    assert mixed_rule.own_rows_for(1024 * 128, 1024, 4) == 64
    assert mixed_gluon.ring_stages(128) == (2, 2)
    assert mixed_gluon.ring_stages(64) == (mixed_gluon.SHARED_STAGES, mixed_gluon.OWN_STAGES)
    assert mixed_gluon.ring_stages(64, 128) == (2, 2)  # 128-token shared tiles: 64 KB a slot
    with pytest.raises(ValueError, match="do not fit"):
        mixed_gluon.ring_stages(128, 128)
    assert mixed_rule.own_tiling(32, 8, 16, 128) == (2, 8)  # 64 tokens of each of two heads


def test_shared_tokens_rule(monkeypatch) -> None:
    """128-token shared tiles in shared-heavy steps with 64-row own tiles (measured faster in whole
    decode steps on a 16K prefix), 64 elsewhere; ``mixed_rows`` returns both as ``MixedTiles``."""
    heavy = mixed_rule.SHARED_HEAVY * 256 * 128
    assert mixed_rule.shared_tokens_for(64, 256 * 128, 256 * 16384) == 128  # 256 x 16K
    assert mixed_rule.shared_tokens_for(64, 256 * 128, heavy) == 128  # the boundary
    assert mixed_rule.shared_tokens_for(64, 256 * 128, heavy - 1) == 64
    assert mixed_rule.shared_tokens_for(128, 256 * 128, 2 * heavy) == 64  # 128-row own tiles: no room
    monkeypatch.setattr(_ptxas, "newer_ptxas", lambda: ("ptxas", "12.9"))
    monkeypatch.setattr(mixed_rule, "use_mixed", lambda *a, **kw: True)
    dev, bf16, shape = torch.device("cuda"), torch.bfloat16, (32, 8, 128)
    tiles_16k = mixed_rule.mixed_rows(dev, bf16, shape, _work(), 1, 1024 * 16384, 1024 * 128, 1024)
    assert tiles_16k == mixed_rule.MixedTiles(64, 128) and tiles_16k.shared_n == 128
    tiles_4k = mixed_rule.mixed_rows(dev, bf16, shape, _work(), 1, 1024 * 4096, 1024 * 128, 1024)
    assert tiles_4k == (128, 64)  # short own parts on a 4K prefix: 128-row own tiles
    monkeypatch.setattr(mixed_rule, "use_mixed", lambda *a, **kw: False)
    assert mixed_rule.mixed_rows(dev, bf16, shape, _work(), 1, 1, 1, 1) is None


@pytest.mark.skipif(not shared_gluon.GLUON, reason="this Triton has no Gluon")
def test_128_row_own_tiles_refuse_the_bundled_ptxas(monkeypatch) -> None:
    """Without ptxas >= 12.9, a 128-row launch is refused by name, not miscompiled (kernels.md §2.5)."""
    monkeypatch.setattr(mixed_gluon, "NEWER_PTXAS", False)
    with pytest.raises(RuntimeError, match=r"ptxas >= 12\.9"):
        mixed_gluon.launch_mixed(*([None] * 12), own_m=128)


def _newer_ptxas_or_skip(own_m: str) -> None:
    if own_m == "128" and _ptxas.newer_ptxas() is None:
        pytest.skip("128-row own tiles need ptxas >= 12.9")


def _decode_batch(groups, bs, hq, hkv, dim, dtype, seed):
    """Sequences on contiguous prefixes (``groups`` = [(prefix tokens, sequences, max own)]), own
    blocks scattered over the pool; returns (q, k, v, meta)."""
    gen = torch.Generator().manual_seed(seed)
    owns = [torch.randint(1, m + 1, (n,), generator=gen).tolist() for _, n, m in groups]
    prefix_blocks = [p // bs for p, _, _ in groups]
    need = sum(prefix_blocks) + sum(-(-o // bs) for own in owns for o in own) + 2
    k = torch.randn(need, bs, hkv, dim, generator=gen).cuda().to(dtype)
    v = torch.randn(need, bs, hkv, dim, generator=gen).cuda().to(dtype)
    first = sum(prefix_blocks)
    perm = (first + torch.randperm(need - first, generator=gen)).tolist()
    tables, seq_lens, at, base = [], [], 0, 0
    for nb, own in zip(prefix_blocks, owns, strict=True):
        for o in own:
            n = -(-o // bs)
            tables.append(list(range(base, base + nb)) + perm[at : at + n])
            at += n
            seq_lens.append(nb * bs + o)
        base += nb
    meta = build_metadata(bs, [1] * len(seq_lens), seq_lens, tables, "cuda")
    q = torch.randn(len(seq_lens), hq, dim, generator=gen).cuda().to(dtype)
    return q, k, v, meta


def _force_own_rows(monkeypatch, own_m: str, shared_n: int = mixed_rule.SHARED_N) -> None:
    """Own tiles of ``own_m`` rows and shared tiles of ``shared_n`` tokens whatever the rules would
    pick (every shape the rules can give is tested)."""
    _newer_ptxas_or_skip(own_m)
    monkeypatch.setattr(mixed_rule, "own_rows_for", lambda *args: int(own_m))
    monkeypatch.setattr(mixed_rule, "shared_tokens_for", lambda *args: shared_n)


# (own tile rows, shared tile tokens): every pair the rules give
MIXED_TILES = [("64", 64), ("64", 128), ("128", 64)]


def _run(q, k, v, meta, mixed: bool):
    be = TritonBackend()
    be.mixed = mixed
    be.prepare(meta)
    out = be.forward(q, k, v, meta, q.shape[-1] ** -0.5)
    again = be.forward(q, k, v, meta, q.shape[-1] ** -0.5)  # a later layer: the recorded launch
    lay = next(iter(meta.plan.layouts.values()))
    return out, again, lay


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize(
    ("groups", "hq", "hkv", "dim", "dtype", "sms", "bs"),
    [
        ([(2048, 96, 300)], 16, 4, 128, torch.bfloat16, None, 16),  # own tickets of 1-10 tiles, ragged
        ([(1024, 40, 40), (4096, 70, 700)], 32, 8, 128, torch.bfloat16, None, 16),  # two segments
        ([(1536, 64, 130)], 64, 8, 64, torch.float16, None, 16),  # GQA 8, d 64: N = 16
        ([(512, 300, 64)], 8, 8, 128, torch.bfloat16, 1, 16),  # GQA 1: one program walks every shared ticket
        ([(2048, 140, 257)], 16, 8, 64, torch.bfloat16, 7, 16),  # GQA 2: more shared tickets than programs
        ([(1024, 40, 40), (4096, 70, 700)], 32, 8, 128, torch.bfloat16, 5, 16),  # and two segments
        ([(1024, 128, 129)], 32, 8, 128, torch.bfloat16, 500, 16),  # mostly own-only programs
        ([(1024, 90, 333)], 64, 2, 128, torch.bfloat16, None, 16),  # GQA 32: tickets of one head, N = 32
        ([(1024, 60, 200)], 32, 2, 128, torch.bfloat16, None, 16),  # GQA 16: two heads, N = 32
        ([(1024, 50, 150)], 16, 1, 128, torch.bfloat16, None, 16),  # one KV head: N = 16
        ([(2048, 100, 300)], 32, 8, 128, torch.bfloat16, None, 32),  # cache blocks of 32 tokens
    ],
)
@pytest.mark.parametrize(("own_m", "shared_n"), MIXED_TILES)
def test_engine_decode_step_through_the_mixed_kernel(
    monkeypatch, groups, hq, hkv, dim, dtype, sms, bs, own_m, shared_n
) -> None:
    """The mixed launch (own tiles of 64 and of 128 rows, shared tiles of 64 and of 128 tokens)
    against the two-kernel path and the fp64-backed reference; a later layer's replay (descriptors
    remade) matches the first launch."""
    _force_own_rows(monkeypatch, own_m, shared_n)
    if sms is not None:  # the grid: one program per SM
        monkeypatch.setattr(tiles, "num_sms", lambda device=None: sms)
    q, k, v, meta = _decode_batch(groups, bs, hq, hkv, dim, dtype, seed=hq + dim + len(groups))
    calls = []
    original = mixed_gluon.launch_mixed
    monkeypatch.setattr(mixed_gluon, "launch_mixed", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    out, again, lay = _run(q, k, v, meta, mixed=True)
    assert lay.mixed == (int(own_m), shared_n) and calls == [1]
    split, _, lay_split = _run(q, k, v, meta, mixed=False)
    assert not lay_split.mixed
    ref = ReferenceBackend().forward(q.double(), k.double(), v.double(), meta, dim**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1.1 * rel_err(split, ref) + 1e-4
    assert rel_err(again, out) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize(("own_m", "shared_n"), MIXED_TILES)
def test_mixed_kernel_where_the_running_max_keeps_growing(monkeypatch, own_m, shared_n) -> None:
    """Prefix keys scaled up along the prefix, with a jump at 3/4 (rows' scores grow by several log2
    units a tile, O rescaled by factors far from 1): the mixed launch holds the two-kernel path's
    error against the reference."""
    _force_own_rows(monkeypatch, own_m, shared_n)
    prefix, bs = 4096, 16
    q, k, v, meta = _decode_batch([(prefix, 64, 200)], bs, 32, 8, 128, torch.bfloat16, seed=5)
    t = torch.arange(prefix, device=k.device, dtype=torch.float32)
    ramp = (1 + 12 * t / prefix + 20 * (t >= 3 * prefix // 4)).view(-1, bs, 1, 1)
    k[: prefix // bs] = (k[: prefix // bs].float() * ramp).to(k.dtype)
    out, again, lay = _run(q, k, v, meta, mixed=True)
    assert lay.mixed == (int(own_m), shared_n)
    split, _, _ = _run(q, k, v, meta, mixed=False)
    ref = ReferenceBackend().forward(q.double(), k.double(), v.double(), meta, 128**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1.1 * rel_err(split, ref) + 1e-4
    assert rel_err(again, out) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize(
    ("own", "shift", "hkv", "hq"),
    # (128, 0, 2, 64): GQA 32, tickets of one KV head
    [(128, 0, 8, 32), (128, 16, 8, 32), (96, 0, 8, 32), (128, 0, 2, 64), (200, 7, 8, 32), (160, 3, 8, 64)],
)
@pytest.mark.parametrize(("own_m", "shared_n"), MIXED_TILES)
def test_own_partials_exact_on_a_one_hot_probe(monkeypatch, own, shift, hkv, hq, own_m, shared_n) -> None:
    """Own partials, read before the merge, are exact where exact arithmetic allows: K = 0 (every
    score 0, so p = 1 on each own token) and V of own token i = (KV head + 1) x onehot((i + shift) % d),
    so o[d] = (head + 1) x (own tokens on d) / n, and lse = ln n. Every value is exact
    in bf16 and fp32, so any lost, stale or misplaced tile row or accumulator row shows (docs/kernels.md
    §2.5: the 128-row own tile built by ptxas 12.8 fails here, losing d 32-63 and 96-127). Shared memory
    is filled with NaN tiles first, and the partials are read after one launch, so stale reads show too."""
    _force_own_rows(monkeypatch, own_m, shared_n)
    bs, dim, n_seqs, prefix = 16, 128, 128, 1024
    nb, per = prefix // bs, -(-own // bs)
    k = torch.zeros(nb + n_seqs * per + 2, bs, hkv, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    perm = (nb + torch.randperm(n_seqs * per, generator=torch.Generator().manual_seed(own))).tolist()
    tables = [list(range(nb)) + perm[s * per : (s + 1) * per] for s in range(n_seqs)]
    meta = build_metadata(bs, [1] * n_seqs, [prefix + own] * n_seqs, tables, "cuda")
    heads = (torch.arange(hkv, device="cuda") + 1).to(v.dtype)
    rows = torch.tensor([t[nb + i // bs] * bs + i % bs for t in tables for i in range(own)], device="cuda")
    d_of = (torch.arange(own, device="cuda") + shift) % dim
    one_hot = torch.zeros(own, hkv, dim, dtype=v.dtype, device="cuda")
    one_hot[torch.arange(own, device="cuda"), :, d_of] = 1
    v.view(-1, hkv, dim)[rows] = (one_hot * heads[None, :, None]).repeat(n_seqs, 1, 1)
    q = torch.randn(n_seqs, hq, dim, generator=torch.Generator().manual_seed(1)).cuda().to(k.dtype)
    be = TritonBackend()
    be.mixed = True
    be.prepare(meta)
    nan = torch.full((4096, 4096), float("nan"), dtype=k.dtype, device="cuda")
    (nan @ nan).sum().item()  # every SM's shared memory full of NaN tiles: stale reads show
    be.forward(q, k, v, meta, dim**-0.5)  # one launch, read before any later one
    lay = next(iter(meta.plan.layouts.values()))
    assert lay.mixed == (int(own_m), shared_n)
    first = lay.work.num_slots  # own partial of sequence s: slot first + s
    o, lse = lay.o_part[first : first + n_seqs], lay.lse_part[first : first + n_seqs]
    expect = torch.bincount(d_of, minlength=dim).float().expand(hq, dim)  # tokens on each d
    expect = expect * heads.float().repeat_interleave(hq // hkv)[:, None] / own
    off = ~((o - expect).abs() < 1e-6)  # NaN counts as off
    bad_d = off.any(0).any(0).nonzero().flatten().tolist()  # which accumulator rows
    assert not bad_d, f"own partials off at d = {bad_d} ({int(o.isnan().sum())} NaN)"
    assert (lse - math.log(own)).abs().max() < 1e-5


def _captured_step_replays(q, k, v, meta, prefixes, bucket, trims, check_key) -> None:
    """The graph path's attention for ``meta``'s decode step (``check_key`` asserts on its graph key),
    captured in a CUDA graph, then replayed on later steps whose own parts are shorter by up to each
    of ``trims`` tokens (one at least), padding rows past the sequences, against the reference."""
    from prefixserve.attention.graph import HeadShape

    hq, dim, dtype = q.shape[1], q.shape[2], q.dtype
    shape = HeadShape(hq, k.shape[2], dim, dtype, q.device)
    be = TritonBackend()
    step = be.graph_step(meta, shape, bucket)
    check_key(step.key)
    attn = step.build()
    static_q = torch.zeros(bucket, hq, dim, dtype=dtype, device=q.device)
    static_q[: q.shape[0]] = q
    attn.o_part.fill_(float("nan"))  # stale partials must never be read
    attn.load(step.arrays)
    attn.forward(static_q, k, v, None, dim**-0.5)  # first launch: records (and warms up) the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attn.forward(static_q, k, v, None, dim**-0.5)
    for trim in trims:
        lens = [n - min(trim, n - p - 1) for n, p in zip(meta.seq_lens_host, prefixes, strict=True)]
        tables = [row[: -(-n // 16)].tolist() for row, n in zip(meta.block_tables_np, lens, strict=True)]
        later = build_metadata(16, [1] * len(lens), lens, tables, "cuda")
        later_step = be.graph_step(later, shape, bucket)
        if later_step.key != step.key:
            later_step = later_step.refit(step.key)
        assert later_step.key == step.key
        attn.load(later_step.arrays)
        graph.replay()
        ref = ReferenceBackend().forward(q.double(), k.double(), v.double(), later, dim**-0.5)
        got = static_out[: q.shape[0]]
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("shared_n", [None, 128])  # the rules' tiles; 128-token shared tiles forced
def test_captured_decode_graph_through_the_mixed_kernel(monkeypatch, shared_n) -> None:
    """The graph path (the engine's decode graphs) takes the mixed kernel, and a captured graph
    replays it on a later step with new lengths and padding rows, against the reference."""
    monkeypatch.setenv("PREFIXSERVE_MIXED", "1")
    if shared_n:
        _force_own_rows(monkeypatch, "64", shared_n)
    groups = [(1024, 100, 300), (2048, 60, 200)]
    q, k, v, meta = _decode_batch(groups, 16, 32, 8, 128, torch.bfloat16, seed=5)

    def check_key(key) -> None:
        assert key[0] == "shared" and key[4][5] and key[3] == 1  # mixed: one own partial
        assert shared_n is None or key[4][5] == (64, shared_n)

    prefixes = [1024] * 100 + [2048] * 60
    _captured_step_replays(q, k, v, meta, prefixes, 256, (0, 37), check_key)  # 96 padding rows


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
def test_captured_decode_graph_through_192_row_shared_tiles() -> None:
    """A decode step with short own parts on a 4K prefix at GQA 8 (2,048 stacked rows: 192-row tiles,
    two kernels) in a captured graph, replayed on a later step with new lengths and padding rows,
    against the reference."""
    q, k, v, meta = _decode_batch([(4096, 256, 40)], 16, 32, 4, 128, torch.bfloat16, seed=9)

    def check_key(key) -> None:
        assert key[0] == "shared" and key[4][0] == 192 and not key[4][5]

    _captured_step_replays(q, k, v, meta, [4096] * 256, 320, (0, 17), check_key)  # 64 padding rows


def test_mixable_decode_steps_prefer_tall_shared_tiles() -> None:
    """At 256 stacked rows over a 4K prefix the shared kernel alone is faster on 64-row tiles, but a
    step that can run as one mixed launch takes 128-row ones (the mixed kernel needs them)."""
    from prefixserve.attention.planning.shared_plan import pick_shared_tiles

    assert pick_shared_tiles(64, 4, max_tokens=4096, tma=True)[0] == 64
    assert pick_shared_tiles(64, 4, max_tokens=4096, tma=True, mixable=True)[0] == 128
    assert pick_shared_tiles(64, 4, max_tokens=2048, tma=True, mixable=True)[0] == 64  # below half
    assert pick_shared_tiles(64, 4, max_tokens=8192, tma=True)[0] == 128  # tall anyway


def test_the_planner_passes_mixable_to_the_tiles(monkeypatch) -> None:
    """``plan_shared_work(mixable=True)`` plans 128-row tiles at 256 stacked rows over a 4K segment
    when its blocks allow TMA tiles (the mixed kernel's condition); pointer loads keep 64 rows."""
    from prefixserve.attention.planning import shared_plan

    monkeypatch.setattr(shared_plan, "tma_capable", lambda *a: True)
    blocks = np.arange(4096 // 16, dtype=np.int32)  # one segment in consecutive blocks
    kw = {"seg_blocks": blocks, "seg_block_start": [0, len(blocks)], "block_size": 16}
    args = ([0, 64], [4096], 8, 4, torch.device("cpu"))
    assert shared_plan.plan_shared_work(*args, **kw).block_m == 64
    assert shared_plan.plan_shared_work(*args, **kw, mixable=True).block_m == 128
    monkeypatch.setattr(shared_plan, "tma_capable", lambda *a: False)
    assert shared_plan.plan_shared_work(*args, **kw, mixable=True).block_m == 64


def test_wide_tiles_where_the_gluon_kernel_runs_a_step_that_does_not_mix(monkeypatch) -> None:
    """192-row tiles (the Gluon kernel's three consumer warpgroups) for tall TMA steps that will not
    mix, where padding to 192 rows costs at most 4% over 128 (2,048 stacked rows: 2,112 vs 2,048;
    1,024: 1,152 vs 1,024 keeps 128); never for a mixable step, a pointer-load one, fp32, an e4m3
    cache, or where the Gluon kernel does not run (``wide`` false: the Triton kernel takes powers of
    two only)."""
    from prefixserve.attention.planning import shared_plan
    from prefixserve.attention.planning.shared_plan import pick_shared_tiles, wide_tiles_pay

    assert wide_tiles_pay([2048]) and wide_tiles_pay([8192]) and wide_tiles_pay([192])
    assert not wide_tiles_pay([1024]) and not wide_tiles_pay([256]) and not wide_tiles_pay([128])
    # several segments: the padded work (rows x tokens) of all of them counts
    assert wide_tiles_pay([2048, 32], [16384, 100])  # a 16K prefix and a short 32-row segment
    assert not wide_tiles_pay([2048, 32], [4096, 4096])  # 32 rows padded to 192, not 128: 5.9% more work
    tall = {"max_tokens": 16384, "tma": True}
    assert pick_shared_tiles(256, 8, **tall, wide=True) == (192, 128, 2)  # 70B's TP=2 shard
    assert pick_shared_tiles(256, 8, **tall, wide=True, mixable=True)[0] == 128  # the mixed kernel's
    assert pick_shared_tiles(256, 8, **tall, wide=False)[0] == 128
    assert pick_shared_tiles(256, 8, max_tokens=16384, tma=False, wide=True)[0] == 128
    assert pick_shared_tiles(256, 8, **tall, elt=4, wide=True)[0] == 128
    # the planner asks shared_gluon.eligible_for; its items then hold 192 // 8 = 24 rows each
    monkeypatch.setattr(shared_plan, "tma_capable", lambda *a: True)
    monkeypatch.setattr(shared_plan.shared_gluon, "eligible_for", lambda *a: True)
    blocks = np.arange(16384 // 16, dtype=np.int32)
    kw = {"seg_blocks": blocks, "seg_block_start": [0, len(blocks)], "block_size": 16}
    work = shared_plan.plan_shared_work([0, 256], [16384], 4, 8, torch.device("cpu"), **kw)
    assert (work.block_m, work.block_n, work.num_stages) == (192, 128, 2)
    rows = work.items[:, 2] - work.items[:, 1]
    assert int(rows.max()) == 24 and int(rows.sum()) == 256 * work.splits[0]
    plan = shared_plan.plan_shared_work
    assert plan([0, 128], [16384], 4, 8, torch.device("cpu"), **kw).block_m == 128  # 1,024 rows: padding
    # over an e4m3 cache the Gluon kernel widens its tiles, and 192-row tiles lose (docs/kernels.md §2.13)
    e4m3 = {"kv_dtype": torch.float8_e4m3fn}
    assert plan([0, 256], [16384], 4, 8, torch.device("cpu"), **kw, **e4m3).block_m == 128
    assert plan([0, 256], [16384], 4, 8, torch.device("cpu"), **kw, kv_dtype=torch.bfloat16).block_m == 192
    monkeypatch.setattr(shared_plan.shared_gluon, "eligible_for", lambda *a: False)
    assert plan([0, 256], [16384], 4, 8, torch.device("cpu"), **kw).block_m == 128
