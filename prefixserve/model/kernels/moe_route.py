"""The routing of a mixture-of-experts step on the GPU: each token's k experts and their weights.

``route`` runs one program a token (``_route_kernel``); a direct step of one or two tokens routes in
the fused up kernel's prologue instead (``fused_moe.routed_forward``), by the same ``top_k_of``, so
both give the same bits. A grouped decode step (up to ``ROUTER_ROUTE_MAX`` tokens) runs the router's
product and the routing in one kernel (``router_route``: a program a block of ``ROUTER_BT`` tokens,
the experts' logits of its tokens in registers, ``top_k_cols``), where the product was a cuBLAS
launch and the routing a second. ``moe_reference.route_ref`` is the CPU's rule (a stable sort: ties
to the lower index, as ``tl.argmax``'s left tie-break).
"""

from __future__ import annotations

import torch

from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()

ROUTER_RULES = {"softmax_topk": 0, "topk_softmax": 1}


@triton.jit
def top_k_of(
    row_ptr,  # one token's [E] router logits
    n_experts,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,
    EP: tl.constexpr,
    RULE: tl.constexpr,
    NORM: tl.constexpr,
    SPLITS: tl.constexpr = 0,  # row_ptr is the first of SPLITS fp32 partials, split_stride apart
    split_stride=0,
    ROUND: tl.constexpr = tl.float32,  # SPLITS: their sum rounded to this (the router's dtype)
):
    """A token's k experts (int32 [KP]) and weights (fp32 [KP]; lanes past TOP_K padding) by ``RULE``:
    the router's softmax then the k largest, renormalised with ``NORM`` (0), or the k largest logits
    then a softmax over them (1); ties to the lower index. With ``SPLITS`` the logits are the sum of
    the router product's split-K partials in order, rounded as the unsplit product rounds."""
    e = tl.arange(0, EP)
    if SPLITS:
        total = tl.load(row_ptr + e, mask=e < n_experts, other=0.0)
        for s in tl.static_range(1, SPLITS):
            total += tl.load(row_ptr + s * split_stride + e, mask=e < n_experts, other=0.0)
        logits = tl.where(e < n_experts, total.to(ROUND).to(tl.float32), float("-inf"))
    else:
        logits = tl.load(row_ptr + e, mask=e < n_experts, other=float("-inf")).to(tl.float32)
    if RULE == 0:
        p = tl.exp(logits - tl.max(logits, 0))
        scores = p / tl.sum(p, 0)
    else:
        scores = logits
    kk = tl.arange(0, KP)
    real = kk < TOP_K
    chosen = tl.full([KP], float("-inf"), dtype=tl.float32)
    chosen_ids = tl.zeros([KP], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        # the value and its index in one reduction, the lowest index among equal scores
        value, best = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
        # a NaN row (overflowed logits) compares false everywhere and may pick a padding lane: keep
        # the id an expert's, so the grouping and the products never index past the last one
        best = tl.minimum(best, n_experts - 1)
        chosen = tl.where(kk == j, value, chosen)
        chosen_ids = tl.where(kk == j, best.to(tl.int32), chosen_ids)
        scores = tl.where(e == best, float("-inf"), scores)
    if RULE == 1:
        p = tl.where(real, tl.exp(chosen - tl.max(chosen, 0)), 0.0)
        chosen = p / tl.sum(p, 0)
    elif NORM:
        chosen = chosen / tl.sum(tl.where(real, chosen, 0.0), 0)
    return chosen, chosen_ids


@triton.jit
def top_k_cols(
    logits,  # [EP, BT] fp32: each column a token's router logits, -inf past the experts
    e,  # [EP] the experts' indices
    n_experts,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,
    RULE: tl.constexpr,
    NORM: tl.constexpr,
):
    """``top_k_of`` for a block of tokens, a column each: their k experts (int32 [KP, BT]) and
    weights (fp32 [KP, BT]; rows past TOP_K padding). A column's sums run in one order whichever
    tokens share its block, so a token's routing does not depend on its step's other tokens."""
    if RULE == 0:
        p = tl.exp(logits - tl.max(logits, 0)[None, :])
        scores = p / tl.sum(p, 0)[None, :]
    else:
        scores = logits
    kk = tl.arange(0, KP)
    real = kk < TOP_K
    chosen = tl.full([KP, logits.shape[1]], float("-inf"), dtype=tl.float32)
    chosen_ids = tl.zeros([KP, logits.shape[1]], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        value, best = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.minimum(best, n_experts - 1)  # a NaN column may pick a padding row (``top_k_of``)
        chosen = tl.where(kk[:, None] == j, value[None, :], chosen)
        chosen_ids = tl.where(kk[:, None] == j, best.to(tl.int32)[None, :], chosen_ids)
        scores = tl.where(e[:, None] == best[None, :], float("-inf"), scores)
    if RULE == 1:
        p = tl.where(real[:, None], tl.exp(chosen - tl.max(chosen, 0)[None, :]), 0.0)
        chosen = p / tl.sum(p, 0)[None, :]
    elif NORM:
        chosen = chosen / tl.sum(tl.where(real[:, None], chosen, 0.0), 0)[None, :]
    return chosen, chosen_ids


@triton.jit(do_not_specialize=["tokens"])  # a step's rows: one compile for all
def _router_route_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, H] the router's weight
    bias_ptr,  # [E], or w_ptr without one
    table_ptr,  # TABLE: [T, E] logits to route by in place of the product's (a dummy model's draws)
    logits_ptr,  # [T, E] out: the product, in the model's dtype
    weights_ptr,  # [T, TOP_K] fp32 out
    ids_ptr,  # [T, TOP_K] int32 out
    tokens,
    hidden,
    n_experts,
    stride_x,
    stride_table,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,
    EP: tl.constexpr,  # E rounded up to a power of two, at least 16 (the product's side)
    RULE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TABLE: tl.constexpr,
    BT: tl.constexpr,  # tokens a program
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, EP)
    kcols = tl.arange(0, BK)
    t_ok = t < tokens
    e_ok = e < n_experts
    if PDL:
        wait()
    w_rows = w_ptr + e[:, None].to(tl.int64) * hidden
    x_cols = x_ptr + t[None, :].to(tl.int64) * stride_x
    acc = tl.zeros([EP, BT], dtype=tl.float32)  # experts x tokens: the experts fill the MMA's rows
    for k0 in tl.range(0, hidden, BK, num_stages=STAGES):
        k_ok = (k0 + kcols) < hidden
        w = tl.load(w_rows + (k0 + kcols)[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_cols + (k0 + kcols)[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PREC)
    if PDL:
        launch_dependents()
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[:, None]
    dtype = logits_ptr.dtype.element_ty
    product = acc.to(dtype)  # rounded as the router's linear layer rounds its output
    both = e_ok[:, None] & t_ok[None, :]
    tl.store(logits_ptr + t[None, :].to(tl.int64) * n_experts + e[:, None], product, mask=both)
    if TABLE:
        product = tl.load(table_ptr + t[None, :].to(tl.int64) * stride_table + e[:, None], mask=both)
    logits = tl.where(e_ok[:, None], product.to(tl.float32), float("-inf"))
    chosen, chosen_ids = top_k_cols(logits, e, n_experts, TOP_K, KP, RULE, NORM)
    kk = tl.arange(0, KP)
    out = t[None, :].to(tl.int64) * TOP_K + kk[:, None]
    real = (kk < TOP_K)[:, None] & t_ok[None, :]
    tl.store(weights_ptr + out, chosen, mask=real)
    tl.store(ids_ptr + out, chosen_ids, mask=real)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, TOP_K] fp32
    ids_ptr,  # [T, TOP_K] int32
    n_experts,
    stride_l,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,  # TOP_K rounded up to a power of two
    EP: tl.constexpr,  # E rounded up to a power of two
    RULE: tl.constexpr,  # 0: softmax then top k; 1: top k then softmax over them
    NORM: tl.constexpr,  # renormalise the k weights (rule 0)
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
):
    if PDL:
        launch_dependents()
        wait()
    t = tl.program_id(0).to(tl.int64)
    chosen, chosen_ids = top_k_of(logits_ptr + t * stride_l, n_experts, TOP_K, KP, EP, RULE, NORM)
    kk = tl.arange(0, KP)
    tl.store(weights_ptr + t * TOP_K + kk, chosen, mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, chosen_ids, mask=kk < TOP_K)


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def rule_constexprs(top_k: int, experts: int, rule: str, norm: bool) -> dict:
    """``top_k_of``'s constexprs (the route kernel's, and the up kernel's where it routes)."""
    return {"KP": pow2(top_k), "EP": pow2(experts), "RULE": ROUTER_RULES[rule], "NORM": norm}


