"""The gated delta rule in plain PyTorch: the recurrence token by token (the reference every other form
is tested against) and its chunked form (what a CPU prefill runs), both over one sequence.

Per value head, with the state S [Dk, Dv] (fp32) and for each token t (q and k L2-normed, q scaled by
``Dk ** -0.5``): S <- exp(g_t) S; u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = S^T q_t.
The chunked form computes a chunk's u at once: with c the decay's running sum over the chunk,
(I + A) U = beta V - beta exp(c) K S0, A[t, j] = beta_t exp(c_t - c_j) k_t . k_j (j < t), one
triangular solve; then the outputs and the state at the chunk's end in a few matmuls.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and HF's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, value_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hv, Dk] fp32 each
    """q and k [T, Hk, Dk] as the recurrence takes them: fp32, L2-normed, q scaled, each key head
    repeated for the value heads it serves (value head h reads key head h // (Hv / Hk))."""
    rep = value_heads // q.shape[1]
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if rep > 1:
        q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    return q, k


def recurrent_ref(
    q: torch.Tensor,  # [T, H, Dk] fp32, normed and scaled (``prepare_qk``)
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log decay (<= 0)
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] fp32, the state before the first token
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, Dv] fp32, the state after the last token
    """The recurrence one token at a time."""
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    v, g, beta = v.float(), g.float(), beta.float()
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_ref`` chunk by chunk (the same arguments), the chunk's tokens at once."""
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    v, g, beta = v.float(), g.float(), beta.float()
    for a in range(0, q.shape[0], chunk):
        b = min(a + chunk, q.shape[0])
        qc, kc, vc = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        cum = g[a:b].transpose(0, 1).cumsum(-1)  # [H, C]
        bc = beta[a:b].transpose(0, 1)[:, :, None]  # [H, C, 1]
        n = b - a
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, C, C]
        strict = lower & ~torch.eye(n, dtype=torch.bool, device=q.device)
        system = (bc * (kc @ kc.transpose(1, 2)) * decay).masked_fill(~strict, 0.0)
        system = system + torch.eye(n, device=q.device)
        rhs = bc * vc - (bc * cum.exp()[:, :, None] * kc) @ s
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, Dv]
        o = cum.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u
        out[a:b] = o.transpose(0, 1)
        tail = (cum[:, -1:] - cum).exp()[:, :, None]  # [H, C, 1]: decay from each token to the end
        s = cum[:, -1].exp()[:, None, None] * s + (kc * tail).transpose(1, 2) @ u
    return out, s


__all__ = ["chunked", "l2norm", "prepare_qk", "recurrent_ref"]
