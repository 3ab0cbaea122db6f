"""Programmatic dependent launch (``triton_support/pdl.py``): when a launch asks for it, and how the
recorded launches keep it. The bits of chained kernels with it on and off are compared on a GPU in
``test_fp8_matmul.py`` and ``test_fused_moe.py``."""

from __future__ import annotations

import pytest
import torch


def test_pdl_launch_option_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch_pdl`` is a launch option (kept beside num_warps, never passed as a kernel parameter);
    PDL is asked only on a Hopper+ GPU, never on the CPU or under the interpreter, and
    ``pdl.ENABLED = False`` turns it off."""
    from prefixserve.triton_support import pdl
    from prefixserve.triton_support.launch import record

    class Fake:
        arg_names = ("x", "BLOCK")

    launch = record(Fake(), (2,), (torch.zeros(2),), {"BLOCK": 4, "num_warps": 4, "launch_pdl": True}, None)
    assert launch.options == {"num_warps": 4, "launch_pdl": True} and launch.keywords == ["BLOCK"]
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(torch.device("cuda", 0))
    if torch.cuda.is_available():
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert pdl.enabled(torch.device("cuda", 0)) == (torch.cuda.get_device_capability(0)[0] >= 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph of the chain")
@pytest.mark.parametrize("seqs, splits", [(1, 1), (1, 3), (8, 1)])
def test_rope_and_paged_decode_chain_equals_the_chain_without(
    seqs: int, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's attention chain, graphed: the qkv product, RoPE writing K and V into the cache
    (``rope_qkv``), the paged decode over it (one split, or splits merged by the last), the o
    product; programmatic dependent launch on and off give the same bits over rounds of new inputs
    (the paged kernel's wait orders its cache reads after RoPE's writes)."""
    import math

    from prefixserve.attention.kernels.paged_attention import paged_attention
    from prefixserve.model.kernels import skinny_matmul
    from prefixserve.model.kernels.rope import rope_qkv
    from prefixserve.triton_support import pdl

    heads, kv_heads, dim, block, ctx = 8, 2, 64, 16, 70
    hidden = heads * dim
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(seqs * 10 + splits)
    w_qkv = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen) / 16).to(dev, bf16)
    w_o = (torch.randn(hidden, hidden, generator=gen) / 16).to(dev, bf16)
    blocks = -(-ctx // block)
    tables = torch.arange(seqs * blocks, device=dev, dtype=torch.int32).view(seqs, blocks)
    caches = {}
    for flag in (False, True):
        k = torch.randn(seqs * blocks, block, kv_heads, dim, generator=gen).to(dev, bf16)
        caches[flag] = (k, torch.randn(k.shape, generator=gen).to(dev, bf16))
    caches[True][0].copy_(caches[False][0])
    caches[True][1].copy_(caches[False][1])
    seq_lens = torch.full((seqs,), ctx, device=dev, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
    slots = (tables[:, (ctx - 1) // block].long() * block + (ctx - 1) % block).contiguous()
    angles = torch.rand(seqs, dim // 2, generator=gen).repeat(1, 2).to(dev)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    x = torch.randn(seqs, hidden, generator=gen).to(dev, bf16)

    def chain(flag: bool) -> torch.Tensor:
        k_cache, v_cache = caches[flag]
        qkv = skinny_matmul.skinny_linear(x, w_qkv)
        q, _, _ = rope_qkv(qkv, cos, sin, heads, kv_heads, dim, (k_cache, v_cache, slots))
        o, _ = paged_attention(
            q, k_cache, v_cache, tables, seq_lens, qsl, 1 / math.sqrt(dim), 1, max_seq_len=ctx,
            num_splits=splits,
        )  # fmt: skip
        return skinny_matmul.skinny_linear(o.reshape(seqs, hidden), w_o)

    outs, graphs = {}, {}
    for flag in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", flag)
        chain(flag)  # compiles outside the capture
        graphs[flag] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[flag]):
            outs[flag] = chain(flag)
    for _ in range(4):  # new inputs each round: a read before a wait would show as a difference
        x.copy_(torch.randn(seqs, hidden, generator=gen).to(dev, bf16))
        for flag in (False, True):
            graphs[flag].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[False], outs[True])
        assert torch.equal(caches[False][0], caches[True][0]) and torch.equal(
            caches[False][1], caches[True][1]
        )