def route(
    logits: torch.Tensor, top_k: int, rule: str = "softmax_topk", norm: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] -> weights [T, k] fp32, ids [T, k] int32
    """Each token's k experts and their weights (``moe.route_ref``'s semantics, one kernel)."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
            **rule_constexprs(top_k, experts, rule, norm), **pdl.chained(logits.device),
        )  # fmt: skip
    return weights, ids


# The router's product and the routing in one kernel (``router_route``) up to this many tokens (a
# decode step; a prefill's many rows take cuBLAS and the route kernel: each program here reads the
# router's whole weight), ROUTER_BT tokens a program, the K step and the loads in flight.
ROUTER_ROUTE_MAX = 2048
ROUTER_BT, ROUTER_BK, ROUTER_STAGES = 16, 64, 4


def router_route(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [E, H]
    bias: torch.Tensor | None,
    top_k: int,
    rule: str = "softmax_topk",
    norm: bool = False,
    table: torch.Tensor | None = None,  # [T, E]: route by these logits instead (a dummy model's)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids [T, k] int32, logits
    """``route(F.linear(x, weight, bias), top_k, rule, norm)`` in one kernel, with the product's
    logits [T, E] (x's dtype) beside; ``table``: the routing is ``route(table, ...)``'s, the product
    still computed (a dummy model runs the kernels a trained one runs)."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != hidden or weight.dtype != x.dtype:
        raise ValueError(
            f"router_route takes x [T, H] and a weight [E, H] of its dtype with unit column strides: x "
            f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    if table is not None and (table.shape != (tokens, experts) or table.stride(1) != 1):
        raise ValueError(f"table must be [{tokens}, {experts}] with unit column stride: {tuple(table.shape)}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(tokens, experts, dtype=x.dtype, device=x.device)
    if tokens:
        consts = rule_constexprs(top_k, experts, rule, norm)
        consts["EP"] = max(16, consts["EP"])  # tl.dot's smallest side
        _router_route_kernel[(triton.cdiv(tokens, ROUTER_BT),)](
            x, weight, weight if bias is None else bias, x if table is None else table, logits, weights,
            ids, tokens, hidden, experts, x.stride(0), 0 if table is None else table.stride(0),
            TOP_K=top_k, **consts, HAS_BIAS=bias is not None, TABLE=table is not None, BT=ROUTER_BT,
            BK=ROUTER_BK, STAGES=ROUTER_STAGES, num_warps=4,
            DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", **pdl.chained(x.device),
        )  # fmt: skip
    return weights, ids, logits


__all__ = [
    "ROUTER_ROUTE_MAX",
    "ROUTER_RULES",
    "pow2",
    "route",
    "router_route",
    "rule_constexprs",
    "top_k_cols",
    "top_k_of",
]
