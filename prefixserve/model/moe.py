"""Mixture-of-experts blocks: a router picks each token's k experts, their gated MLPs run on the
token, and their outputs are summed with the router's weights.

``Experts`` holds the experts' weights: every expert's gate and up rows stacked as ``w_up`` [E 2I, H]
(expert e's gate rows at e 2I, its up rows after them) and the down projections as ``w_down``
[E H, I]: two-dimensional, so the loader fills each expert's rows from its checkpoint tensors as it
fills ``MergedLinear``'s (``Experts.checkpoint_pieces``: HF's per-expert tensors, or a family's
stacked ones through a conversion). Under tensor parallelism every expert's intermediate columns are
split over the ranks (I is this rank's share) and the ranks' sums are added, as the dense MLP's are.

``MoE`` is the MLP of an MoE layer (Qwen3-MoE, Mixtral, gpt-oss): the router ``gate`` and the
experts. Gemma 4's block runs beside its dense MLP with a router of its own (``Gemma4Router``).

On CUDA the Triton path runs the experts (``kernels/fused_moe.py``: graph-safe, reads only the
experts the step routes to); elsewhere the reference (``moe_reference.py``): a loop over the experts
the step touches, in the unfused model's order and dtypes (HF's), which the kernels are tested against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model import decode_split, fused
from prefixserve.model.config import ModelConfig
from prefixserve.model.linear import Linear
from prefixserve.model.parallel import Shard

Pieces = dict[str, list[tuple[str, slice, int, tuple[int, int], tuple[int, ...], Any]]]
PER_EXPERT, GATE_UP_INTERLEAVED, GATE_UP_STACKED = "per_expert", "interleaved", "stacked"


class Experts(nn.Module):
    """The experts' weights (this rank's intermediate columns) and their routed, weighted sum."""

    def __init__(self, config: ModelConfig, shard: Shard, layout: str = PER_EXPERT) -> None:
        super().__init__()
        self.shard, self.layout = shard, layout
        self.act, self.alpha, self.limit = config.hidden_act, config.swiglu_alpha, config.swiglu_limit
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.cols = shard.span(inter)
        local = self.cols[1] - self.cols[0]
        self.num_experts, self.inter_total, self.hidden = experts, inter, hidden
        self.w_up = nn.Parameter(torch.empty(experts * 2 * local, hidden))
        self.w_down = nn.Parameter(torch.empty(experts * hidden, local))
        if config.expert_bias:  # the down bias is added on rank 0 alone (the others hold zeros)
            self.b_up = nn.Parameter(torch.empty(experts * 2 * local))
            self.b_down = nn.Parameter(torch.empty(experts * hidden))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's experts ``ids`` [T, k] weighted by ``weights`` [T, k], this rank's columns
        (the caller sums the ranks)."""
        return fused.moe_experts(x, self.w_up, self.w_down, weights, ids, *self._rest())

    def routed(
        self, x: torch.Tensor, logits: torch.Tensor, route: tuple[int, str, bool], parts: bool = False
    ) -> torch.Tensor:
        """``forward`` with the tokens' experts and weights from the router's ``logits`` by ``route``
        (top k, rule, norm: ``fused.moe_route``'s), routed inside the experts' kernels where they can;
        ``parts``: maybe each token's k weighted outputs [k, T, H] for a norm to sum
        (``fused.moe_experts``)."""
        return fused.moe_routed_experts(x, logits, route, self.w_up, self.w_down, *self._rest(), parts)

    def _rest(self) -> tuple:
        """The arguments of ``fused.moe_experts`` after the ids: activation, biases, SwiGLU's constants."""
        biases = (self.b_up, self.b_down) if hasattr(self, "b_up") else (None, None)
        return self.act, *biases, self.alpha, self.limit

    def follow_checkpoint(self, prefix: str, stored: set[str]) -> None:
        """Read HF's per-expert tensors as one stacked tensor each where the checkpoint has them so
        (``{prefix}.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]: transformers 5's own experts, as
        published Qwen3.5-MoE checkpoints store them); ``stored``: the checkpoint's names, as the model's."""
        if self.layout == PER_EXPERT and f"{prefix}.gate_up_proj" in stored:
            self.layout = GATE_UP_STACKED

    def checkpoint_pieces(self, prefix: str) -> Pieces:
        """{parameter name: [(checkpoint tensor, parameter rows, split dim, its span, its shape,
        convert)]}; ``prefix``: this module's name. ``PER_EXPERT``: HF's ``{e}.gate_proj`` /
        ``up_proj`` / ``down_proj`` into each expert's rows; the stacked layouts whole, converted."""
        if self.layout != PER_EXPERT:
            return self._stacked_pieces(prefix)
        e_count, hidden, inter = self.num_experts, self.hidden, self.inter_total
        local, (a, b) = self.w_down.shape[1], self.cols
        up, down = [], []
        for e in range(e_count):
            row = e * 2 * local
            up.append(
                (f"{prefix}.{e}.gate_proj.weight", slice(row, row + local), 0, (a, b), (inter, hidden), None)
            )
            up.append(
                (
                    f"{prefix}.{e}.up_proj.weight",
                    slice(row + local, row + 2 * local),
                    0,
                    (a, b),
                    (inter, hidden),
                    None,
                )
            )
            rows = slice(e * hidden, (e + 1) * hidden)
            down.append((f"{prefix}.{e}.down_proj.weight", rows, 1, (a, b), (hidden, inter), None))
        return {f"{prefix}.w_up": up, f"{prefix}.w_down": down}

    def _stacked_pieces(self, prefix: str) -> Pieces:
        """A layer's experts as one tensor each. ``GATE_UP_INTERLEAVED`` (gpt-oss): ``gate_up_proj``
        [E, H, 2I] with gate and up columns interleaved, ``down_proj`` [E, I, H], biases
        ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H]. ``GATE_UP_STACKED`` (Gemma 4):
        ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows), ``down_proj`` [E, H, I]."""
        e, inter, hidden = self.num_experts, self.inter_total, self.hidden
        a, b = self.cols
        first_rank = self.shard.rank == 0
        whole = slice(None)
        interleaved = self.layout == GATE_UP_INTERLEAVED

        def up(t: torch.Tensor) -> torch.Tensor:  # -> [E (gate, up) I_rank, H]
            if interleaved:  # [E, H, 2I]
                return t.reshape(e, hidden, inter, 2).permute(0, 3, 2, 1)[:, :, a:b].reshape(-1, hidden)
            return t.reshape(e, 2, inter, hidden)[:, :, a:b].reshape(-1, hidden)  # [E, 2I, H]

        def up_bias(t: torch.Tensor) -> torch.Tensor:  # [E, 2I] interleaved -> [E (gate, up) I_rank]
            return t.reshape(e, inter, 2).permute(0, 2, 1)[:, :, a:b].reshape(-1)

        def down(t: torch.Tensor) -> torch.Tensor:  # -> [E H, I_rank]
            t = t.transpose(1, 2) if interleaved else t  # gpt-oss's [E, I, H]
            return t[:, :, a:b].reshape(e * hidden, b - a)

        def down_bias(t: torch.Tensor) -> torch.Tensor:  # [E, H], on the first rank alone
            return t.reshape(-1) if first_rank else torch.zeros_like(t).reshape(-1)

        up_shape = (e, hidden, 2 * inter) if interleaved else (e, 2 * inter, hidden)
        down_shape = (e, inter, hidden) if interleaved else (e, hidden, inter)
        out: Pieces = {
            f"{prefix}.w_up": [(f"{prefix}.gate_up_proj", whole, 0, (0, e), up_shape, up)],
            f"{prefix}.w_down": [(f"{prefix}.down_proj", whole, 0, (0, e), down_shape, down)],
        }
        if hasattr(self, "b_up"):
            out[f"{prefix}.b_up"] = [
                (f"{prefix}.gate_up_proj_bias", whole, 0, (0, e), (e, 2 * inter), up_bias)
            ]
            out[f"{prefix}.b_down"] = [(f"{prefix}.down_proj_bias", whole, 0, (0, e), (e, hidden), down_bias)]
        return out


