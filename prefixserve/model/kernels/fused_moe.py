"""The mixture-of-experts MLP on the GPU: route, group by expert, two grouped GEMMs, combine.

A step's T tokens each go to k of E experts: N = T k assignments. The kernels have fixed grids for a
given T (CUDA-graph safe: no host sync, nothing sized by the routing):

  * the routing (``moe_route.route``, one program per token): the router's softmax and top k (or
    top k, then a softmax over them), ties to the lower expert index, the k weights renormalised
    where asked (a direct step, below, routes in the up kernel instead: ``routed_forward``);
  * the grouping (``moe_grouping.align``): the assignments by expert into blocks of BM rows, each
    expert's run padded to whole blocks; none at all for N <= ``DIRECT_MAX`` (each assignment a
    block of its own);
  * ``_expert_up_kernel`` (block x intermediate tile): each block's tokens gathered from x, times its
    expert's gate and up rows, the activation in the epilogue: ``inter`` [NB BM, I] by block row;
  * ``_expert_down_kernel`` (block x hidden tile): ``inter``'s rows times the expert's down
    projection, times the assignment's routing weight: [N, H] by assignment;
  * ``_combine_kernel``: each token's k rows summed in fp32; or, where an add-RMSNorm comes next,
    none: the rows go to it as partials (``hand_parts``), and it sums them alike.

The two GEMMs run a program a (block, column tile), or with a ``persistent`` tile (64- and 128-row
blocks) ``Tile.per_sm`` programs an SM that walk the used blocks' tiles (``_persistent_up_kernel``,
``_persistent_down_kernel``): the same tiles and the same sums, so the same bits.

A block reads only its expert's weights, so a step reads the experts its tokens route to, each once
per block (twice for an expert with more than BM tokens, L2 permitting). The assignment order inside
an expert is the order of the tokens and nothing is summed by atomics, so a token's result never
depends on how the step was batched. docs/kernels.md §9 has the measured choices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixserve.attention.planning.tiles import num_sms
from prefixserve.model.kernels.moe_grouping import align
from prefixserve.model.kernels.moe_route import route, rule_constexprs, top_k_of
from prefixserve.model.kernels.silu_mul import silu_mul
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()

SILU, GELU_TANH, SWIGLU_OAI = 0, 1, 2  # activations (``ACTIVATION``); SWIGLU_OAI: gpt-oss's clamped one
ACTIVATIONS = {"silu": SILU, "gelu_pytorch_tanh": GELU_TANH, "swiglu_oai": SWIGLU_OAI}


@triton.jit
def _act(gate, up, dtype: tl.constexpr, ACTIVATION: tl.constexpr, alpha, limit):
    """The experts' activation of fp32 gate and up products (rounded as the unfused model rounds)."""
    if ACTIVATION == 2:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
        g = tl.minimum(gate.to(dtype).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
        return (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    return silu_mul(gate, up, dtype, ACTIVATION == 1)


@triton.jit
def _block_of(block, slots_ptr, block_expert_ptr, block_rows_ptr, BM: tl.constexpr, DIRECT: tl.constexpr):
    """(expert, which of the BM rows are real, their assignments) of a block: from ``align``'s tables,
    or with ``DIRECT`` block b is assignment b alone and ``block_expert_ptr`` the flat expert ids
    (a step of a few assignments skips the grouping; two of them on one expert read it twice)."""
    r = tl.arange(0, BM)
    if DIRECT:
        return tl.load(block_expert_ptr + block), r == 0, block + r * 0
    real = r < tl.load(block_rows_ptr + block)
    return tl.load(block_expert_ptr + block), real, tl.load(slots_ptr + block * BM + r, mask=real, other=0)


@triton.jit
def _product(rows, w, acc, DOT_PREC: tl.constexpr, SWAP: tl.constexpr):
    """``acc`` + ``rows`` [BM, BK] @ ``w`` [BK, BN]; with ``SWAP`` the transposed product into ``acc``
    [BN, BM]: the weight's columns fill the tensor core's 64-row side and the block's few tokens its
    narrow side (Hopper's wgmma needs 64 rows; BM = 16 or 32 takes the older, slower mma)."""
    if SWAP:
        out = tl.dot(tl.trans(w), tl.trans(rows), acc, input_precision=DOT_PREC)
    else:
        out = tl.dot(rows, w, acc, input_precision=DOT_PREC)
    return out


@triton.jit
def _up_tile(
    x_ptr, w_ptr, bias_ptr, inter_ptr, expert, real, assign, block, col, hidden, inter, stride_x, alpha,
    limit, TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, SWAP: tl.constexpr,
    SIGNAL: tl.constexpr,
):  # fmt: skip
    """One block's tokens gathered from x, times its expert's gate and up rows of column tile ``col``,
    the activation, written by block row; ``SIGNAL``: let the dependent launch after the products."""
    token = (assign // TOP_K).to(tl.int64)
    n = col * BN + tl.arange(0, BN)
    n_ok = n < inter
    gate_rows = (expert.to(tl.int64) * 2 * inter + n) * hidden
    up_rows = gate_rows + inter * hidden
    acc_g = tl.zeros([BN, BM] if SWAP else [BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM] if SWAP else [BM, BN], dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < hidden
        xs = tl.load(
            x_ptr + token[:, None] * stride_x + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0
        )
        wmask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_ptr + gate_rows[None, :] + k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_ptr + up_rows[None, :] + k[:, None], mask=wmask, other=0.0)
        acc_g = _product(xs, wg, acc_g, DOT_PREC, SWAP)
        acc_u = _product(xs, wu, acc_u, DOT_PREC, SWAP)
    if SIGNAL:
        launch_dependents()
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if HAS_BIAS:
        cols = expert.to(tl.int64) * 2 * inter + n
        acc_g += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + cols + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = inter_ptr.dtype.element_ty
    out = _act(acc_g, acc_u, dtype, ACTIVATION, alpha, limit)
    row = block.to(tl.int64) * BM + tl.arange(0, BM)
    tl.store(inter_ptr + row[:, None] * inter + n[None, :], out.to(dtype), mask=real[:, None] & n_ok[None, :])


@triton.jit
def _down_tile(
    inter_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, expert, real, assign, block, col, hidden, inter,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    SWAP: tl.constexpr, SIGNAL: tl.constexpr,
):  # fmt: skip
    """One block's rows of ``inter`` times its expert's down projection (hidden tile ``col``), the
    expert's output rounded to the model dtype, times the routing weight, written by assignment."""
    assign = assign.to(tl.int64)
    n = col * BN + tl.arange(0, BN)
    n_ok = n < hidden
    w_rows = (expert.to(tl.int64) * hidden + n) * inter
    row = block.to(tl.int64) * BM + tl.arange(0, BM)
    acc = tl.zeros([BN, BM] if SWAP else [BM, BN], dtype=tl.float32)
    for k0 in range(0, inter, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < inter
        a = tl.load(
            inter_ptr + row[:, None] * inter + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(w_ptr + w_rows[None, :] + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _product(a, w, acc, DOT_PREC, SWAP)
    if SIGNAL:
        launch_dependents()
    if SWAP:
        acc = tl.trans(acc)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * hidden + n, mask=n_ok, other=0.0).to(tl.float32)[
            None, :
        ]
    acc = acc.to(dtype).to(tl.float32)  # the expert's output in the model dtype, as the unfused model
    weight = tl.load(weights_ptr + assign, mask=real, other=0.0)
    out = acc * weight[:, None]
    tl.store(
        out_ptr + assign[:, None] * hidden + n[None, :], out.to(dtype), mask=real[:, None] & n_ok[None, :]
    )


@triton.jit
def _expert_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E * 2 I, H]: expert e's gate rows at e 2I, its up rows at e 2I + I
    bias_ptr,  # [E * 2 I] (HAS_BIAS)
    inter_ptr,  # [NB BM, I] out: by block row, so the down GEMM reads whole tiles
    slots_ptr,
    block_expert_ptr,
    block_rows_ptr,
    hidden,
    inter,
    stride_x,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
    ROUTE: tl.constexpr = False,  # DIRECT, routed here: ``_top_k`` of the token's logits (``routed_forward``)
    logits_ptr=None,  # ROUTE: [T, E] router logits
    weights_ptr=None,  # ROUTE: [N] fp32, each assignment's weight written (for the down kernel)
    n_experts=0,
    stride_l=0,
    KP: tl.constexpr = 1,
    EP: tl.constexpr = 1,
    RULE: tl.constexpr = 0,
    NORM: tl.constexpr = False,
    LOGIT_SPLITS: tl.constexpr = 0,  # ROUTE: logits_ptr holds the router's fp32 split-K partials
    stride_split=0,
    SWAP: tl.constexpr = False,  # the products transposed (``_product``)
):
    """A program a (block, column tile)."""
    if PDL:
        wait()
    if ROUTE:  # block b is assignment b: token b // TOP_K's (b % TOP_K)-th expert
        b = tl.program_id(0)
        chosen, chosen_ids = top_k_of(
            logits_ptr + (b // TOP_K).to(tl.int64) * stride_l, n_experts, TOP_K, KP, EP, RULE, NORM,
            LOGIT_SPLITS, stride_split, x_ptr.dtype.element_ty,
        )  # fmt: skip
        pick = tl.arange(0, KP) == b % TOP_K
        expert = tl.sum(tl.where(pick, chosen_ids, 0), 0)
        if tl.program_id(1) == 0:  # the down kernel reads them (``block_expert_ptr``: the flat ids)
            tl.store(block_expert_ptr + b, expert)
            tl.store(weights_ptr + b, tl.sum(tl.where(pick, chosen, 0.0), 0))
        real = tl.arange(0, BM) == 0
        assign = b + tl.arange(0, BM) * 0
    else:
        expert, real, assign = _block_of(
            tl.program_id(0), slots_ptr, block_expert_ptr, block_rows_ptr, BM, DIRECT
        )
    if expert < 0:
        return
    _up_tile(
        x_ptr, w_ptr, bias_ptr, inter_ptr, expert, real, assign, tl.program_id(0), tl.program_id(1), hidden,
        inter, stride_x, alpha, limit, TOP_K, BM, BN, BK, ACTIVATION, HAS_BIAS, DOT_PREC, SWAP, PDL,
    )  # fmt: skip


@triton.jit
def _expert_down_kernel(
    inter_ptr,  # [NB BM, I]: the up GEMM's output, by block row
    w_ptr,  # [E * H, I]
    bias_ptr,  # [E * H] (HAS_BIAS)
    weights_ptr,  # [N] fp32 routing weights
    out_ptr,  # [N, H] out
    slots_ptr,
    block_expert_ptr,
    block_rows_ptr,
    hidden,
    inter,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
    SWAP: tl.constexpr = False,  # the product transposed (``_product``)
):
    """A program a (block, hidden tile)."""
    if PDL:
        wait()
    expert, real, assign = _block_of(
        tl.program_id(0), slots_ptr, block_expert_ptr, block_rows_ptr, BM, DIRECT
    )
    if expert < 0:
        return
    _down_tile(
        inter_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, expert, real, assign, tl.program_id(0),
        tl.program_id(1), hidden, inter, BM, BN, BK, HAS_BIAS, DOT_PREC, SWAP, PDL,
    )  # fmt: skip


@triton.jit
def _persistent_up_kernel(
    x_ptr, w_ptr, bias_ptr, inter_ptr, slots_ptr, block_expert_ptr, block_rows_ptr, used_ptr, hidden, inter,
    stride_x, alpha, limit,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, PROGRAMS: tl.constexpr, PDL: tl.constexpr = False,
    SWAP: tl.constexpr = False,
):  # fmt: skip
    """``_expert_up_kernel``'s tiles of the ``used`` blocks (``moe_grouping``), a block's column tiles
    one after another, each of ``PROGRAMS`` programs taking every PROGRAMS-th tile: no program for an
    unused block, and a program's next loads start while the SM still holds its other programs."""
    if PDL:
        wait()
    cols = tl.cdiv(inter, BN)
    for tile in range(tl.program_id(0), tl.load(used_ptr) * cols, PROGRAMS):
        block = tile // cols
        expert, real, assign = _block_of(block, slots_ptr, block_expert_ptr, block_rows_ptr, BM, False)
        _up_tile(
            x_ptr, w_ptr, bias_ptr, inter_ptr, expert, real, assign, block, tile % cols, hidden, inter,
            stride_x, alpha, limit, TOP_K, BM, BN, BK, ACTIVATION, HAS_BIAS, DOT_PREC, SWAP, False,
        )  # fmt: skip
    if PDL:
        launch_dependents()


@triton.jit
def _persistent_down_kernel(
    inter_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, slots_ptr, block_expert_ptr, block_rows_ptr, used_ptr,
    hidden, inter,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    PROGRAMS: tl.constexpr, PDL: tl.constexpr = False, SWAP: tl.constexpr = False,
):  # fmt: skip
    """``_expert_down_kernel``'s tiles of the ``used`` blocks, as ``_persistent_up_kernel`` walks them."""
    if PDL:
        wait()
    cols = tl.cdiv(hidden, BN)
    for tile in range(tl.program_id(0), tl.load(used_ptr) * cols, PROGRAMS):
        block = tile // cols
        expert, real, assign = _block_of(block, slots_ptr, block_expert_ptr, block_rows_ptr, BM, False)
        _down_tile(
            inter_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, expert, real, assign, block, tile % cols,
            hidden, inter, BM, BN, BK, HAS_BIAS, DOT_PREC, SWAP, False,
        )  # fmt: skip
    if PDL:
        launch_dependents()


@triton.jit
def _combine_kernel(
    parts_ptr,  # [T, K, H]
    out_ptr,  # [T, H]
    hidden,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
):
    if PDL:
        launch_dependents()
        wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(parts_ptr + (t * TOP_K + j) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


class Tile(NamedTuple):
    """A launch of the two expert GEMMs: block rows, each kernel's columns a program, the K step,
    warps, pipeline stages, and whether the products run transposed (``_product``)."""

    bm: int
    bn_up: int
    bn_down: int
    bk: int
    warps: int
    stages: int
    swap: bool = False
    persistent: bool = False  # grouped: ``per_sm`` programs an SM walk the used blocks' tiles
    per_sm: int = 3  # persistent: programs an SM (as many as its shared memory holds at bf16)


# by the mean tokens per expert (docs/kernels.md §9 has the sweeps that chose them): a direct step's
# block an assignment with four loads in flight; blocks of 16 and 32 rows transposed onto wgmma; then
# persistent programs over 64-row blocks (three an SM) and 128-row ones (two: 96 KB of stages each),
# where an expert's one block reads its weights once, not once a block from both halves of the L2
DIRECT_TILE = Tile(16, 64, 64, 128, 4, 4, swap=True)
TILES = (  # (most tokens an expert, tile)
    (8, Tile(16, 64, 64, 128, 4, 3, swap=True)),
    (24, Tile(32, 64, 64, 64, 4, 3, swap=True)),  # one block an expert at 16 tokens each
    (64, Tile(64, 64, 128, 64, 4, 3, persistent=True)),
)
WIDEST_TILE = Tile(128, 64, 128, 64, 4, 3, persistent=True, per_sm=2)


def tiles(tokens: int, top_k: int, experts: int) -> Tile:
    """The tile by the mean tokens per expert: blocks only as tall as the experts' runs (a decode
    step's expert holds a few rows)."""
    if tokens * top_k <= DIRECT_MAX:
        return DIRECT_TILE
    per_expert = tokens * top_k / experts
    return next((tile for most, tile in TILES if per_expert <= most), WIDEST_TILE)


# up to this many assignments (a decode step of one or two tokens at k = 8) each is a block of its
# own and nothing is grouped: the grouping's launch is saved, and distinct experts are the rule
DIRECT_MAX = 16


def experts_forward(
    x: torch.Tensor,  # [T, H]
    w_up: torch.Tensor,  # [E * 2 I, H]
    w_down: torch.Tensor,  # [E * H, I]
    weights: torch.Tensor,  # [T, k] fp32
    ids: torch.Tensor,  # [T, k] int32
    activation: int = SILU,
    up_bias: torch.Tensor | None = None,  # [E * 2 I]
    down_bias: torch.Tensor | None = None,  # [E * H]
    alpha: float = 1.702,
    limit: float = 7.0,
    tile: Tile | None = None,  # default: ``tiles``' choice
    summed: bool = True,
) -> torch.Tensor:  # [T, H], or [k, T, H] parts
    """The routed experts' weighted sum for each token (``experts_ref``'s arithmetic); ``summed``
    False: each token's k weighted expert outputs instead, as a [k, T, H] view (``hand_parts``)."""
    return _experts(
        x, w_up, w_down, weights, ids, activation, up_bias, down_bias, alpha, limit, tile, summed=summed
    )


def routed_forward(
    x: torch.Tensor,  # [T, H]
    logits: torch.Tensor,  # [T, E] router logits, or the router product's fp32 split-K partials [S, T, E]
    top_k: int,
    rule: str,
    norm: bool,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: int = SILU,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    summed: bool = True,
) -> torch.Tensor:  # [T, H], or [k, T, H] parts
    """``experts_forward(x, ..., *route(logits, top_k, rule, norm), summed=summed)`` for a direct
    step (T k <= ``DIRECT_MAX``: a decode step of one or two tokens) with the routing in the up
    kernel's prologue: each program takes its token's k experts from the logits
    (``moe_route.top_k_of``, the route kernel's own), so the route kernel's launch goes; the same
    bits. Partials (``decode_split.router_partials``) are summed there, in order, and rounded to x's
    dtype, as the unsplit product would round them."""
    tokens, experts = logits.shape[-2:]
    n = tokens * top_k
    if n > DIRECT_MAX or x.shape[0] != tokens:
        raise ValueError(f"routed_forward takes a direct step (T k <= {DIRECT_MAX}): T={tokens}, k={top_k}")
    split = logits.dim() == 3
    if split and (logits.dtype != torch.float32 or logits.stride(-1) != 1):
        raise ValueError(f"router partials must be fp32 [S, T, E] with unit inner stride: {logits.dtype}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    route_args = {
        "ROUTE": True, "logits_ptr": logits, "weights_ptr": weights, "n_experts": experts,
        "stride_l": logits.stride(-2), **rule_constexprs(top_k, experts, rule, norm),
        "LOGIT_SPLITS": logits.shape[0] if split else 0, "stride_split": logits.stride(0) if split else 0,
    }  # fmt: skip
    return _experts(
        x, w_up, w_down, weights, ids, activation, up_bias, down_bias, alpha, limit, None, route_args, summed
    )


def _experts(
    x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    activation: int, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, alpha: float,
    limit: float, tile: Tile | None,
    route_args: dict | None = None,  # the up kernel routes (``routed_forward``): ids and weights its output
    summed: bool = True,  # False: the parts, unsummed (``hand_parts``)
) -> torch.Tensor:  # fmt: skip
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = w_down.shape[1]
    experts = w_down.shape[0] // hidden
    if tokens == 0:
        return torch.empty_like(x) if summed else x.new_empty(top_k, 0, hidden)
    n = tokens * top_k
    tile = Tile(*tile) if tile else tiles(tokens, top_k, experts)  # (a probe's plain tuple too)
    block_m, bn_up, bn_down, block_k, warps, stages, swap, persistent, per_sm = tile
    direct = n <= DIRECT_MAX
    if direct:  # one assignment a block: no grouping (``_block_of``)
        slots = block_rows = block_expert = ids.view(-1)
    else:
        slots, block_expert, block_rows, used = align(ids.view(-1), experts, block_m)
    blocks = block_expert.shape[0]
    inter_out = torch.empty(blocks * block_m, inter, dtype=x.dtype, device=x.device)
    parts = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    up_bias_or_w = up_bias if up_bias is not None else w_up
    down_bias_or_w = down_bias if down_bias is not None else w_down
    chained = pdl.chained(x.device)
    launch = {
        "num_warps": warps, "num_stages": stages, "SWAP": swap, **chained,
        "DOT_PREC": "ieee" if x.dtype == torch.float32 else "tf32",  # fp32 models in fp32 (tests, CPU parity)
    }  # fmt: skip
    up = {"TOP_K": top_k, "BM": block_m, "BN": bn_up, "BK": block_k, "ACTIVATION": activation,
          "HAS_BIAS": up_bias is not None, **launch}  # fmt: skip
    down = {"BM": block_m, "BN": bn_down, "BK": min(block_k, 64), "HAS_BIAS": down_bias is not None, **launch}
    if persistent and not direct:
        programs = per_sm * num_sms(x.device)
        _persistent_up_kernel[(programs,)](
            x, w_up, up_bias_or_w, inter_out, slots, block_expert, block_rows, used, hidden, inter,
            x.stride(0), alpha, limit, PROGRAMS=programs, **up,
        )  # fmt: skip
        _persistent_down_kernel[(programs,)](
            inter_out, w_down, down_bias_or_w, weights.view(-1), parts, slots, block_expert, block_rows, used,
            hidden, inter, PROGRAMS=programs, **down,
        )  # fmt: skip
    else:
        _expert_up_kernel[(blocks, triton.cdiv(inter, bn_up))](
            x, w_up, up_bias_or_w, inter_out, slots, block_expert, block_rows, hidden, inter, x.stride(0),
            alpha, limit, DIRECT=direct, **up, **(route_args or {}),
        )  # fmt: skip
        _expert_down_kernel[(blocks, triton.cdiv(hidden, bn_down))](
            inter_out, w_down, down_bias_or_w, weights.view(-1), parts, slots, block_expert, block_rows,
            hidden, inter, DIRECT=direct, **down,
        )  # fmt: skip
    if not summed:
        return hand_parts(parts, tokens, top_k)
    out = torch.empty_like(x)
    grid = (tokens, triton.cdiv(hidden, 1024))
    _combine_kernel[grid](parts, out, hidden, TOP_K=top_k, BLOCK=1024, **chained)
    return out


def hand_parts(parts: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """The down kernel's weighted rows [T k, H] (token-major, slot order) as a [k, T, H] view: the
    partials an add-RMSNorm sums in fp32 in slot order (``fused.add_rms_norm``), as the combine
    kernel sums them, so a layer followed by a norm needs no combine launch (the same bits)."""
    return parts.view(tokens, top_k, -1).transpose(0, 1)


__all__ = [
    "ACTIVATIONS",
    "GELU_TANH",
    "SILU",
    "SWIGLU_OAI",
    "Tile",
    "align",
    "experts_forward",
    "hand_parts",
    "route",
    "routed_forward",
    "tiles",
]
