"""A direct MoE step (one or two tokens a step: each assignment a block of its own) in one kernel.

The grouped path runs the up GEMM, then the down GEMM, each one short wave at a decode step's rows,
the down kernel's programs waiting for the whole up grid before their first weight load. Here
program (assignment b, intermediate tile c) computes its BN activated values of b's expert
(``expert_tiles.up_values``, the up kernel's own code) and at once multiplies them by the BN columns
of the expert's down projection that they meet: an fp32 partial [H] of the expert's output. The
last of b's programs to finish (a counter an assignment, release / acquire) sums b's partials in the
order of c, adds the bias, rounds to the model dtype, multiplies by the routing weight and writes
b's row of the [N, H] parts, as the down kernel writes them. No program waits for another, and no
value is summed by atomics, so a token's result does not depend on when the programs ran; its down
product is summed in tiles of BN, so its bits differ (in fp32's last places) from a grouped step's.

The counters live on the device (one set a device, zero between launches: the last program resets
its own), so launches on one device must not run concurrently on two streams.
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels.expert_tiles import product, up_values
from prefixserve.model.kernels.moe_route import routed_assignment
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()

MAX_ASSIGNMENTS = 64  # counters kept a device (a direct step has at most fused_moe.DIRECT_MAX)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _one_pass_kernel(
    x_ptr,  # [T, H]
    w_up_ptr,  # [E * 2 I, H]
    up_bias_ptr,  # [E * 2 I] (HAS_UP_BIAS)
    w_down_ptr,  # [E * H, I]
    down_bias_ptr,  # [E * H] (HAS_DOWN_BIAS)
    weights_ptr,  # [N] fp32: read, or written where ROUTE
    ids_ptr,  # [N] int32: read, or written where ROUTE
    partial_ptr,  # [N, C, H] fp32 scratch
    count_ptr,  # [N] int32, zero between launches
    out_ptr,  # [N, H] the weighted expert rows
    hidden,
    inter,
    stride_x,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BH: tl.constexpr,  # hidden columns a step of the down loop
    CP: tl.constexpr,  # C rounded up to a power of two (the sum's loads)
    RH: tl.constexpr,  # hidden columns a step of the sum
    ACTIVATION: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SWAP: tl.constexpr,
    PDL: tl.constexpr = False,
    ROUTE: tl.constexpr = False,  # route here from the router's logits (``fused_moe.routed_forward``)
    logits_ptr=None,
    n_experts=0,
    stride_l=0,
    KP: tl.constexpr = 1,
    EP: tl.constexpr = 1,
    RULE: tl.constexpr = 0,
    NORM: tl.constexpr = False,
    LOGIT_SPLITS: tl.constexpr = 0,
    stride_split=0,
):
    """A program an (assignment, intermediate tile)."""
    if PDL:
        wait()
    b = tl.program_id(0)
    c = tl.program_id(1)
    tiles = tl.num_programs(1)
    dtype = x_ptr.dtype.element_ty
    if ROUTE:
        expert, weight = routed_assignment(
            logits_ptr, b, n_experts, stride_l, TOP_K, KP, EP, RULE, NORM, LOGIT_SPLITS, stride_split, dtype,
            ids_ptr, weights_ptr,
        )  # fmt: skip
    else:
        expert = tl.load(ids_ptr + b)
        weight = tl.load(weights_ptr + b)
    real = tl.arange(0, BM) == 0
    assign = b + tl.arange(0, BM) * 0
    act, n, n_ok = up_values(
        x_ptr, w_up_ptr, up_bias_ptr, expert, real, assign, c, hidden, inter, stride_x, alpha, limit,
        TOP_K, BM, BN, BK, ACTIVATION, HAS_UP_BIAS, DOT_PREC, SWAP, False, dtype,
    )  # fmt: skip
    act = tl.where(real[:, None] & n_ok[None, :], act, 0.0).to(dtype)  # (a bias makes the padding nonzero)
    down_rows = expert.to(tl.int64) * hidden
    partial_row = partial_ptr + (b * tiles + c).to(tl.int64) * hidden
    for h0 in range(0, hidden, BH):
        h = h0 + tl.arange(0, BH)
        h_ok = h < hidden
        w = tl.load(
            w_down_ptr + (down_rows + h)[None, :] * inter + n[:, None], mask=n_ok[:, None] & h_ok[None, :],
            other=0.0,
        )  # fmt: skip
        acc = product(act, w, tl.zeros([BH, BM] if SWAP else [BM, BH], dtype=tl.float32), DOT_PREC, SWAP)
        if SWAP:
            acc = tl.trans(acc)
        tl.store(partial_row + h, tl.sum(tl.where(real[:, None], acc, 0.0), 0), mask=h_ok)
    if PDL:
        launch_dependents()
    tl.debug_barrier()  # every thread's partial stored before the release below
    if tl.atomic_add(count_ptr + b, 1, sem="acq_rel") == tiles - 1:  # b's last program sums them
        tl.atomic_xchg(count_ptr + b, 0)
        j = tl.arange(0, CP)
        rows = partial_ptr + (b * tiles + j).to(tl.int64)[:, None] * hidden
        for h0 in range(0, hidden, RH):
            h = h0 + tl.arange(0, RH)
            h_ok = h < hidden
            part = tl.load(
                rows + h[None, :], mask=(j < tiles)[:, None] & h_ok[None, :], other=0.0, cache_modifier=".cg"
            )
            total = tl.sum(part, 0)
            if HAS_DOWN_BIAS:
                total += tl.load(down_bias_ptr + down_rows + h, mask=h_ok, other=0.0).to(tl.float32)
            total = total.to(dtype).to(tl.float32)  # the expert's output in the model dtype
            tl.store(out_ptr + b.to(tl.int64) * hidden + h, (total * weight).to(dtype), mask=h_ok)


def _routing(route_args: dict | None) -> dict:
    """``routed_forward``'s routing arguments less the weights (this kernel takes them in place)."""
    return {k: v for k, v in (route_args or {}).items() if k != "weights_ptr"}


