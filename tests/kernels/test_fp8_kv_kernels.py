"""FP8 (e4m3) KV cache: every attention path over an e4m3 cache against fp64 attention, and the RoPE
kernel's quantized store against the torch one (``attention/kv_quant.py``).

Error bounds, from e4m3's precision. A stored element is ``s * r(x / s)`` with ``s`` a power of two per
KV head and ``r`` round-to-nearest e4m3 (3 mantissa bits): in the normal range (|x / s| >= 2^-6)
``|r(y) - y| <= 2^-4 |y|``, below it (subnormals, spacing 2^-9) ``|r(y) - y| <= 2^-10``. So each
element's error is ``e(x) <= 2^-4 |x| + 2^-10 s`` (``elem_bound``). For one query row q:

* a score moves by at most ``d_j = scale * sum_d |q_d| e(k_jd)``; with ``D = max_j d_j`` every
  softmax weight changes by a factor within ``[e^-2D, e^2D]``, so the weighted sum of the true V moves
  by at most ``(e^2D - 1) max_j |v_j|`` per dim;
* the weights then meet the stored V: at most ``max_j e(v_jd)`` more.

``o_bound`` is that sum per row, head and dim (plus 1e-5 |o| for fp32 arithmetic). Against attention
over the dequantized cache itself (exactly what the kernels see) the paths must agree to fp32
rounding (rel 1e-5): scales are folded into q and the output exactly (powers of two).
"""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import DEVICE, padded_table, paged_cache, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.attention.backend import make_backend
from prefixserve.attention.kv_quant import (
    FP8,
    dequantize,
    hadamard,
    pow2_scales,
    quantize,
    rotate,
    with_scales,
)
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.window import attend_layer
from prefixserve.model.kernels.rope import rope_qkv, rope_qkv_ref


def elem_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest e4m3 storage error of each element of ``x`` [..., H, D] (module docstring)."""
    return 2.0**-4 * x.abs() + 2.0**-10 * scales.to(x.device)[:, None]


def reference(q, k, v, tables, seq_lens, query_lens, scale, window=None):
    """fp64 causal (optionally sliding-window) attention per sequence over [N, Hkv, D] rows gathered by
    ``tables`` from caches [blocks, bs, Hkv, D]; returns o [T, Hq, D] and the rows' K, V, queries."""
    bs, hkv = k.shape[1], k.shape[2]
    outs, parts = [], []
    start = 0
    for table, s_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        ks = k[table].flatten(0, 1)[:s_len].double()
        vs = v[table].flatten(0, 1)[:s_len].double()
        qs = q[start : start + q_len].double()
        group = qs.shape[1] // hkv
        kk, vv = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)  # [N, Hq, D]
        scores = torch.einsum("mhd,nhd->hmn", qs, kk) * scale
        pos = torch.arange(s_len - q_len, s_len, device=qs.device)[:, None]
        keys = torch.arange(s_len, device=qs.device)[None, :]
        visible = keys <= pos
        if window is not None:
            visible &= keys > pos - window
        scores = scores.masked_fill(~visible, -math.inf)
        outs.append(torch.einsum("hmn,nhd->mhd", scores.softmax(-1), vv))
        parts.append((qs, kk, vv, visible, scores.logsumexp(-1).T))
        start += q_len
    del bs
    return torch.cat(outs), parts


def o_bound(parts, k_err_of, v_err_of, scale):
    """Per (row, head, dim) bound on |o_fp8 - o| from the module docstring's derivation."""
    bounds = []
    for qs, kk, vv, visible, _ in parts:
        ke, ve = k_err_of(kk), v_err_of(vv)  # [N, Hq, D] element bounds
        d = scale * torch.einsum("mhd,nhd->hmn", qs.abs(), ke)  # [Hq, M, N]
        d = d.masked_fill(~visible, 0).amax(-1)  # [Hq, M]
        seen = visible[:, :, None, None]  # [M, N, 1, 1]
        vmax = (vv.abs()[None] * seen).amax(1)  # [M, Hq, D]: largest |v| a row sees, per dim
        emax = (ve[None] * seen).amax(1)
        bounds.append(torch.expm1(2 * d).T[..., None] * vmax + emax)
    return torch.cat(bounds)


