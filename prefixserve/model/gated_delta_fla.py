"""The gated delta rule on ``fla-core``'s Triton kernels (an optional, GPU-only dependency: imported
on first use). A step's sequences go as one variable-length batch (``cu_seqlens``): the chunked
kernel when any sequence brings more than one token, the fused recurrent one when each brings one
(the engine's decode steps run ``kernels/gated_delta_decode.py`` instead, in place over the slots);
each starts from its slot's state (zeros when fresh) and its final state is written back to the slot.

A step that takes prefix snapshots (``cuts``: each sequence's chunk cut at the snapshot rows) runs in
rounds: round r is every sequence's r-th piece in one call, from the state the round before left,
and a piece ending at a snapshot writes its final state to the snapshot's slot."""

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
    on_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],  # slots, starts [S + 1], fresh
    state: torch.Tensor,  # [N, Hv, Dk, Dv] fp32: the layer's slots
) -> torch.Tensor:  # [T, Hv, Dv]
    """Each sequence's rows from its slot's state (zeros where fresh), the final states written back."""
    chunk, recurrent = _ops()
    index, cu, zero = on_device
    start = state.index_select(0, index)
    if zero is not None:
        start = start.masked_fill(zero[:, None, None, None], 0.0)
    form = recurrent if q.shape[0] == index.shape[0] else chunk  # one token each: decode
    out, final = form(
        q[None], k[None], v[None], g=g[None], beta=beta[None].to(q.dtype), initial_state=start,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    state.index_copy_(0, index, final.to(state.dtype))
    return out[0]


def lists_on(device: torch.device, slots: list[int], starts: list[int], fresh: list[bool]) -> tuple:
    """``run``'s tensors (slots, starts, fresh or None) from host lists."""
    return (
        torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(starts, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(fresh).to(device, non_blocking=True) if any(fresh) else None,
    )


def run_cut(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: list[int],
    starts: list[int],
    fresh: list[bool],
    state: torch.Tensor,
    cuts: list[list[tuple[int, int | None]]],
) -> torch.Tensor:
    """``run`` with the chunks cut at snapshots: every sequence's pieces in rounds (see the module's
    doc)."""
    pieces = []  # per sequence: [(first row, end row, snapshot slot or None)]
    for s, seq_cuts in enumerate(cuts):
        a, mine = starts[s], []
        for rows, snap in seq_cuts:
            mine.append((a, starts[s] + rows, snap))
            a = starts[s] + rows
        pieces.append(mine)
    device = q.device
    index = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
    carry = state.index_select(0, index)
    if any(fresh):
        zero = torch.tensor(fresh).to(device, non_blocking=True)
        carry = carry.masked_fill(zero[:, None, None, None], 0.0)
    out = torch.empty(v.shape, dtype=v.dtype, device=device)
    for r in range(max(map(len, pieces))):
        active = [s for s in range(len(slots)) if r < len(pieces[s])]
        spans = [pieces[s][r] for s in active]
        rows = torch.cat([torch.arange(a, b) for a, b, _ in spans]).to(device, non_blocking=True)
        bounds = [0]
        for a, b, _ in spans:
            bounds.append(bounds[-1] + b - a)
        which = torch.tensor(active, dtype=torch.long).to(device, non_blocking=True)
        carry_view = carry.index_select(0, which)  # the active sequences' states, as slots 0..A-1
        ids, keep = list(range(len(active))), [False] * len(active)
        sub = run(
            q[rows], k[rows], v[rows], g[rows], beta[rows], lists_on(device, ids, bounds, keep), carry_view
        )
        out[rows] = sub.to(out.dtype)
        carry.index_copy_(0, which, carry_view)
        for i, (_, _, snap) in enumerate(spans):
            if snap is not None:
                state[snap] = carry_view[i]
    state.index_copy_(0, index, carry)
    return out


__all__ = ["available", "lists_on", "run", "run_cut"]
