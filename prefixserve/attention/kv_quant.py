"""FP8 (e4m3) KV cache: the element type, the per-layer scales that travel with a layer's cache tensors,
and the quantize / dequantize / fold steps every write and read path shares.

A stored element is ``x / scale`` rounded to e4m3 (3 mantissa bits: relative error <= 2^-4, values
beyond +-448 saturated, never inf or NaN); each layer has one fp32 scale per KV head for K and one for
V (``scales`` [2, Hkv]), fixed for the engine's life, so a written block never changes meaning.
Scales are powers of two (``pow2_scales``): dividing by one and multiplying back are exact, so the
only error is e4m3's rounding.

K is stored rotated: each head's k (after RoPE) times the normalized Hadamard matrix of the head size
(``hadamard``, orthonormal, where the head size is a power of two), and q is rotated the same way
before attention, so ``(q H) . (k H) = q . k``. The rotation spreads a head's few large channels over
all of them; e4m3's rounding error of a dot product, ``sum q_i k_i d_i``, is then no longer carried by
the channels where q and k are both large. On SmolLM2-135M it took next-token top-1 agreement with the
model-dtype cache from 95.2% to 97.2% over 608 positions (mean KL 0.0061 -> 0.0041; docs/kernels.md).
V is stored as it is (turning V too gained nothing in a fake-quantized trial).

Attention never dequantizes the cache: ``q . (s_k k) = (s_k q) . k`` and ``sum p (s_v v) = s_v sum p v``,
so ``attend_layer`` multiplies q by the K scale of its KV head before any backend runs, and the output
by the V scale after (``fold_query`` / ``unfold_output``, exact with power-of-two scales); the kernels
only widen the fp8 tiles they load to q's dtype. Every backend and every path (paged, shared
segments, mixed steps, windows, sinks, graphs) reads FP8 this one way.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def is_fp8(t: torch.Tensor) -> bool:
    """Is ``t`` an e4m3 cache tensor (or rows of one)?"""
    return t.dtype == FP8


class ScaledKV(tuple):
    """A tuple of one layer's cache tensors (``(k_cache, v_cache)``, or a write's ``(k_cache, v_cache,
    slots)``) that also carries the layer's FP8 scales: code that unpacks the tuple sees no change."""

    scales: torch.Tensor  # [2, Hkv] fp32: K's, V's per KV head
    inverse: torch.Tensor  # 1 / scales (exact: powers of two)


def with_scales(parts: tuple, scales: torch.Tensor | None, inverse: torch.Tensor | None = None) -> tuple:
    """``parts`` carrying ``scales`` and their ``inverse`` (computed if not given; both may be views that
    the cache fills later). None: ``parts`` itself, a model-dtype cache."""
    if scales is None:
        return parts
    out = ScaledKV(parts)
    out.scales, out.inverse = scales, (1.0 / scales) if inverse is None else inverse
    return out


def scales_of(parts: tuple) -> torch.Tensor | None:
    """The FP8 scales ``parts`` carries, or None."""
    return getattr(parts, "scales", None)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def stores_turned(head_dim: int) -> bool:
    """Whether an e4m3 cache stores K turned at this head size: a power of two (Sylvester's
    construction of the Hadamard matrix); other heads are stored as they are."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def hadamard(head_dim: int, device: torch.device) -> torch.Tensor | None:
    """The normalized Hadamard matrix [D, D] fp32 that rotates K in an e4m3 cache (None where
    ``stores_turned`` is not: K is then stored unrotated)."""
    if not stores_turned(head_dim):
        return None
    key = (head_dim, torch.device(device))
    h = _HADAMARD.get(key)
    if h is None:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        h = _HADAMARD[key] = (h / head_dim**0.5).to(key[1])
    return h


def rotate(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` [..., D] (q, or k before it is stored e4m3) times ``hadamard(D)``, computed in fp32, in
    ``dtype`` (default ``x``'s); ``x`` itself where D is not a power of two. The matrix is made at a
    head size's first call, which the KV calibration and every graph's warm-up make before a capture."""
    h = hadamard(x.shape[-1], x.device)
    return x if h is None else (x.float() @ h).to(dtype or x.dtype)