def _as_routed(logits: torch.Tensor) -> torch.Tensor:
    """A router's logits as its weights give them. A dummy model has each router's ``simulate``
    replaced at load (``dummy_routing.use_uniform_routing``)."""
    return logits


class MoE(nn.Module):
    """Router and experts: the MLP of an MoE layer."""

    simulate = staticmethod(_as_routed)

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.top_k, self.rule, self.norm = (
            config.num_experts_per_tok,
            config.router_rule,
            config.norm_topk_prob,
        )
        self.gate = Linear(config.hidden_size, config.num_experts, bias=config.router_bias)  # replicated
        layout = GATE_UP_INTERLEAVED if config.architecture == "gpt_oss" else PER_EXPERT
        self.experts = Experts(config, shard, layout)
        # Qwen3-Next / Qwen3.5-MoE: a dense MLP beside the experts, times sigmoid(shared_expert_gate(x))
        # (set by the decoder layer, which builds MLPs)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor:  # [T, hidden]
        """The routed experts' weighted sum, summed over the ranks, plus the gated shared expert's
        output if any. ``partials`` (a norm next, which sums them: the dense MLP's signature): on one
        process without a shared expert, maybe each token's k weighted expert outputs [k, T, hidden]
        unsummed (``fused.moe_experts``), so no combine kernel runs."""
        route = (self.top_k, self.rule, self.norm)
        logits = decode_split.router_partials(x, self.gate, self.top_k)
        logits = self.gate(x) if logits is None else logits
        parts = partials and not self.shard.parallel and self.shared_expert is None
        routed = self.experts.routed(x, self.simulate(logits), route, parts)
        if routed.dim() == 3:
            return routed
        out = self.shard.all_reduce(routed)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Gemma4Router(nn.Module):
    """Gemma 4's router: the residual stream RMS-normed without a weight, times ``scale`` and
    ``hidden ** -0.5``, projected to the experts; softmax, top k, renormalised, each weight times its
    expert's ``per_expert_scale`` (HF's ``Gemma4TextRouter``)."""

    simulate = staticmethod(_as_routed)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.proj = Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.empty(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(config.num_experts))
        self.top_k, self.eps, self.hidden = (
            config.num_experts_per_tok,
            config.rms_norm_eps,
            config.hidden_size,
        )

    def forward(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids
        normed = F.rms_norm(stream.float(), (self.hidden,), eps=self.eps).to(stream.dtype)
        logits = self.simulate(self.proj(normed * self.scale * self.hidden**-0.5))
        weights, ids = fused.moe_route(logits, self.top_k, "softmax_topk", True)
        return weights * self.per_expert_scale.float()[ids.long()], ids


__all__ = [
    "GATE_UP_INTERLEAVED",
    "GATE_UP_STACKED",
    "PER_EXPERT",
    "Experts",
    "Gemma4Router",
    "MoE",
]
