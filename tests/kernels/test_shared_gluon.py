"""The warp-specialised Gluon shared kernel (Hopper): it compiles for sm_90 on any machine, and on an
H100/H200 it matches the Triton kernel and the fp64 reference, in the kernel API and in the engine.

Gluon has no CPU interpreter, so CI (no GPU) checks what can be checked without one: the whole
NVIDIA pipeline, ptxas included, builds the kernel for sm_90 at every shape the engine sends it, its
shared memory fits an SM, and its partitions ask for the registers the design counts on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _kernel_helpers import DEVICE, CountedCalls, compiled_for_hopper, rel_err

from prefixserve.attention import _ptxas
from prefixserve.attention.kernels import mixed_gluon, shared_gluon, shared_gluon_fp8
from prefixserve.attention.kernels.shared_attention import (
    shared_segment_attention,
    shared_segment_attention_ref,
)
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.planning import mixed_rule
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.attention.triton_backend import TritonBackend

needs_gluon = pytest.mark.skipif(not shared_gluon.GLUON, reason="this Triton has no Gluon")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SMEM_PER_BLOCK_HOPPER = 232_448


@needs_gluon
def test_kernel_compiles_for_sm90() -> None:
    """Each kernel variant through the whole sm_90 pipeline, the shapes between them covering GQA
    4 / 8 / 16 (16: own tiles of N = 32), d 128 / 64 and bf16 / fp16: the shared kernel (128- and
    192-row tiles) and the mixed kernel (mixed_gluon.py; 64- and 128-row own tiles, the shared-heavy
    form); the mixed kernel's cubin by ptxas >= 12.9 where Triton has one (``_ptxas``). One shape a
    variant and dtype: each compile costs CI seconds on the CPU. Over an e4m3 cache the variants the
    engine runs: 128-row tiles widened, or on FP8 tensor cores (the planner never gives an e4m3 step
    192-row tiles, docs/kernels.md §2.13)."""
    shapes = [
        "shared:4:128:bf16",
        "shared192:8:128:bf16",
        "sharedfp8:4:128:bf16",  # over an e4m3 cache: a widening warpgroup joins
        "sharedfp8mma:4:128:bf16",  # its products on FP8 tensor cores: a transposing warpgroup joins
        "mixed:16:128:bf16",
        "mixed128:4:128:bf16",
        "mixedheavy:8:64:fp16",
    ]
    # through ptxas every time: which one builds each kernel shows
    results = compiled_for_hopper("_gluon_compile.py", *shapes, TRITON_ALWAYS_COMPILE="1")
    assert [r["shape"] for r in results] == shapes
    for r in results:
        assert r["shared"] <= SMEM_PER_BLOCK_HOPPER, r  # the 3-stage ring and Q fit one SM
        assert r["wgmma"] and r["tma"], r  # Hopper tensor-core products and TMA tile loads
        # the loader warps drop to 24 registers; the consumer warpgroups run at 240 (shared kernel),
        # 160 (its 192-row tiles: three of them), or the shared ones at SHARED_REGS and the own one
        # at OWN_REGS (mixed kernel)
        kernel = r["shape"].split(":")[0]
        regs = {
            "shared": {"24", "240"},
            "shared192": {"24", "160"},
            "sharedfp8": {
                "24",
                str(shared_gluon.FP8_WIDEN_REGS[128]),
                str(shared_gluon.FP8_CONSUMER_REGS[128]),
            },
            "sharedfp8mma": {
                "24",
                str(shared_gluon_fp8.TRANSPOSE_REGS),
                str(shared_gluon_fp8.CONSUMER_REGS),
            },
        }.get(kernel, {"24", str(mixed_gluon.SHARED_REGS), str(mixed_gluon.OWN_REGS)})
        assert regs <= set(r["setmaxnreg"]), r
        assert r["cubin_bytes"] > 0
        assert not r["wgmma_serialized"], r  # ptxas keeps the async products async
        mixed = kernel.startswith("mixed")
        assert r["newer_ptxas"] == (mixed and _ptxas.newer_ptxas() is not None), r


def test_eligibility_rule() -> None:
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    assert not shared_gluon.eligible(q, k, k, 128, 128)  # not on a GPU
    if HOPPER and shared_gluon.GLUON:
        qc, kc = q.cuda(), k.cuda()
        assert shared_gluon.eligible(qc, kc, kc, 128, 128)
        assert not shared_gluon.eligible(qc, kc, kc, 64, 128)  # short tiles stay on the Triton kernel
        assert not shared_gluon.eligible(qc.float(), kc.float(), kc.float(), 128, 128)
        assert not shared_gluon.eligible(qc[..., :96], kc[..., :96], kc[..., :96], 128, 128)
        k8 = kc.to(torch.float8_e4m3fn)
        assert shared_gluon.eligible(qc, k8, k8, 128, 128)  # an FP8 KV cache under 16-bit q
        assert not shared_gluon.eligible(qc, k8, kc, 128, 128)
        assert not mixed_rule.eligible(qc, k8, k8, 128, 128)  # the mixed kernel's own tiles take no e4m3


def _counter(monkeypatch: pytest.MonkeyPatch) -> CountedCalls:
    """The launches that took the Gluon kernel."""
    return CountedCalls(monkeypatch, shared_gluon, "launch_shared_gluon")


# (GQA group, head size, segment lengths, rows holding each, KV split) of the Gluon kernels' GPU tests
SEGMENT_CASES = [
    (4, 128, [4096], [96], False),
    (4, 128, [1000, 48, 2100], [40, 33, 70], False),  # ragged tails, a segment under one tile
    (8, 64, [777, 1536], [17, 50], True),
    (8, 128, [2048], [40], False),  # the last tile's last warpgroup has no rows
]


def prefix_decode_step(kv_dtype: torch.dtype):
    """A decode step of 96 sequences on a contiguous 2,048-token prefix (GQA 4, d 128), own suffixes
    of 1-89 tokens on shuffled blocks, the cache in ``kv_dtype``: (q, k, v, metadata) on the GPU."""
    gen = torch.Generator().manual_seed(11)
    batch, prefix, bs, hq, hkv, dim = 96, 2048, 16, 16, 4, 128
    own = torch.randint(1, 90, (batch,), generator=gen).tolist()
    n_prefix = prefix // bs
    need = n_prefix + sum(-(-(o + 1) // bs) for o in own) + 1
    k = torch.randn(need, bs, hkv, dim, generator=gen).cuda().bfloat16().to(kv_dtype)
    v = torch.randn(need, bs, hkv, dim, generator=gen).cuda().bfloat16().to(kv_dtype)
    perm = (n_prefix + torch.randperm(need - n_prefix, generator=gen)).tolist()
    tables, seq_lens, at = [], [], 0
    for o in own:
        n = -(-(o + 1) // bs)
        tables.append(list(range(n_prefix)) + perm[at : at + n])
        at += n
        seq_lens.append(prefix + o + 1)
    meta = build_metadata(bs, [1] * batch, seq_lens, tables, "cuda")
    q = torch.randn(batch, hq, dim, generator=gen).cuda().bfloat16()
    return q, k, v, meta


def _segments(lengths: list[int], rows: list[int], group: int, dim: int, dtype: torch.dtype, seed: int):
    """Contiguous segments of ``lengths`` tokens (any length: ragged last tiles), each held by ``rows``."""
    gen = torch.Generator().manual_seed(seed)
    bs, kv_heads = 16, 2
    nblk = [-(-n // bs) for n in lengths]
    total = sum(nblk) + 3
    k = torch.randn(total, bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(total, bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    n_rows = max(rows) + 5
    q = torch.randn(n_rows, kv_heads * group, dim, generator=gen).to(DEVICE, dtype)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    seg_blocks = torch.arange(1, 1 + sum(nblk), **i32)  # consecutive blocks after block 0
    seg_rows = torch.cat([torch.randperm(n_rows, generator=gen)[:r] for r in rows]).to(**i32)
    return (
        q,
        k,
        v,
        (
            seg_blocks,
            torch.tensor([0, *np.cumsum(nblk).tolist()], **i32),
            torch.tensor(lengths, **i32),
            seg_rows,
            torch.tensor([0, *np.cumsum(rows).tolist()], **i32),
        ),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("group", "dim", "lengths", "rows", "split"),
    [
        (4, 128, [4096], [96], False),  # whole tiles, two M-tiles (the last part-filled)
        (4, 128, [1000, 48, 2100], [40, 33, 70], False),  # ragged tails, a segment under one tile
        (8, 64, [777, 1536], [17, 50], True),  # KV splits, 16 rows per tile
        (1, 128, [300], [200], True),  # one query head per KV head
        (2, 64, [5000], [130], True),
        (8, 128, [2048], [40], False),  # 320 stacked rows: the last tile's last warpgroup has none
    ],
)
@pytest.mark.parametrize("block_m", [128, 192])
def test_gluon_matches_triton_kernel_and_fp64(
    monkeypatch, dtype, group, dim, lengths, rows, split, block_m
) -> None:
    """128- and 192-row tiles (three consumer warpgroups) against the Triton kernel's 128-row ones
    and fp64."""
    q, k, v, seg = _segments(lengths, rows, group, dim, dtype, seed=group * dim + len(lengths))
    _gluon_against_triton(monkeypatch, (q, k, v, seg), split, block_m)


def _gluon_against_triton(monkeypatch, case: tuple, split: bool, block_m: int) -> None:
    """The Gluon kernel on ``block_m``-row tiles against the Triton kernel's 128-row ones and fp64
    over the same cache values (an e4m3 cache's widened)."""
    q, k, v, seg = case
    kw = {"block_m": 128}
    if split:
        kw |= {"min_chunk": 128, "target_programs": 4096}
    counter = _counter(monkeypatch)
    with shared_gluon_fp8.products(False):  # over e4m3 the widening kernel (on: test_shared_fp8mma.py)
        o_g, lse_g = shared_segment_attention(q, k, v, *seg, 0.09, **(kw | {"block_m": block_m}))
    assert counter.calls == 1
    monkeypatch.setattr(shared_gluon, "GLUON", False)  # the Triton kernel
    o_t, lse_t = shared_segment_attention(q, k, v, *seg, 0.09, **kw)
    assert counter.calls == 1
    ref_o, ref_lse = shared_segment_attention_ref(q, k.float(), v.float(), *seg, 0.09, torch.float64)
    # the same products and softmax steps, scheduled differently: the row statistics agree exactly;
    # o can differ where the two compilers round a P element to 16 bits differently (its exponent
    # computed with or without a fused multiply-add), so o is held to the Triton kernel's own error
    assert float((lse_g - lse_t).abs().max()) < 1e-5
    bound = 1.1 * rel_err(o_t, ref_o) + 1e-4
    if k.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16:
        # the Triton kernel widens e4m3 to fp16 for bf16 q (``attend.widened_q``), the Gluon kernel to
        # bf16: it is held to bf16's rounding of P instead (1.4e-3 measured, H200)
        bound = 2.0**-8
    assert rel_err(o_g, ref_o) <= bound, (rel_err(o_g, ref_o), rel_err(o_t, ref_o))
    assert float((lse_g.double() - ref_lse).abs().max()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize(
    ("group", "dim", "lengths", "rows"), [(4, 128, [4096], [96]), (8, 64, [1000, 3000], [40, 17])]
)
def test_running_max_that_keeps_growing(monkeypatch, group, dim, lengths, rows) -> None:
    """Keys scaled up along each segment, with a jump at 3/4: a row's running max grows by several
    log2 units a tile, so every tile rescales O by a factor far from 1, and the Gluon kernel holds the
    Triton kernel's error against fp64."""
    q, k, v, seg = _segments(lengths, rows, group, dim, torch.bfloat16, seed=7 * group + dim)
    seg_blocks, block_ptr = seg[0], seg[1]
    bs = k.shape[1]
    for i, n in enumerate(lengths):  # token t of segment i: keys x (1 + 12 t / n), a jump at 3/4
        blocks = seg_blocks[block_ptr[i] : block_ptr[i + 1]].long()
        t = torch.arange(blocks.numel() * bs, device=k.device, dtype=torch.float32)
        ramp = (1 + 12 * t / n + 20 * (t >= 3 * n // 4)).view(-1, bs, 1, 1)
        k[blocks] = (k[blocks].float() * ramp).to(k.dtype)
    o_g, lse_g = shared_segment_attention(q, k, v, *seg, 0.09, block_m=128)
    monkeypatch.setattr(shared_gluon, "GLUON", False)  # the Triton kernel
    o_t, lse_t = shared_segment_attention(q, k, v, *seg, 0.09, block_m=128)
    ref_o, ref_lse = shared_segment_attention_ref(q, k, v, *seg, 0.09, torch.float64)
    assert torch.isfinite(o_g).all()
    assert float((lse_g - lse_t).abs().max() / lse_t.abs().max()) < 1e-6
    assert float((lse_g.double() - ref_lse).abs().max() / ref_lse.abs().max()) < 1e-5
    assert rel_err(o_g, ref_o) <= 1.1 * rel_err(o_t, ref_o) + 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize(("wide", "kv_dtype"), [(True, None), (False, None), (True, torch.float8_e4m3fn)])
def test_engine_decode_step_takes_the_gluon_kernel(monkeypatch, wide, kv_dtype) -> None:
    """96 sequences on a contiguous 2,048-token prefix (384 stacked rows: tall tiles, 192-row ones
    unless ``wide_tiles_pay`` is made to refuse them), own suffixes short enough that the step runs
    two kernels: the decode step launches the Gluon kernel, a later layer replays it, both exact."""
    from prefixserve.attention.planning import shared_plan

    if not wide:
        monkeypatch.setattr(shared_plan, "wide_tiles_pay", lambda *a: False)
    q, k, v, meta = prefix_decode_step(kv_dtype or torch.bfloat16)  # e4m3: the widening warpgroup
    dim = q.shape[-1]
    counter = _counter(monkeypatch)
    with shared_gluon_fp8.products(False):  # over e4m3 the widening kernel (on: test_shared_fp8mma.py)
        be = TritonBackend()
        be.prepare(meta)
        out = be.forward(q, k, v, meta, dim**-0.5)
        again = be.forward(q, k, v, meta, dim**-0.5)  # a later layer: the recorded launch, replayed
    ref = ReferenceBackend().forward(q, k, v, meta, dim**-0.5)
    assert counter.calls >= 1
    lay = next(iter(meta.plan.layouts.values()))
    # 192-row tiles unless refused, or over an e4m3 cache (docs/kernels.md §2.13: they lose there)
    assert not lay.mixed and lay.work.block_m == (192 if wide and kv_dtype is None else 128)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(again, out) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not (HOPPER and shared_gluon.GLUON), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("group", "dim", "lengths", "rows", "split"), SEGMENT_CASES)
@pytest.mark.parametrize("block_m", [128, 192])
def test_gluon_over_an_e4m3_cache(monkeypatch, dtype, group, dim, lengths, rows, split, block_m) -> None:
    """An FP8 KV cache: the widening warpgroup converts each e4m3 tile to q's dtype (exact), so the
    kernel's products are those over the widened cache: it holds the Triton kernel's error (pointer
    loads of e4m3, widened) against fp64 over the same values, and their row statistics agree."""
    q, k, v, seg = _segments(lengths, rows, group, dim, dtype, seed=group * dim + len(lengths))
    e4m3 = torch.float8_e4m3fn
    _gluon_against_triton(monkeypatch, (q, k.to(e4m3), v.to(e4m3), seg), split, block_m)
