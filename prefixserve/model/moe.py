"""The mixture-of-experts MLP block: a router picks each token's k experts, their gated MLPs run on
the token, and their outputs are summed with the router's weights.

Weights: the router ``gate`` [E, H]; the experts' gate and up rows stacked as ``w_up`` [E 2I, H]
(expert e's gate rows at e 2I, its up rows after them) and their down projections as ``w_down``
[E H, I]: two-dimensional, so the loader fills each expert's rows from its own checkpoint tensors as
it fills ``MergedLinear``'s (``expert_pieces``). Under tensor parallelism every expert's intermediate
columns are split over the ranks (I is this rank's share) and the ranks' sums are added, as the
dense MLP's are.

On CUDA the Triton path runs it (``kernels/fused_moe.py``: graph-safe, reads only the experts the
step routes to); elsewhere the reference (``moe_reference.py``): a loop over the experts the step
touches, in the unfused model's order and dtypes (HF's), which the kernels are tested against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from prefixserve.model import fused
from prefixserve.model.config import ModelConfig
from prefixserve.model.linear import Linear
from prefixserve.model.parallel import Shard

Pieces = dict[str, list[tuple[str, slice, int, tuple[int, int], tuple[int, ...], Any]]]


class MoE(nn.Module):
    """Router, experts and their weighted sum (the MLP of an MoE layer)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.top_k, self.rule, self.norm = (
            config.num_experts_per_tok,
            config.router_rule,
            config.norm_topk_prob,
        )
        self.act, self.alpha, self.limit = config.hidden_act, config.swiglu_alpha, config.swiglu_limit
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.cols = shard.span(inter)  # this rank's intermediate columns of every expert
        local = self.cols[1] - self.cols[0]
        self.num_experts, self.inter_total = experts, inter
        self.stacked = config.architecture == "gpt_oss"  # the checkpoint stacks each layer's experts
        self.gate = Linear(hidden, experts, bias=config.router_bias)  # replicated: every rank routes alike
        self.w_up = nn.Parameter(torch.empty(experts * 2 * local, hidden))
        self.w_down = nn.Parameter(torch.empty(experts * hidden, local))
        if config.expert_bias:  # the down bias is added on rank 0 alone (the others hold zeros)
            self.b_up = nn.Parameter(torch.empty(experts * 2 * local))
            self.b_down = nn.Parameter(torch.empty(experts * hidden))

    def expert_pieces(self, prefix: str) -> Pieces:
        """{parameter name: [(checkpoint tensor, parameter rows, split dim, its span, its shape,
        convert)]}: each expert's ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (HF's names;
        a family with others renames at load) into its rows of ``w_up`` / ``w_down``; gpt-oss's stacked
        tensors whole, through ``convert`` (``stacked_pieces``). ``prefix``: this module's name."""
        if self.stacked:
            return self.stacked_pieces(prefix)
        hidden = self.w_down.shape[0] // self.num_experts
        local, (a, b) = self.w_down.shape[1], self.cols
        inter = self.inter_total
        up, down = [], []
        for e in range(self.num_experts):
            name = f"{prefix}.experts.{e}"
            row = e * 2 * local
            up.append((f"{name}.gate_proj.weight", slice(row, row + local), 0, (a, b), (inter, hidden), None))
            up.append(
                (
                    f"{name}.up_proj.weight",
                    slice(row + local, row + 2 * local),
                    0,
                    (a, b),
                    (inter, hidden),
                    None,
                )
            )
            rows = slice(e * hidden, (e + 1) * hidden)
            down.append((f"{name}.down_proj.weight", rows, 1, (a, b), (hidden, inter), None))
        return {f"{prefix}.w_up": up, f"{prefix}.w_down": down}

    def stacked_pieces(self, prefix: str) -> Pieces:
        """gpt-oss's experts as HF holds them: ``gate_up_proj`` [E, H, 2I] (gate and up columns
        interleaved), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias``
        [E, H]; each converted whole into this rank's rows."""
        e, inter = self.num_experts, self.inter_total
        hidden = self.w_down.shape[0] // e
        a, b = self.cols
        first_rank = self.shard.rank == 0
        name = f"{prefix}.experts"
        whole = slice(None)

        def up(t: torch.Tensor) -> torch.Tensor:  # [E, H, 2I] -> [E (gate, up) I_rank, H]
            return t.reshape(e, hidden, inter, 2).permute(0, 3, 2, 1)[:, :, a:b].reshape(-1, hidden)

        def up_bias(t: torch.Tensor) -> torch.Tensor:  # [E, 2I] -> [E (gate, up) I_rank]
            return t.reshape(e, inter, 2).permute(0, 2, 1)[:, :, a:b].reshape(-1)

        def down(t: torch.Tensor) -> torch.Tensor:  # [E, I, H] -> [E H, I_rank]
            return t.transpose(1, 2)[:, :, a:b].reshape(e * hidden, b - a)

        def down_bias(t: torch.Tensor) -> torch.Tensor:  # [E, H], on the first rank alone
            return t.reshape(-1) if first_rank else torch.zeros_like(t).reshape(-1)

        out: Pieces = {
            f"{prefix}.w_up": [(f"{name}.gate_up_proj", whole, 0, (0, e), (e, hidden, 2 * inter), up)],
            f"{prefix}.w_down": [(f"{name}.down_proj", whole, 0, (0, e), (e, inter, hidden), down)],
        }
        if hasattr(self, "b_up"):
            out[f"{prefix}.b_up"] = [(f"{name}.gate_up_proj_bias", whole, 0, (0, e), (e, 2 * inter), up_bias)]
            out[f"{prefix}.b_down"] = [(f"{name}.down_proj_bias", whole, 0, (0, e), (e, hidden), down_bias)]
        return out

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor:  # [T, hidden]
        """The routed experts' weighted sum, summed over the ranks (``partials``: the dense MLP's
        signature; the sum is always whole here)."""
        logits = self.gate(x)
        biases = (self.b_up, self.b_down) if hasattr(self, "b_up") else (None, None)
        out = fused.moe(
            x, logits, self.w_up, self.w_down, self.top_k, self.rule, self.norm, self.act,
            *biases, self.alpha, self.limit,
        )  # fmt: skip
        return self.shard.all_reduce(out)


__all__ = ["MoE"]