def _counters(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_ASSIGNMENTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def one_pass(
    x: torch.Tensor,  # [T, H]
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,  # [N] fp32 (written where ``route_args`` routes)
    ids: torch.Tensor,  # [N] int32 (likewise)
    parts: torch.Tensor,  # [N, H] out
    activation: int,
    up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    alpha: float,
    limit: float,
    tile: tuple[int, int, int, int, int],  # (BN of I, BK, BH, warps, stages)
    route_args: dict | None = None,
) -> torch.Tensor:
    """Each assignment's weighted expert row into ``parts`` (the down kernel's output) in one launch."""
    tokens, hidden = x.shape
    n = ids.numel()
    inter = w_down.shape[1]
    if n > MAX_ASSIGNMENTS:
        raise ValueError(f"one_pass takes at most {MAX_ASSIGNMENTS} assignments, not {n}")
    bn, bk, bh, warps, stages = tile
    tiles = triton.cdiv(inter, bn)
    partials = torch.empty(n, tiles, hidden, dtype=torch.float32, device=x.device)
    _one_pass_kernel[(n, tiles)](
        x, w_up, up_bias if up_bias is not None else w_up, w_down,
        down_bias if down_bias is not None else w_down, weights, ids, partials, _counters(x.device), parts,
        hidden, inter, x.stride(0), alpha, limit, TOP_K=n // tokens, BM=16, BN=bn, BK=bk, BH=bh,
        CP=triton.next_power_of_2(tiles), RH=max(16, min(256, 4096 // triton.next_power_of_2(tiles))),
        ACTIVATION=activation, HAS_UP_BIAS=up_bias is not None, HAS_DOWN_BIAS=down_bias is not None,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", SWAP=True, num_warps=warps,
        num_stages=stages, **pdl.chained(x.device), **_routing(route_args),
    )  # fmt: skip
    return parts


__all__ = ["MAX_ASSIGNMENTS", "one_pass"]
