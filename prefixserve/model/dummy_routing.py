"""A dummy model's routing: each MoE layer's tokens sent to experts drawn uniformly at random.

With random weights a batch's residual streams converge over the layers and its routers send it to a
few experts (a deep layer sent 16 rows to 16 of 128, where a balanced router sends them to 82), so a
dummy step would read far fewer expert weights than a trained model's. Routed by uniform draws it
reads what a balanced router's would.

The draws are made once, at load, into one table per model: layer i routes a step's T tokens by rows
i .. i + T of it (``TABLE_ROWS`` tokens at most; a larger step, a long prefill, draws afresh with
``torch.rand_like``). A decode step so runs no kernel a trained model would not run: a draw per layer
took 2.6 us of a one-token Qwen3-30B-A3B layer's 58 (docs/kernels.md §9), 4.5% of the step. The
router's own product still runs; its output is replaced. The same table on every rank (seeded), so
tensor-parallel ranks route alike. Outputs are noise either way.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from prefixserve.model.decode_split import ROUTER_SPLITS

TABLE_ROWS = 1024  # tokens a step routes from the table: every decode batch the benchmarks run


class UniformTable:
    """Uniform draws for every router of one model: the router product's logits [rows, E] in the
    model's dtype, and its fp32 split-K partials [ROUTER_SPLITS, rows, E] (``decode_split``), whose
    in-order sums are still independent and alike across the experts."""

    def __init__(
        self, experts: int, layers: int, dtype: torch.dtype, device: torch.device, seed: int
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        rows = TABLE_ROWS + layers
        self.logits = torch.rand(rows, experts, generator=gen, device=device).to(dtype)
        self.partials = torch.rand(ROUTER_SPLITS, rows, experts, generator=gen, device=device)

    def rows(self, logits: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s draws shaped as ``logits`` (a view: no kernel), or fresh ones where the
        table does not hold that shape."""
        tokens = logits.shape[-2]
        table = self.partials if logits.dim() == 3 else self.logits
        fits = tokens <= TABLE_ROWS and logits.shape[-1] == table.shape[-1] and logits.dtype == table.dtype
        if not fits or (logits.dim() == 3 and logits.shape[0] > table.shape[0]):
            return torch.rand_like(logits)
        if logits.dim() == 3:
            return table[: logits.shape[0], layer : layer + tokens]
        return table[layer : layer + tokens]


def use_uniform_routing(model: nn.Module, seed: int = 0) -> int:
    """Route every MoE layer of ``model`` by one ``UniformTable``; returns the layers changed."""
    from prefixserve.model.moe import Gemma4Router, MoE

    routers = [m for m in model.modules() if isinstance(m, (MoE, Gemma4Router))]
    if not routers:
        return 0
    product = routers[0].gate if isinstance(routers[0], MoE) else routers[0].proj
    weight = product.weight
    table = UniformTable(weight.shape[0], len(routers), weight.dtype, weight.device, seed)
    for layer, m in enumerate(routers):
        m.simulate = functools.partial(table.rows, layer=layer)
    return len(routers)


__all__ = ["TABLE_ROWS", "UniformTable", "use_uniform_routing"]
