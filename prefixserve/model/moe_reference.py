"""The mixture of experts in plain torch: routing and a loop over the experts a step touches, in the
unfused model's order and dtypes (HF's). The CPU path, and the oracle the fused kernels
(``kernels/fused_moe.py``) are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_ref(
    logits: torch.Tensor, top_k: int, rule: str = "softmax_topk", norm: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] -> weights [T, k] fp32, ids [T, k] int64
    """Each token's k experts, ties to the lower index (a stable sort), and their weights: a softmax
    over every expert then the k largest, renormalised with ``norm`` (Qwen3-MoE, Mixtral); or
    (``topk_softmax``, gpt-oss) the k largest logits, then a softmax over those."""
    scores = logits.float()
    if rule == "softmax_topk":
        scores = torch.softmax(scores, dim=-1)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = scores.gather(1, order)
    if rule == "topk_softmax":
        chosen = torch.softmax(chosen, dim=-1)
    elif norm:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen, order


def activate(gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float, limit: float) -> torch.Tensor:
    """The experts' gated activation: SiLU or tanh-GELU times up, or gpt-oss's clamped SwiGLU."""
    if act == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return (F.gelu(gate, approximate="tanh") if act == "gelu_pytorch_tanh" else F.silu(gate)) * up


def experts_ref(
    x: torch.Tensor,  # [T, H]
    w_up: torch.Tensor,  # [E 2I, H]
    w_down: torch.Tensor,  # [E H, I]
    weights: torch.Tensor,  # [T, k] fp32
    ids: torch.Tensor,  # [T, k]
    act: str = "silu",
    up_bias: torch.Tensor | None = None,  # [E 2I]
    down_bias: torch.Tensor | None = None,  # [E H]
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # [T, H], x's dtype
    """The reference: for each expert the step touches, in expert order, its tokens through its MLP,
    weighted and added into the output (in x's dtype, as HF adds them)."""
    hidden, inter = x.shape[1], w_down.shape[1]
    experts = w_down.shape[0] // hidden
    up_w, down_w = w_up.view(experts, 2 * inter, hidden), w_down.view(experts, hidden, inter)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token, slot = torch.where(ids == expert)
        gate_up = F.linear(
            x[token], up_w[expert], None if up_bias is None else up_bias.view(experts, -1)[expert]
        )
        gate, up = gate_up.split(inter, dim=-1)
        down = F.linear(activate(gate, up, act, alpha, limit), down_w[expert])
        if down_bias is not None:
            down = down + down_bias.view(experts, hidden)[expert]
        out.index_add_(0, token, (down * weights[token, slot, None]).to(x.dtype))
    return out


__all__ = ["activate", "experts_ref", "route_ref"]
