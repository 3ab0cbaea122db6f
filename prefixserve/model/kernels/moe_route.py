"""The routing of a mixture-of-experts step on the GPU: each token's k experts and their weights.

``route`` runs one program a token (``_route_kernel``); a direct step of one or two tokens routes in
the fused up kernel's prologue instead (``fused_moe.routed_forward``), by the same ``top_k_of``, so
both give the same bits. ``moe_reference.route_ref`` is the CPU's rule (a stable sort: ties to the
lower index, as ``tl.argmax``'s left tie-break).
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


__all__ = ["ROUTER_RULES", "pow2", "route", "rule_constexprs", "top_k_of"]