def quantize(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """e4m3 of ``x`` [..., H, D] divided by its head's scale (``inverse`` [H] = 1 / scale), saturated."""
    y = x.float() * inverse.to(x.device)[:, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of the e4m3 ``x`` [..., H, D] with per-head ``scales`` [H]."""
    return x.float() * scales.to(x.device)[:, None]


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values as ``dtype`` (exact: e4m3 fits every float type), for torch ops that take no e4m3;
    other tensors as they are."""
    return t.to(dtype) if is_fp8(t) else t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its bytes (a view), for copies, gathers and collectives, which need no value
    and do not all take e4m3 (torch's CPU ``index_copy_``, NCCL before 2.19); others as they are."""
    return t.view(torch.uint8) if is_fp8(t) else t


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, dim: int = 0) -> None:
    """``cache.index_copy_(dim, slots, rows)`` for any dtype: e4m3 moves as bytes (torch has no CPU
    ``index_copy_`` for it; a copy is bit for bit anyway)."""
    as_bytes(cache).index_copy_(dim, slots, as_bytes(rows))


def store_kv(cache: tuple, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int) -> None:
    """Write the tokens' k and v [T, Hkv, D] into a write's ``(k_cache, v_cache, slots)``, quantized
    when the cache is e4m3 (the torch twin of the RoPE kernel's store)."""
    k_cache, v_cache, slots = cache
    if is_fp8(k_cache):
        inverse = getattr(cache, "inverse", None)
        if inverse is None:
            inverse = torch.ones(2, heads, device=k.device)
        k, v = quantize(rotate(k, torch.float32), inverse[0]), quantize(v, inverse[1])  # rounded once
    write_rows(k_cache.view(-1, heads, head_dim), slots, k)
    write_rows(v_cache.view(-1, heads, head_dim), slots, v)


def fold_query(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D] times its KV head's K scale (GQA: Hq / Hkv query heads a KV head)."""
    t, hq, d = q.shape
    return (q.view(t, k_scale.numel(), hq // k_scale.numel(), d) * k_scale.to(q.dtype)[:, None, None]).view(
        t, hq, d
    )


def turn_query(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``fold_query(rotate(q), k_scale)``: q as attention over an e4m3 cache takes it. On a GPU one
    Triton launch (``kernels/turn.py``) where torch's takes several (an fp32 matmul, casts, the fold),
    which a small decode step pays per layer."""
    if q.is_cuda:
        from prefixserve.attention.kernels import turn

        if turn.turns(q.shape[-1]):
            return turn.turn_query(q, k_scale)
    return fold_query(rotate(q), k_scale)


def unfold_output(o: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """An attention output over e4m3 V [T, Hq, D] times its KV head's V scale, in place (the output is
    the attention's own new tensor): one launch and no new tensor, where ``fold_query``'s cast of the
    scales and product took two launches and two tensors, host time a prefill's eager attention pays
    every layer. The product is computed in fp32 and rounded: exact for power-of-two scales, as
    ``fold_query``'s."""
    t, hq, d = o.shape
    if o.is_cuda and o.is_contiguous():  # one chained Triton launch (``kernels/turn.py``)
        from prefixserve.attention.kernels import turn

        return turn.unfold_output(o, v_scale)
    o.view(t, v_scale.numel(), hq // v_scale.numel(), d).mul_(v_scale[:, None, None])
    return o


def pow2_scales(amax: torch.Tensor, margin: float = 2.0) -> torch.Tensor:
    """Scales that map ``amax * margin`` to at most 448, rounded up to a power of two (so dividing and
    multiplying back are exact); an all-zero head gets 1."""
    amax = amax.float().clamp_min(1e-30)
    scales = torch.exp2(torch.ceil(torch.log2(amax * margin / FP8_MAX)))
    return torch.where(amax > 1e-30, scales, torch.ones_like(scales))


def scales_digest(scales: torch.Tensor | None, model_dtype: torch.dtype | None = None) -> bytes:
    """Bytes naming the KV scheme in block digests: empty for a model-dtype cache (digests unchanged),
    else "fp8-e4m3", K's rotation, the dtype the model computed the KV in and the scales' bytes, so
    FP8 blocks never match model-dtype ones, nor FP8 blocks under other scales, stored before K was
    rotated, or computed by the model in another dtype."""
    if scales is None:
        return b""
    computed = f"{model_dtype}:".encode() if model_dtype is not None else b""
    values = scales.detach().float().cpu().contiguous().numpy().tobytes()
    return b"kv:fp8-e4m3:hadamard-k:" + computed + values


def kv_write(kv_layer: tuple, slots: torch.Tensor) -> tuple:
    """A write's ``(k_cache, v_cache, slots)`` into a layer's cache, carrying the layer's scales."""
    return with_scales((*kv_layer, slots), scales_of(kv_layer), getattr(kv_layer, "inverse", None))