def _case(bs: int, group: int, dim: int, query_lens: list[int], seed: int):
    """A shared 3-block prefix, own tails, per-head magnitudes spread over 2^-3 .. 2^5, e4m3 caches."""
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    tables = [[4, 9, 2, 11, 12], [4, 9, 2, 13], [4, 9, 16], [20, 21]]
    seq_lens = [4 * bs + 3, 3 * bs + bs - 1, 2 * bs + 5, bs + 7]
    # on the CPU (the fp64 oracle's side); each test moves what the kernels read to DEVICE
    k, v, _ = paged_cache([40 * bs], bs, hkv, dim, torch.float32, gen, device=torch.device("cpu"))
    mag = torch.tensor([2.0**-3, 2.0**5])[:, None]  # head 0 small, head 1 large
    k, v = k * mag, v * mag.flip(0)
    k = rotate(k)  # K as an e4m3 cache stores it (attend_layer turns q with it)
    scales = torch.stack([pow2_scales(t.abs().amax((0, 1, 3))) for t in (k, v)])  # [2, Hkv]
    k8, v8 = quantize(k, 1 / scales[0]), quantize(v, 1 / scales[1])
    q = torch.randn(sum(query_lens), hkv * group, dim, generator=gen)
    meta = build_metadata(bs, query_lens, seq_lens, tables, DEVICE)
    return q, k, v, k8, v8, scales, meta, tables, seq_lens


def _turned(q: torch.Tensor) -> torch.Tensor:
    """q rotated as ``attend_layer`` rotates it over an e4m3 cache (whose K ``_case`` stores rotated),
    in fp64: the oracle's scores are then q . k."""
    return q.double() @ hadamard(q.shape[-1], q.device).double()


def _dequantized(
    k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize(k8, scales[0]), dequantize(v8, scales[1])


CASES = [
    (16, 4, 64, [1, 1, 1, 1], 0),  # decode (packed / shared decode kernels)
    (16, 1, 64, [3, 7, 2, 5], 1),  # prefill chunks over cached blocks
    (32, 2, 32, [1, 4, 1, 2], 2),  # mixed
]
BACKENDS = ["reference", "cascade", "auto", "triton", "triton_paged"]


@pytest.mark.parametrize(("bs", "group", "dim", "query_lens", "seed"), CASES)
def test_fp8_paths_match_fp64(bs: int, group: int, dim: int, query_lens: list[int], seed: int) -> None:
    _check_paths(bs, group, dim, query_lens, seed)


@settings(max_examples=12, deadline=None)
@given(
    bs=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 2, 3, 4]),
    dim=st.sampled_from([32, 64, 128]),
    query_lens=st.lists(st.integers(1, 9), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_fp8_paths_match_fp64_on_random_steps(
    bs: int, group: int, dim: int, query_lens: list[int], seed: int
) -> None:
    """Every backend over e4m3 caches on steps hypothesis draws: block size, GQA group, head size,
    each sequence's new tokens (decode, prefill chunks over cached blocks, mixed) and the values."""
    _check_paths(bs, group, dim, query_lens, seed)


def _check_paths(bs: int, group: int, dim: int, query_lens: list[int], seed: int) -> None:
    """Each backend's output within the e4m3 bound of the fp64 attention over the unrounded cache,
    and equal to the attention over the dequantized cache; the prefix on the shared-segment kernel."""
    q, k, v, k8, v8, scales, meta, tables, seq_lens = _case(bs, group, dim, query_lens, seed)
    scale = dim**-0.5
    exact, parts = reference(_turned(q), k, v, tables, seq_lens, query_lens, scale)
    deq, _ = reference(_turned(q), *_dequantized(k8, v8, scales), tables, seq_lens, query_lens, scale)
    bound = o_bound(parts, lambda x: elem_bound(x, scales[0].repeat_interleave(group)),
                    lambda x: elem_bound(x, scales[1].repeat_interleave(group)), scale)  # fmt: skip
    assert (deq - exact).abs().le(bound).all()  # the derivation holds for the rounding itself
    for name in BACKENDS:
        be = make_backend(name)
        be.prepare(meta)
        out = attend_layer(
            be, q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), meta, scale, kv_scales=scales.to(DEVICE)
        )
        out = out.double().cpu()
        assert rel_err(out, deq) < 1e-5, name
        assert (out - exact).abs().le(bound + 1e-5 * exact.abs() + 1e-6).all(), name
    make_backend("triton").prepare(meta)
    assert meta.stats["shared_segments"] >= 1  # the prefix went through the shared-segment kernel


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_window_and_sinks_match_fp64(backend: str) -> None:
    """A sliding window the longest sequence outgrows (the window path), then sinks (the LSE path)."""
    q, _, _, k8, v8, scales, meta, tables, seq_lens = _case(16, 2, 64, [1, 3, 1, 2], 3)
    scale, window, query_lens = 0.125, 20, [1, 3, 1, 2]
    deq, _ = reference(_turned(q), *_dequantized(k8, v8, scales), tables, seq_lens, query_lens,
                       scale, window)  # fmt: skip
    be = make_backend(backend)
    be.prepare(meta)
    args = (q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), meta, scale)
    out = attend_layer(be, *args, window=window, kv_scales=scales.to(DEVICE)).double().cpu()
    assert rel_err(out, deq) < 1e-5
    if backend == "reference":  # sinks: o * sigmoid(lse - sink), over the dequantized cache
        sinks = torch.full((q.shape[1],), 0.5)
        got = attend_layer(be, *args, sinks=sinks.to(DEVICE), kv_scales=scales.to(DEVICE)).double().cpu()
        plain, parts = reference(_turned(q), *_dequantized(k8, v8, scales), tables, seq_lens,
                                 query_lens, scale)  # fmt: skip
        lse = torch.cat([p[-1] for p in parts])  # [T, Hq]
        assert rel_err(got, plain * torch.sigmoid(lse - 0.5)[..., None]) < 1e-5


