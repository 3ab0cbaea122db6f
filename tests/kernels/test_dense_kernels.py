"""Dense-path kernels (RMSNorm + residual, RoPE + KV write, SiLU-and-mul) vs their torch references.

Tiny sizes: on a CPU they run in the Triton interpreter; with a GPU the same tests run compiled, in
fp32 and bf16. Odd sizes (hidden 48, 3 heads, head_dim 24) exercise the masked lanes.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.model import fused
from prefixserve.model.fused import rope_cos_sin
from prefixserve.model.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from prefixserve.model.kernels.rope import rope_qkv, rope_qkv_ref
from prefixserve.model.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    res = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    x_before = x.clone()
    out, summed = add_rms_norm(x, w, 1e-5, res)
    ref, ref_summed = add_rms_norm_ref(x, w, 1e-5, res)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)  # the add rounds as torch's does
    assert torch.equal(x, x_before), "inputs are never written"


def test_add_rms_norm_strided_rows_and_empty() -> None:
    x = torch.randn(4, 96, device=DEVICE)[:, :64]  # rows 96 apart
    w = torch.ones(64, device=DEVICE)
    torch.testing.assert_close(add_rms_norm(x, w, 1e-6)[0], add_rms_norm_ref(x, w, 1e-6)[0])
    out, summed = add_rms_norm(x[:0], w, 1e-6, x[:0])
    assert out.shape == summed.shape == (0, 64)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_add_rms_norm_sums_split_k_partials(dtype: torch.dtype, splits: int) -> None:
    """fp32 partials [S, T, N] in: x is their sum rounded to the model dtype (the residual's, as a
    split-K matmul's reduce kernel would round it), then the same add and norm as for that x."""
    gen = torch.Generator().manual_seed(splits)
    parts = torch.randn(splits, 6, 48, generator=gen).to(DEVICE)
    res = torch.randn(6, 48, generator=gen).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(48, generator=gen)).to(DEVICE, dtype)
    out, summed = add_rms_norm(parts, w, 1e-5, res)
    assert out.dtype == summed.dtype == dtype
    # the kernel on the rounded sum as a plain x: the same outputs (the fp32 adds' order aside)
    plain_out, plain_summed = add_rms_norm(parts.double().sum(0).to(dtype), w, 1e-5, res)
    torch.testing.assert_close(summed, plain_summed, **_tol(dtype))
    torch.testing.assert_close(out, plain_out, **_tol(dtype))
    ref, ref_summed = add_rms_norm_ref(parts, w, 1e-5, res)
    torch.testing.assert_close(summed, ref_summed, **_tol(dtype))
    torch.testing.assert_close(out, ref, **_tol(dtype))
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16  # neither fp32 nor the model's
    for bad, residual in ((parts.to(other), res), (parts, None)):  # and partials without a residual or dtype
        with pytest.raises(ValueError, match="fp32 or the model's dtype"):
            add_rms_norm(bad, w, 1e-5, residual)
    # without a residual, given the dtype to round the sum to (a down projection into Gemma's norm)
    alone, stream = add_rms_norm(parts, w, 1e-5, dtype=dtype)
    assert alone.dtype == stream.dtype == dtype
    torch.testing.assert_close(stream, parts.double().sum(0).to(dtype), **_tol(dtype))
    torch.testing.assert_close(alone, add_rms_norm_ref(parts, w, 1e-5, dtype=dtype)[0], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, splits", [(64, 0), (48, 0), (48, 3)])
def test_sandwich_norm_is_the_two_norms(dtype: torch.dtype, hidden: int, splits: int) -> None:
    """``pre``: Gemma's block output normed by its own weight, added to the stream and normed again,
    in one kernel: the two kernels it replaces (bit for bit in the interpreter; compiled, the two
    programs' fp32 sums may contract differently: within rounding) and the reference."""
    gen = torch.Generator().manual_seed(hidden + splits)
    shape = (splits, 5, hidden) if splits else (5, hidden)
    x = torch.randn(*shape, generator=gen).to(DEVICE, torch.float32 if splits else dtype)
    res = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    w0, w = ((1 + 0.3 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    out, stream = add_rms_norm(x, w, 1e-6, res, pre=(w0, 1e-5))
    first = add_rms_norm(x, w0, 1e-5, dtype=dtype)[0]
    two_out, two_stream = add_rms_norm(first, w, 1e-6, res)
    if DEVICE.type == "cpu":
        assert torch.equal(out, two_out) and torch.equal(stream, two_stream)
    torch.testing.assert_close(out, two_out, **_tol(dtype))
    torch.testing.assert_close(stream, two_stream, **_tol(dtype))
    ref, ref_stream = add_rms_norm_ref(x, w, 1e-6, res, pre=(w0, 1e-5), dtype=dtype)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(stream, ref_stream, **_tol(dtype))
    with fused.triton_kernels(False):  # the torch path: the same two norms
        torch_out, torch_stream = fused.add_rms_norm(x, w, 1e-6, res, pre=(w0, 1e-5), dtype=dtype)
    torch.testing.assert_close(torch_out, ref, **_tol(dtype))
    torch.testing.assert_close(torch_stream, ref_stream, **_tol(dtype))


def test_fused_add_rms_norm_sums_partials_on_the_torch_path() -> None:
    """The torch path of ``fused.add_rms_norm`` takes the same partials: the fp32 sum rounded to the
    residual's dtype (bf16 here) before the add."""
    gen = torch.Generator().manual_seed(3)
    parts = torch.randn(3, 4, 32, generator=gen)
    res = torch.randn(4, 32, generator=gen).bfloat16()
    w = (torch.rand(32, generator=gen) + 0.5).bfloat16()
    with fused.triton_kernels(False):
        out, summed = fused.add_rms_norm(parts.to(DEVICE), w.to(DEVICE), 1e-5, res.to(DEVICE))
        with pytest.raises(ValueError, match="residual or a dtype"):
            fused.add_rms_norm(parts.to(DEVICE), w.to(DEVICE), 1e-5)
    x = parts.sum(0).bfloat16()
    assert torch.equal(summed.cpu(), x + res)
    ref = add_rms_norm_ref(x, w, 1e-5, res)[0]
    assert out.dtype == torch.bfloat16 and torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("rows, k, n, splits", [(1, 256, 64, 2), (5, 512, 96, 4), (3, 448, 8, 7)])
def test_split_k_operands_are_the_slices_of_k(rows: int, k: int, n: int, splits: int) -> None:
    """a[s] @ b[s] is the product over K's s-th slice, and the views copy nothing."""
    x, w = torch.randn(rows, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
    a, b = fused.split_k_operands(x, w, splits)
    assert a.shape == (splits, rows, k // splits) and b.shape == (splits, k // splits, n)
    assert a.data_ptr() == x.data_ptr() and b.data_ptr() == w.data_ptr()
    parts = torch.bmm(a, b)
    for s in range(splits):
        cols = slice(s * k // splits, (s + 1) * k // splits)
        torch.testing.assert_close(parts[s], x[:, cols] @ w[:, cols].T)
    torch.testing.assert_close(parts.sum(0), x @ w.T)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch.bmm with out_dtype is CUDA-only")
@pytest.mark.parametrize("rows, k, n, splits", [(1, 256, 64, 2), (77, 512, 96, 4), (300, 1024, 128, 2)])
def test_split_k_matmul_partials_sum_to_the_product(rows: int, k: int, n: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16)
    parts = fused.split_k_matmul(x, w, splits)
    assert parts.shape == (splits, rows, n) and parts.dtype == torch.float32
    exact = x.double() @ w.double().T
    torch.testing.assert_close(parts.double().sum(0), exact, rtol=1e-4, atol=1e-3)
    for s in range(splits):  # each partial is its own slice of K
        cols = slice(s * k // splits, (s + 1) * k // splits)
        part = x[:, cols].double() @ w[:, cols].double().T
        torch.testing.assert_close(parts[s].double(), part, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 32), (3, 1, 24)])
@pytest.mark.parametrize("write", [False, True])
def test_rope_qkv_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, write: bool
) -> None:
    gen = torch.Generator().manual_seed(dim + write)
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 1, 1000, 77, 31000], device=DEVICE)  # data, in any order
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cos, sin = rope_cos_sin(positions, inv_freq.float().to(DEVICE))
    slots = torch.tensor([9, 0, 4, 17, 3, 12], device=DEVICE)
    caches = [torch.zeros(3, 6, kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(4)]
    got_cache = (caches[0], caches[1], slots) if write else None
    ref_cache = (caches[2], caches[3], slots) if write else None
    q, k, v = rope_qkv(qkv, cos, sin, heads, kv_heads, dim, got_cache)
    rq, rk, rv = rope_qkv_ref(qkv, cos, sin, heads, kv_heads, dim, ref_cache)
    assert q.is_contiguous() and k.is_contiguous() and v.shape == rv.shape
    torch.testing.assert_close(q, rq, **_tol(dtype))
    torch.testing.assert_close(k, rk, **_tol(dtype))
    assert torch.equal(v, rv)
    if write:
        torch.testing.assert_close(caches[0], caches[2], **_tol(dtype))
        assert torch.equal(caches[1], caches[3])
        untouched = torch.ones(18, dtype=torch.bool)
        untouched[slots.cpu()] = False
        assert (caches[0].view(18, -1)[untouched.to(DEVICE)] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 32), (3, 1, 24)])
@pytest.mark.parametrize("splits", [0, 2])
def test_rope_qkv_with_qk_norm_matches_norm_then_rope(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, splits: int
) -> None:
    """QK-norm (Qwen3, Gemma 3) in the RoPE kernel equals an RMSNorm over each q and k head, as the
    model's norm rounds it, then the reference RoPE; from the product and from split-K partials."""
    gen = torch.Generator().manual_seed(dim + splits)
    tokens, width = 5, (heads + 2 * kv_heads) * dim
    parts = torch.randn(max(splits, 1), tokens, width, generator=gen).to(DEVICE) * 3
    qkv = parts.sum(0).to(dtype)
    wq, wk = (torch.randn(dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    positions = torch.tensor([3, 0, 900, 41, 7], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cos, sin = rope_cos_sin(positions, inv_freq.float().to(DEVICE))
    eps = 1e-6

    def normed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [T, H * D], each head normed
        xf = x.reshape(tokens, -1, dim).float()
        out = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        return out.reshape(tokens, -1)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    ref = rope_qkv_ref(torch.cat([normed(q, wq), normed(k, wk), v], -1), cos, sin, heads, kv_heads, dim)
    source = parts.float().contiguous() if splits else qkv
    got = rope_qkv(source, cos, sin, heads, kv_heads, dim, None, dtype, (wq, wk, eps))
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got[0], ref[0], **tol)
    torch.testing.assert_close(got[1], ref[1], **tol)
    torch.testing.assert_close(
        fused.rope_qkv(qkv, cos, sin, heads, kv_heads, dim, None, dtype, (wq, wk, eps))[0], ref[0], **tol
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("write", [False, True])
def test_rope_qkv_sums_split_k_partials(dtype: torch.dtype, splits: int, write: bool) -> None:
    """fp32 partials [S, T, W] in: the kernel rotates their sum rounded once to the model dtype, as
    if the one-matmul product had come in, and writes v (the sum) as a new tensor and to the cache."""
    heads, kv_heads, dim, tokens = 3, 1, 24, 5
    gen = torch.Generator().manual_seed(splits * 2 + write)
    parts = torch.randn(splits, tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE)
    total = parts[0].clone()
    for p in parts[1:]:  # in plane order, as the kernel adds them
        total += p
    product = total.to(dtype)
    positions = torch.tensor([3, 0, 900, 41, 7], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cos, sin = rope_cos_sin(positions, inv_freq.float().to(DEVICE))
    slots = torch.tensor([4, 1, 0, 6, 2], device=DEVICE)
    caches = [torch.zeros(2, 4, kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(4)]
    got_cache = (caches[0], caches[1], slots) if write else None
    ref_cache = (caches[2], caches[3], slots) if write else None
    q, k, v = rope_qkv(parts, cos, sin, heads, kv_heads, dim, got_cache, dtype)
    rq, rk, rv = rope_qkv(product, cos, sin, heads, kv_heads, dim, ref_cache)
    assert q.dtype == k.dtype == v.dtype == dtype and v.is_contiguous()
    assert torch.equal(q, rq) and torch.equal(k, rk) and torch.equal(v, rv)
    if write:
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with fused.triton_kernels(False):  # the torch path takes the same partials
        tq, tk, tv = fused.rope_qkv(parts, cos, sin, heads, kv_heads, dim, dtype=dtype)
    ref = rope_qkv_ref(product, cos, sin, heads, kv_heads, dim)
    torch.testing.assert_close(tq, ref[0], **_tol(dtype))
    torch.testing.assert_close(tk, ref[1], **_tol(dtype))
    assert torch.equal(tv, ref[2])


def test_rope_qkv_refuses_partials_it_cannot_sum() -> None:
    cos = sin = torch.zeros(2, 8, device=DEVICE)
    parts = torch.zeros(2, 2, 3 * 8, device=DEVICE)
    with pytest.raises(ValueError, match="need dtype"):
        rope_qkv(parts, cos, sin, 1, 1, 8)
    with pytest.raises(ValueError, match="fp32"):
        rope_qkv(parts.half(), cos, sin, 1, 1, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"\[\(S,\) T, 24\]"):
        rope_qkv(torch.zeros(2, 2, 16, device=DEVICE), cos, sin, 1, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="model's dtype"), fused.triton_kernels(False):
        fused.rope_qkv(parts, cos, sin, 1, 1, 8)


def test_qkv_partials_rule() -> None:
    """The qkv projection is split only where the rule says: CUDA Hopper, a shard's few columns, no
    bias, 64-256 rows; elsewhere (here: a CPU) it is the one product."""
    x = torch.randn(128, 64)
    w = torch.randn(96, 64)
    assert fused.split_k_for(x, w, fused.QKV_SPLIT_K_ROWS, min_k=0) == 0  # not CUDA
    torch.testing.assert_close(fused.qkv_partials(x, w, None), x @ w.T)
    b = torch.randn(96)
    torch.testing.assert_close(fused.qkv_partials(x, w, b), x @ w.T + b)


def test_torch_rope_without_cat_is_bit_identical_to_hf() -> None:
    """The CPU path (``fused.apply_rope``) gives exactly HF's rotate-half results, from a strided view."""
    from prefixserve.model.fused import rope_qkv as torch_rope_qkv

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 4, 2, 32
    qkv = torch.randn(7, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = rope_cos_sin(torch.arange(7) * 13, 1.0 / (10000.0 ** (torch.arange(0, dim, 2) / dim)))
    got = torch_rope_qkv(qkv, cos, sin, heads, kv_heads, dim)
    ref = rope_qkv_ref(qkv, cos, sin, heads, kv_heads, dim)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1100])  # 1100: two programs per row, the second masked
@pytest.mark.parametrize("gelu", [False, True])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, inter: int, gelu: bool) -> None:
    gen = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(5, 2 * inter, generator=gen)).to(DEVICE, dtype)
    torch.testing.assert_close(silu_and_mul(x, gelu), silu_and_mul_ref(x, gelu), **_tol(dtype))
    assert silu_and_mul(x[:0]).shape == (0, inter)


def test_bound_kernel_signatures_and_no_held_tensors() -> None:
    """A bound launch is keyed by all the compiled kernel was specialised on, and keeps no tensor."""
    from prefixserve.triton_support.bound import BoundKernel, _signature
    from prefixserve.triton_support.launch import Launch

    x = torch.zeros(8, 16)
    base = _signature((4,), (x, 16, 1e-5), {"BLOCK": 16})
    assert base == _signature((4,), (torch.ones(8, 16), 16, 1e-5), {"BLOCK": 16})  # other tensor, same
    assert base != _signature((5,), (x, 16, 1e-5), {"BLOCK": 16})  # grid
    assert base != _signature((4,), (x, 17, 1e-5), {"BLOCK": 16})  # an integer (Triton specialises it)
    assert base != _signature((4,), (x.half(), 16, 1e-5), {"BLOCK": 16})  # dtype
    assert base != _signature((4,), (x.view(-1)[1:], 16, 1e-5), {"BLOCK": 16})  # 16-byte alignment
    assert base != _signature((4,), (x, 16, 1e-5), {"BLOCK": 32})  # a constexpr

    calls = []

    class Fake:  # a kernel whose launches can be repeated (a compiled kernel with a launcher)
        arg_names = ("x", "n", "BLOCK")

        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append((grid, args, kw))
                return type("Compiled", (), {"run": None, "packed_metadata": None})()

            return launch

    bound = BoundKernel(Fake())
    bound((4,), x, 16, BLOCK=16)
    (launch,) = bound.launches.values()
    assert isinstance(launch, Launch) and launch.args[0] is None  # the step's tensor is not kept
    assert len(calls) == 1


SKINNY_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])  # the
# interpreter's bf16 dot is wrong (fp16 takes the same kernel path)


@pytest.mark.parametrize("dtype", SKINNY_DTYPES)
@pytest.mark.parametrize(
    "m, n, k, config",
    [
        (1, 40, 256, None),
        (5, 72, 128, (32, 3)),
        (16, 64, 384, (64, 6)),
        (17, 100, 256, (128, 4)),
        (64, 33, 128, None),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_reference(dtype, m, n, k, config, with_bias) -> None:
    """The skinny kernel against F.linear in fp32: masked rows (m not a tile height) and columns (n not
    a multiple of BLOCK_N), every tile shape, with and without a bias (Qwen2's qkv)."""
    from prefixserve.model.kernels.skinny_matmul import skinny_linear

    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype) if with_bias else None
    out = skinny_linear(x, w, bias, config)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_skinny_linear_strided_rows() -> None:
    """x and the weight with rows further apart than K (views of wider tensors) and x of one row
    repeated (row stride 0): the kernel follows the row strides."""
    from prefixserve.model.kernels.skinny_matmul import skinny_linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 384, generator=gen).to(DEVICE, torch.float16)[:, :256]
    w = (torch.randn(50, 320, generator=gen) / 16).to(DEVICE, torch.float16)[:, :256]
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(skinny_linear(x, w).float(), ref, rtol=1e-2, atol=1e-2)
    one = x[:1].expand(4, 256)  # stride 0 between rows
    ref1 = torch.nn.functional.linear(one.float(), w.float())
    torch.testing.assert_close(skinny_linear(one, w).float(), ref1, rtol=1e-2, atol=1e-2)


def test_skinny_linear_into_a_buffer_view() -> None:
    """``out``: the product written into a view of a wider byte buffer (the peer all-reduce buffer's
    way), nothing around it touched; an ``out`` of the wrong shape or dtype is refused."""
    from prefixserve.model.kernels.skinny_matmul import skinny_linear

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 256, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(72, 256, generator=gen) / 16).to(DEVICE, torch.float16)
    buffer = torch.full((4096,), 7, dtype=torch.uint8, device=DEVICE)
    view = buffer[: 5 * 72 * 2].view(torch.float16).view(5, 72)
    assert skinny_linear(x, w, out=view).data_ptr() == view.data_ptr()
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(view.float(), ref, rtol=1e-2, atol=1e-2)
    assert bool((buffer[5 * 72 * 2 :] == 7).all())
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(x, w, out=torch.empty(5, 71, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(x, w, out=torch.empty(5, 72, dtype=torch.float32, device=DEVICE))


def test_skinny_linear_refuses_what_it_does_not_take() -> None:
    """Too many rows, fp32, K off the tile, mismatched dtypes, a strided or mis-sized bias: a
    ValueError naming the shapes; the rule sends those products (and the fused qkv over 16 rows) to
    cuBLAS, and ``fused.linear`` gives F.linear's answer for them."""
    from prefixserve.model import fused
    from prefixserve.model.kernels import skinny_matmul

    w = torch.zeros(64, 256, dtype=torch.float16, device=DEVICE)
    x = torch.ones(4, 256, dtype=torch.float16, device=DEVICE)
    for bias in (
        torch.ones(128, dtype=torch.float16, device=DEVICE)[::2],
        torch.ones(63, dtype=torch.float16, device=DEVICE),
    ):
        assert not skinny_matmul.supported(x, w, bias)
        with pytest.raises(ValueError, match="skinny_linear takes"):
            skinny_matmul.skinny_linear(x, w, bias)
    strided = torch.arange(128, dtype=torch.float16, device=DEVICE)[::2]
    torch.testing.assert_close(fused.linear(x, w, strided), torch.nn.functional.linear(x, w, strided))
    for x in (
        torch.zeros(65, 256, dtype=torch.float16, device=DEVICE),
        torch.zeros(4, 256, dtype=torch.float32, device=DEVICE),
        torch.zeros(4, 200, dtype=torch.float16, device=DEVICE),
        torch.zeros(4, 256, dtype=torch.bfloat16, device=DEVICE),
    ):
        assert not skinny_matmul.supported(x, w)
        with pytest.raises(ValueError, match="skinny_linear takes"):
            skinny_matmul.skinny_linear(x, w)
    assert skinny_matmul.skinny_config(64, 6144) is None  # the fused qkv at 64 rows: cuBLAS
    assert skinny_matmul.skinny_config(16, 6144) == (32, 6)
    assert skinny_matmul.skinny_config(64, 4096) == (32, 6)
    assert skinny_matmul.skinny_config(64, 28672) == (128, 4)
    assert skinny_matmul.skinny_config(1, 128256) == (64, 6)
    # short rows at a mid width (Qwen3-30B-A3B's qkv, 5120 x 2048): 64 columns up to 16 rows
    assert skinny_matmul.skinny_config(1, 5120, 2048) == (64, 6)
    assert skinny_matmul.skinny_config(16, 5120, 2048) == (64, 6)
    assert skinny_matmul.skinny_config(64, 5120, 2048) is None
    assert skinny_matmul.skinny_config(1, 6144, 4096) == (32, 6)  # the 8B's qkv keeps 32
    assert skinny_matmul.skinny_config(1, 4096, 2048) == (32, 6)
    # with no tiles of its own where the rule says cuBLAS, the kernel still computes (32, 6)
    x64 = torch.randn(64, 256, dtype=torch.float16, device=DEVICE)
    w64 = torch.randn(6144, 256, dtype=torch.float16, device=DEVICE) / 16
    ref = torch.nn.functional.linear(x64.float(), w64.float())
    torch.testing.assert_close(skinny_matmul.skinny_linear(x64, w64).float(), ref, rtol=1e-2, atol=1e-2)


def test_fused_linear_is_torch_off_cuda() -> None:
    """``fused.linear`` is F.linear on the CPU, bit for bit (the CPU engine's path is unchanged)."""
    from prefixserve.model import fused

    x, w, b = torch.randn(3, 256), torch.randn(40, 256), torch.randn(40)
    assert torch.equal(fused.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def _gate_up_ref(x: torch.Tensor, w: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """The unfused pair in fp32: the gate-up product rounded to x's dtype, then SiLU- (or GELU-) and-mul."""
    return silu_and_mul_ref(torch.nn.functional.linear(x.float(), w.float()).to(x.dtype).float(), gelu)


@pytest.mark.parametrize("dtype", SKINNY_DTYPES)
@pytest.mark.parametrize(
    "m, inter, k, kind, config",
    [
        (1, 40, 256, "skinny", None),
        (17, 72, 128, "skinny", (64, 4)),
        (64, 33, 256, "skinny", (32, 3)),
        (70, 48, 128, "tiled", (64, 32, 64, 2, 4)),
        (130, 80, 256, "tiled", (128, 64, 64, 3, 4)),
    ],
)
@pytest.mark.parametrize("gelu", [False, True])
def test_gate_up_kernels_match_reference(dtype, m, inter, k, kind, config, gelu) -> None:
    """The gate-up product with SiLU-and-mul (or Gemma's GELU-and-mul) in the epilogue against the
    unfused pair in fp32: the skinny kernel's gated form and the tiled TMA kernel, masked rows and
    columns (m and I not multiples of the tiles)."""
    from prefixserve.model.kernels import gate_up, skinny_matmul

    gen = torch.Generator().manual_seed(m * inter + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(2 * inter, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    if kind == "skinny":
        out = skinny_matmul.skinny_gated(x, w, config, gelu)
    else:
        out = gate_up.gate_up_tiled(x, w, config, gelu)
    assert out.shape == (m, inter) and out.dtype == dtype
    torch.testing.assert_close(out.float(), _gate_up_ref(x, w, gelu), rtol=1e-2, atol=1e-2)


def test_gate_up_rule_and_refusals() -> None:
    """What the fused kernels do not take (fp32, K off the tile, an odd weight, a strided x) goes to
    the unfused pair, and ``fused.linear_silu_and_mul`` gives its answer; the rule's rows."""
    from prefixserve.model import fused
    from prefixserve.model.kernels import gate_up, skinny_matmul

    w = torch.randn(64, 256, dtype=torch.float16, device=DEVICE) / 16
    for x, weight in (
        (torch.randn(4, 256, dtype=torch.float32, device=DEVICE), w.float()),
        (torch.randn(4, 200, dtype=torch.float16, device=DEVICE), w[:, :200].contiguous()),
        (torch.randn(4, 384, dtype=torch.float16, device=DEVICE)[:, :256], w),
    ):
        assert not gate_up.supported(x, weight)
        assert gate_up.gate_up_silu(x, weight) is None
        ref = silu_and_mul_ref(torch.nn.functional.linear(x, weight))
        torch.testing.assert_close(fused.linear_silu_and_mul(x, weight), ref, rtol=1e-2, atol=1e-2)
    assert not gate_up.supported(torch.randn(4, 256, dtype=torch.float16, device=DEVICE), w[:63])
    with pytest.raises(ValueError, match="skinny_gated takes"):
        skinny_matmul.skinny_gated(torch.zeros(65, 256, dtype=torch.float16, device=DEVICE), w)
    assert skinny_matmul.gated_config(1, 14336) == (32, 6)
    assert skinny_matmul.gated_config(16, 4096) is None  # narrower than the sweep's: the pair
    x4k = torch.randn(16, 256, dtype=torch.float16, device=DEVICE)
    assert gate_up.gate_up_silu(x4k, torch.randn(8192, 256, dtype=torch.float16, device=DEVICE)) is None
    assert skinny_matmul.gated_config(64, 14336) == (64, 4)
    assert gate_up.tiled_config(128, 14336) == (128, 64, 64, 5, 4)
    assert gate_up.tiled_config(128, 4096) is None  # narrower than the sweep's: the pair
    for m in (129, 160, 192, 256, 320, 512, 1024):  # cuBLAS and the SiLU kernel were as fast or faster
        assert gate_up.tiled_config(m, 14336) is None


def test_linear_silu_and_mul_is_torch_off_cuda() -> None:
    """On the CPU ``fused.linear_silu_and_mul`` is the unfused pair, bit for bit."""
    from prefixserve.model import fused

    x, w = torch.randn(3, 256), torch.randn(80, 256)
    assert torch.equal(fused.linear_silu_and_mul(x, w), silu_and_mul_ref(torch.nn.functional.linear(x, w)))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 65, 128])
def test_gate_up_rule_tiles_compile_and_replay_in_a_graph(m: int) -> None:
    """The tiles the rules pick (a weight of 8,192 output columns, bf16) compile, match the unfused
    pair, and replay from a CUDA graph (the descriptors are built at capture) with new inputs."""
    from prefixserve.model import fused
    from prefixserve.model.kernels import gate_up

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused kernels run on Hopper")
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(2 * 8192, 256, generator=gen) / 16).to("cuda", torch.bfloat16)
    assert gate_up.gate_up_silu(x, w) is not None  # the rule takes these rows
    torch.testing.assert_close(
        fused.linear_silu_and_mul(x, w).float(), _gate_up_ref(x, w), rtol=2e-2, atol=2e-2
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused.linear_silu_and_mul(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.linear_silu_and_mul(x, w)
    x.copy_(torch.randn(m, 256, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), _gate_up_ref(x, w), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("vocab", "hidden", "tokens", "start"), [(50, 64, 9, 0), (37, 1100, 6, 40), (8, 24, 1, 3)]
)
def test_shard_embedding_matches_the_masked_lookup(
    dtype: torch.dtype, vocab: int, hidden: int, tokens: int, start: int
) -> None:
    """A vocabulary shard's lookups written into a view of a wider buffer (a product slot): the
    shard's rows for the ids it holds, zeros for ids below or past it, nothing else touched."""
    from prefixserve.model.kernels.embedding import shard_embedding, shard_embedding_ref

    gen = torch.Generator().manual_seed(vocab + hidden)
    weight = torch.randn(vocab, hidden, generator=gen).to(DEVICE, dtype)
    ids = torch.randint(0, start + vocab + 20, (tokens,), generator=gen).to(DEVICE)
    ids[0] = start + vocab - 1  # the shard's last row, and ids on both sides of it
    if tokens > 2:
        ids[1], ids[2] = start + vocab, max(start - 1, 0)
    buffer = torch.full((tokens * hidden + 7,), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[: tokens * hidden].view(tokens, hidden)
    assert shard_embedding(ids, weight, start, out) is out
    assert torch.equal(out, shard_embedding_ref(ids, weight, start))
    assert torch.equal(out, fused.shard_lookup(ids, weight, start))
    assert buffer[tokens * hidden :].isnan().all()
    held = (ids >= start) & (ids < start + vocab)
    assert out[~held].eq(0).all() and torch.equal(out[held], weight[ids[held] - start])


def test_shard_embedding_refuses_mismatched_operands() -> None:
    from prefixserve.model.kernels.embedding import shard_embedding

    weight = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="must be"):
        shard_embedding(
            torch.zeros(3, dtype=torch.long, device=DEVICE), weight, 0, torch.zeros(3, 9, device=DEVICE)
        )
