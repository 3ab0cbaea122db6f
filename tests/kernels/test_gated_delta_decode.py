"""The in-place decode kernel of the gated delta rule (``model/kernels/gated_delta_decode.py``)
against the token-by-token reference, on random shapes: GQA (value heads over key heads), key and
value sizes off powers of two, strided rows (views of one projection, as the layer passes them),
slots out of order, fresh sequences, and slots no sequence holds left untouched."""

from __future__ import annotations

import pytest
import torch

from prefixserve.model.gated_delta_ref import prepare_qk, recurrent_ref
from prefixserve.model.kernels.gated_delta_decode import decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("seqs", "hk", "hv", "dk", "dv", "dtype"),
    [(3, 2, 4, 16, 32, torch.float32), (5, 1, 3, 24, 20, torch.float32), (4, 2, 2, 64, 48, torch.bfloat16)],
)
def test_decode_equals_the_reference(
    seqs: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(seqs * 7 + dk)
    proj = torch.randn(seqs, 2 * hk * dk + hv * dv + 5, generator=gen).to(DEVICE, dtype)  # one row each
    q = proj[:, : hk * dk].view(seqs, hk, dk)
    k = proj[:, hk * dk : 2 * hk * dk].view(seqs, hk, dk)
    v = proj[:, 2 * hk * dk : 2 * hk * dk + hv * dv].view(seqs, hv, dv)
    g = -torch.rand(seqs, hv, generator=gen).to(DEVICE)
    beta = torch.rand(seqs, hv, generator=gen).to(DEVICE, dtype)
    state = torch.randn(seqs + 3, hv, dk, dv, generator=gen).to(DEVICE)
    slots = torch.randperm(seqs + 3, generator=gen)[:seqs].to(DEVICE)
    fresh = torch.tensor([i % 3 == 1 for i in range(seqs)], device=DEVICE)
    before = state.clone()
    out = decode(q, k, v, g, beta, slots, fresh, state)
    qf, kf = prepare_qk(q, k, hv)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s in range(seqs):
        slot = int(slots[s])
        start = torch.zeros_like(before[slot]) if fresh[s] else before[slot]
        want, want_state = recurrent_ref(qf[s : s + 1], kf[s : s + 1], v[s : s + 1], g[s : s + 1],
                                         beta[s : s + 1], start)  # fmt: skip
        torch.testing.assert_close(out[s].float(), want[0], rtol=tol, atol=tol)
        torch.testing.assert_close(state[slot], want_state, rtol=1e-5, atol=1e-5)
    untouched = sorted(set(range(seqs + 3)) - {int(x) for x in slots})
    torch.testing.assert_close(state[untouched], before[untouched], rtol=0, atol=0)


def test_decode_without_fresh_flags_and_bad_layouts() -> None:
    q = torch.randn(2, 1, 16, device=DEVICE)
    v = torch.randn(2, 2, 16, device=DEVICE)
    g, beta = -torch.rand(2, 2, device=DEVICE), torch.rand(2, 2, device=DEVICE)
    state = torch.randn(2, 2, 16, 16, device=DEVICE)
    slots = torch.tensor([1, 0], device=DEVICE)
    want = state.clone()
    out = decode(q, q, v, g, beta, slots, None, state)
    qf, kf = prepare_qk(q, q, 2)
    for s in range(2):
        ref, st = recurrent_ref(qf[s : s + 1], kf[s : s + 1], v[s : s + 1], g[s : s + 1], beta[s : s + 1],
                                want[int(slots[s])])  # fmt: skip
        torch.testing.assert_close(out[s], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[int(slots[s])], st, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous fp32"):
        decode(q, q, v, g, beta, slots, None, state.transpose(2, 3))
    with pytest.raises(ValueError, match="heads must be contiguous"):
        decode(q.transpose(1, 2), q, v, g, beta, slots, None, state)