def test_values_past_the_scale_saturate() -> None:
    """|x / s| > 448 is stored as +-448, never inf or NaN; 0 stays 0."""
    x = torch.tensor([[[1e9, -1e9, 0.0, 3.0]]])
    got = quantize(x, torch.tensor([1.0])).float()
    assert got.tolist() == [[[448.0, -448.0, 0.0, 3.0]]]


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 32), (3, 1, 24)])
def test_rope_kernel_quantized_store_matches_torch(heads: int, kv_heads: int, dim: int) -> None:
    """The RoPE kernel's e4m3 store equals ``kv_quant.store_kv``'s of the k and v it returns: V bit for
    bit on a GPU (rounded to the model's dtype, times 1 / s, saturated, rounded to nearest e4m3: the
    same steps), K turned first where the head size is a power of two (``kv_quant.rotate``; the turn's
    fp32 sums in another order, so a code may land one e4m3 step away where a value sits on a rounding
    boundary); in the CPU interpreter, whose e4m3 cast is off by up to a binade, to within a factor 2."""
    gen = torch.Generator().manual_seed(dim)
    tokens = 6
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 40).to(DEVICE)
    positions = torch.tensor([0, 5, 1, 1000, 77, 31000], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions.double()[:, None] * inv_freq.to(DEVICE)[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().float(), emb.sin().float()
    slots = torch.tensor([9, 0, 4, 17, 3, 12], device=DEVICE)
    scales = torch.stack([torch.tensor([0.25, 4.0][:kv_heads]), torch.tensor([0.125, 1.0][:kv_heads])])
    caches = [torch.zeros(3, 6, kv_heads, dim, device=DEVICE, dtype=FP8) for _ in range(2)]
    got = with_scales((caches[0], caches[1], slots), scales.to(DEVICE))
    _, k, v = rope_qkv(qkv, cos, sin, heads, kv_heads, dim, got)
    _, k_ref, v_ref = rope_qkv_ref(qkv, cos, sin, heads, kv_heads, dim)
    inverse = 1 / scales.to(DEVICE)
    turned = rotate(k, torch.float32)  # as store_kv turns it (dim 24: as it is)
    for cache, x, inv in ((caches[0], turned, inverse[0]), (caches[1], v, inverse[1])):
        stored = cache.view(-1, kv_heads, dim)[slots]
        want = quantize(x, inv)  # the kernel's own k and v, quantized by torch
        if DEVICE.type == "cuda" and x is v:  # cvt.rn.satfinite: round to nearest even, as torch
            assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
        elif DEVICE.type == "cuda":
            differ = stored.view(torch.uint8) != want.view(torch.uint8)
            assert differ.float().mean() <= 0.01
            assert (stored.float() - want.float()).abs().le(2.0**-3 * want.float().abs() + 2.0**-9).all()
        else:  # the interpreter's fp32 -> e4m3 cast drops a rounding carry (1.97 -> 1.0): scales checked
            assert (stored.float() - want.float()).abs().le(0.5 * want.float().abs() + 2.0**-9).all()
    if DEVICE.type == "cuda":  # against the torch RoPE (fp32 rotations may differ in a last bit)
        k_ref = rotate(k_ref, torch.float32)
        for cache, x, inv in ((caches[0], k_ref, inverse[0]), (caches[1], v_ref, inverse[1])):
            want = quantize(x, inv).float()
            assert (
                (cache.view(-1, kv_heads, dim)[slots].float() - want)
                .abs()
                .le(2.0**-3 * want.abs() + 2.0**-9)
                .all()
            )
    assert caches[1].float().abs().max() == 448.0  # some values saturate


def test_rope_kernel_stores_the_sum_of_split_k_partials() -> None:
    """An FP8 qkv product past 64 rows comes as fp32 split-K partials (``decode_split.fp8_qkv``): the
    RoPE kernel's e4m3 store of their sum equals its store of the summed product rounded to the
    model's dtype, bit for bit, and so do q, k and v."""
    heads, kv_heads, dim, tokens = 4, 2, 32, 5
    gen = torch.Generator().manual_seed(3)
    parts = (torch.randn(2, tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 20).to(DEVICE)
    positions = torch.tensor([0, 7, 1, 300, 31], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions.double()[:, None] * inv_freq.to(DEVICE)[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin().float()
    slots = torch.tensor([9, 0, 4, 11, 3], device=DEVICE)
    scales = torch.tensor([[0.25, 4.0], [0.125, 1.0]]).to(DEVICE)
    stores = []
    for qkv in (parts, parts.sum(0).to(torch.float16)):
        caches = [torch.zeros(3, 6, kv_heads, dim, device=DEVICE, dtype=FP8) for _ in range(2)]
        out = rope_qkv(
            qkv, cos, sin, heads, kv_heads, dim, with_scales((*caches, slots), scales), torch.float16
        )
        stores.append((out, caches))
    (split_out, split_caches), (whole_out, whole_caches) = stores
    for got, want in zip(split_out, whole_out, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(split_caches, whole_caches, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_rope_store_reads_a_layers_strided_scales() -> None:
    """A layer with fewer KV heads than the cache's widest (Gemma 4's global layers) sees a strided
    view of the [layers, 2, widest] scales; the RoPE kernel's e4m3 store must use each head's own V
    scale there, as a contiguous copy of the same scales gives (the interpreter's cast loses a
    rounding carry now and then, so the two are compared within e4m3's step, not bit for bit)."""
    from prefixserve.attention.kv_quant import kv_write, with_scales
    from prefixserve.model.kernels.rope import rope_qkv

    gen = torch.Generator().manual_seed(0)
    tokens, hq, hkv, dim, widest = 3, 8, 4, 16, 16
    scales = torch.ones(2, 2, widest)
    scales[0, 0, :hkv], scales[0, 1, :hkv] = 0.5, 0.0625
    inverse = 1 / scales
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).to(DEVICE, torch.bfloat16)
    cos, sin = torch.ones(tokens, dim, device=DEVICE), torch.zeros(tokens, dim, device=DEVICE)
    slots = torch.arange(tokens, device=DEVICE)
    stored = []
    for view in ((scales[0, :, :hkv], inverse[0, :, :hkv]), (scales[0, :, :hkv].contiguous(), None)):
        kc = torch.zeros(4, 4, hkv, dim, dtype=FP8, device=DEVICE)
        vc = torch.zeros_like(kc)
        layer = with_scales((kc, vc), view[0].to(DEVICE), None if view[1] is None else view[1].to(DEVICE))
        rope_qkv(qkv, cos, sin, hq, hkv, dim, kv_write(layer, slots))
        stored.append(vc.float().flatten(0, 1)[:tokens])
    strided, contiguous = stored
    assert (strided - contiguous).abs().max() <= 2**-3 * contiguous.abs().max()


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (32, 8, 128), (6, 2, 24), (4, 2, 16)])
def test_rope_kernel_hands_q_turned_for_its_e4m3_cache(heads: int, kv_heads: int, dim: int) -> None:
    """Writing an e4m3 cache that carries its scales, the RoPE kernel returns q as attention over that
    cache takes it: ``kv_quant.turn_query`` of the q it returns for a model-dtype cache, bit for bit
    (``kernels/turn.py``'s roundings in its code where it turns K: 64 and 128; torch's turn and fold
    at 16, whose K the torch store turns; the fold alone at 24, whose K is stored as it is); the
    stored K and V are those of the same call without the scales' turn of q."""
    from prefixserve.attention.kernels import turn
    from prefixserve.attention.kv_quant import turn_query

    gen = torch.Generator().manual_seed(heads + dim)
    tokens = 5
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    positions = torch.tensor([0, 3, 17, 400, 9], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions.double()[:, None] * inv_freq.to(DEVICE)[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin().float()
    slots = torch.tensor([4, 0, 9, 2, 7], device=DEVICE)
    scales = (2.0 ** torch.randint(-3, 3, (2, kv_heads), generator=gen)).to(DEVICE)
    caches = [torch.zeros(2, 6, kv_heads, dim, device=DEVICE, dtype=FP8) for _ in range(4)]
    turned, k, v = rope_qkv(qkv, cos, sin, heads, kv_heads, dim, with_scales((*caches[:2], slots), scales))
    plain, k_plain, v_plain = rope_qkv(qkv, cos, sin, heads, kv_heads, dim, (*caches[2:], slots))
    # the kernel's own turn where the RoPE kernel turns (the interpreter rounds to bf16 its own way)
    assert torch.equal(turned, (turn.turn_query if turn.turns(dim) else turn_query)(plain, scales[0]))
    assert torch.equal(k, k_plain) and torch.equal(v, v_plain)
    assert not torch.equal(turned, plain)


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (3, 1, 128), (32, 8, 32)])
def test_turn_query_kernel_matches_torch(heads: int, kv_heads: int, dim: int) -> None:
    """``kernels/turn.py``'s one launch equals ``fold_query(rotate(q), k_scale)`` (torch's fp32 matmul,
    rounded to q's dtype, then the exact power-of-two fold) to within q's dtype's rounding (the turn's
    fp32 sums run in another order)."""
    from prefixserve.attention.kernels.turn import turn_query
    from prefixserve.attention.kv_quant import fold_query

    gen = torch.Generator().manual_seed(heads * dim)
    q = (torch.randn(5, heads, dim, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    k_scale = torch.tensor([0.25, 2.0, 0.5, 1.0, 4.0, 0.125, 1.0, 8.0][:kv_heads], device=DEVICE)
    got = turn_query(q, k_scale).float()
    want = fold_query(rotate(q), k_scale).float()
    assert got.shape == want.shape
    assert (got - want).abs().le(2.0**-7 * want.abs() + 1e-6).all()


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (6, 3, 24), (32, 8, 128)])
def test_unfold_kernel_matches_torch(heads: int, kv_heads: int, dim: int) -> None:
    """``kernels/turn.py``'s in-place V-scale product equals torch's (``kv_quant.unfold_output``'s CPU
    form) bit for bit: the product in fp32 rounded to the output's dtype."""
    from prefixserve.attention.kernels.turn import unfold_output

    gen = torch.Generator().manual_seed(heads * dim)
    o = (torch.randn(5, heads, dim, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    v_scale = (2.0 ** torch.randint(-3, 4, (kv_heads,), generator=gen)).to(DEVICE)
    want = o.float().view(5, kv_heads, heads // kv_heads, dim) * v_scale[:, None, None].float()
    got = unfold_output(o.clone(), v_scale)
    assert torch.equal(got, want.view(5, heads, dim).to(torch.bfloat16))


def test_head_sizes_the_kernels_turn() -> None:
    """Powers of two from 32 (the halves' products take 16 rows and columns at least) to 256 (at 512
    the fp32 H_256 needs more shared memory than an H100 has): others turn in torch."""
    from prefixserve.attention.kernels.turn import turns

    assert [d for d in (16, 24, 32, 64, 96, 128, 256, 512) if turns(d)] == [32, 64, 128, 256]


def test_bf16_queries_over_an_e4m3_cache_widen_to_fp16() -> None:
    """bf16 q over an e4m3 cache runs the products in fp16 (``attend.widened_q``): the paged kernel,
    its decode splits and the packed decode kernel against fp64 attention over the same codes, within
    bf16 q's own rounding; a q element past fp16's range is clamped, never inf or NaN."""
    from prefixserve.attention.kernels.paged_attention import paged_attention

    gen = torch.Generator().manual_seed(3)
    lens, dim, group, bs = [40, 333, 130, 77], 64, 4, 16
    k, v, tables = paged_cache(lens, bs, 2, dim, torch.float32, gen)
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    bt = padded_table(tables)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 2 * group, dim, generator=gen).to(DEVICE, torch.bfloat16)
    scale = 1 / math.sqrt(dim)
    ref, _ = reference(q, k.float(), v.float(), tables, lens, [1] * len(lens), scale)
    for splits, pack in ((1, 1), (4, 1), (None, 2)):
        o, _ = paged_attention(q, k, v, bt, sl, qsl, scale, 1, num_splits=splits, pack=pack)
        assert o.dtype == torch.bfloat16 and rel_err(o, ref) < 1e-2, (splits, pack)
    q[0, 0, 0] = 3e5  # past fp16's 65504
    o, _ = paged_attention(q, k, v, bt, sl, qsl, scale, 1, num_splits=4)
    assert torch.isfinite(o.float()).all()
