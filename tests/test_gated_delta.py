"""The gated delta rule's forms against each other and against HF's PyTorch functions: the chunked
form (CPU prefills) equals the token-by-token recurrence on random shapes (grouped value heads, a
chunk boundary inside and at the end, a nonzero starting state); both equal HF's
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``. The layer's convolution
continues a sequence from its slot across chunks and decode tokens exactly as one pass would."""

from __future__ import annotations

import pytest
import torch

from prefixserve.model.gated_delta_ref import chunked, prepare_qk, recurrent_ref

SHAPES = [(1, 1, 1, 4, 4, 8), (37, 2, 4, 8, 6, 16), (64, 3, 3, 16, 8, 64), (70, 1, 4, 12, 10, 32)]


def _inputs(tokens: int, kh: int, vh: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(tokens, kh, dk, generator=gen), torch.randn(tokens, kh, dk, generator=gen)
    v = torch.randn(tokens, vh, dv, generator=gen)
    g = -torch.rand(tokens, vh, generator=gen) * 2  # log decays <= 0
    beta = torch.rand(tokens, vh, generator=gen)
    state = torch.randn(vh, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("tokens", "kh", "vh", "dk", "dv", "chunk"), SHAPES)
def test_chunked_equals_the_recurrence(tokens: int, kh: int, vh: int, dk: int, dv: int, chunk: int) -> None:
    q, k, v, g, beta, state = _inputs(tokens, kh, vh, dk, dv, tokens)
    qf, kf = prepare_qk(q, k, vh)
    want, want_state = recurrent_ref(qf, kf, v, g, beta, state)
    got, got_state = chunked(qf, kf, v, g, beta, state, chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    # split anywhere: the state carries the first part into the second
    cut = tokens // 3
    a, mid = chunked(qf[:cut], kf[:cut], v[:cut], g[:cut], beta[:cut], state, chunk)
    b, end = chunked(qf[cut:], kf[cut:], v[cut:], g[cut:], beta[cut:], mid, chunk)
    torch.testing.assert_close(torch.cat([a, b]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tokens", "kh", "vh", "dk", "dv", "chunk"), SHAPES[1:])
def test_the_forms_equal_hfs(tokens: int, kh: int, vh: int, dk: int, dv: int, chunk: int) -> None:
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, state = _inputs(tokens, kh, vh, dk, dv, 7)
    qf, kf = prepare_qk(q, k, vh)
    ours, ours_state = recurrent_ref(qf, kf, v, g, beta, state)
    args = (q[None], k[None], v[None], g[None], beta[None])
    for fn in (modeling.torch_chunk_gated_delta_rule, modeling.torch_recurrent_gated_delta_rule):
        kwargs = {"initial_state": state[None], "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        theirs, theirs_state = getattr(fn, "__wrapped__", fn)(*args, **kwargs)
        torch.testing.assert_close(ours, theirs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_state, theirs_state[0], rtol=1e-5, atol=1e-5)


def test_the_convolution_continues_across_chunks_and_decodes() -> None:
    """One sequence's rows in three pieces (two chunks, then decode rows beside a fresh sequence) give
    the convolution of the whole at once."""
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.gated_delta import GatedDeltaNet, LinearStep

    config = ModelConfig(
        vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=3,
    )  # fmt: skip
    layer = GatedDeltaNet(config, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(11, 8, generator=gen)
    with torch.no_grad():
        whole = layer(x, LinearStep.scratch([11], [11]))
        states = {0: (torch.zeros(3, layer.conv_dim, 3), torch.zeros(3, 2, 4, 3))}
        parts = [layer(x[:4], LinearStep([2], [0, 4], [True], states))]
        parts.append(layer(x[4:9], LinearStep([2], [0, 5], [False], states)))
        for t in (9, 10):  # decode rows, a fresh one-token sequence beside
            out = layer(torch.stack([x[t], x[0]]), LinearStep([2, 0], [0, 1, 2], [False, True], states))
            parts.append(out[:1])
            torch.testing.assert_close(out[1:], whole[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
