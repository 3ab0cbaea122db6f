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


def _fake_kernel(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """fla's varlen API over the PyTorch reference (B = 1, ``cu_seqlens``), for the plumbing on a CPU."""
    assert output_final_state and use_qk_l2norm_in_kernel and q.shape[0] == 1
    qf, kf = prepare_qk(q[0], k[0], v.shape[2])
    out, finals = torch.empty(v[0].shape), []
    for s in range(len(cu_seqlens) - 1):
        a, b = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        out[a:b], final = recurrent_ref(
            qf[a:b], kf[a:b], v[0, a:b], g[0, a:b], beta[0, a:b], initial_state[s]
        )
        finals.append(final)
    return out[None], torch.stack(finals)


@pytest.mark.parametrize("snapshots", [False, True])
def test_the_fla_plumbing_over_slots_and_snapshots(monkeypatch: pytest.MonkeyPatch, snapshots: bool) -> None:
    """``gated_delta_fla.run`` with a stand-in kernel: each sequence from its slot (zeros when fresh),
    its final state back in the slot; with snapshots, in rounds, each snapshot the state at its row."""
    from prefixserve.model import gated_delta_fla

    monkeypatch.setattr(gated_delta_fla, "_ops", lambda: (_fake_kernel, _fake_kernel))
    lens, slots, fresh = [70, 1, 9], [5, 1, 3], [True, False, False]
    q, k, v, g, beta, _ = _inputs(sum(lens), 2, 4, 8, 6, 3)
    state = torch.randn(12, 4, 8, 6, generator=torch.Generator().manual_seed(4))
    before = state.clone()
    starts = [0, 70, 71, 80]
    cuts = [[(30, 9), (64, 10), (70, None)], [(1, 11)], [(9, None)]] if snapshots else None
    if cuts is not None:
        out = gated_delta_fla.run_cut(q, k, v, g, beta, slots, starts, fresh, state, cuts)
    else:
        out = gated_delta_fla.run(
            q, k, v, g, beta, gated_delta_fla.lists_on(q.device, slots, starts, fresh), state
        )
    qf, kf = prepare_qk(q, k, 4)
    for s, slot in enumerate(slots):
        a, b = starts[s], starts[s + 1]
        start = torch.zeros_like(before[slot]) if fresh[s] else before[slot]
        want, want_state = recurrent_ref(qf[a:b], kf[a:b], v[a:b], g[a:b], beta[a:b], start)
        torch.testing.assert_close(out[a:b], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[slot], want_state, rtol=1e-5, atol=1e-5)
        for rows, snap in cuts[s] if cuts else []:
            if snap is not None:
                _, at = recurrent_ref(qf[a : a + rows], kf[a : a + rows], v[a : a + rows], g[a : a + rows],
                                      beta[a : a + rows], start)  # fmt: skip
                torch.testing.assert_close(state[snap], at, rtol=1e-5, atol=1e-5)
