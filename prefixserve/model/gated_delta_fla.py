"""The gated delta rule on ``fla-core``'s Triton kernels (an optional, GPU-only dependency: imported
on first use). A step's sequences go as one variable-length batch (``cu_seqlens``): the chunked
kernel when any sequence brings more than one token, the fused recurrent one for a decode step; each
starts from its slot's state (zeros when fresh) and its final state is written back to the slot."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch


@cache
def _ops() -> Any:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def available() -> bool:
    """Is fla-core importable (else the PyTorch forms run, slowly, on the GPU too)?"""
    return _ops() is not None


def run(
    q: torch.Tensor,  # [T, Hk, Dk] (not normed: the kernels L2-norm q and k)
    k: torch.Tensor,
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] fp32
    beta: torch.Tensor,  # [T, Hv]
    slots: list[int],  # each sequence's slot
    starts: list[int],  # [S + 1] its query rows
    fresh: list[bool],  # starts at token 0: zero states
    state: torch.Tensor,  # [N, Hv, Dk, Dv] fp32: the layer's slots
) -> torch.Tensor:  # [T, Hv, Dv]
    chunk, recurrent = _ops()
    index = torch.tensor(slots, dtype=torch.long).to(q.device, non_blocking=True)
    start = state.index_select(0, index)
    if any(fresh):
        zero = torch.tensor(fresh).to(q.device, non_blocking=True)
        start = start.masked_fill(zero[:, None, None, None], 0.0)
    cu = torch.tensor(starts, dtype=torch.long).to(q.device, non_blocking=True)
    form = recurrent if starts[-1] == len(slots) else chunk  # one token each: decode
    out, final = form(
        q[None], k[None], v[None], g=g[None], beta=beta[None].to(q.dtype), initial_state=start,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    state.index_copy_(0, index, final.to(state.dtype))
    return out[0]


__all__ = ["available", "run"]
