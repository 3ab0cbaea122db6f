"""The fused MoE kernels (``model/kernels/fused_moe.py``) against the reference (``model/moe.py``):
routing with ties, the grouping by expert, and the experts' output on random shapes (fixed cases and
ones hypothesis draws), with every token on one expert, with experts that get no token, and at each
tile size's block height."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.model.kernels import fused_moe, moe_grouping
from prefixserve.model.moe_reference import experts_ref, route_ref

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("rule", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "norm"), [(5, 7, 3, True), (9, 128, 8, False), (3, 4, 1, True)]
)
def test_route_matches_the_reference(rule: str, tokens: int, experts: int, top_k: int, norm: bool) -> None:
    gen = torch.Generator().manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[0, :] = 0.25  # every expert tied: the k lowest indices
    logits[1, 2::2] = 3.0  # ties at the top
    weights, ids = fused_moe.route(logits.to(DEVICE), top_k, rule, norm)
    want_w, want_ids = route_ref(logits, top_k, rule, norm)
    assert ids.cpu().tolist() == want_ids.tolist()
    torch.testing.assert_close(weights.cpu(), want_w, rtol=1e-5, atol=1e-6)


def _grouping_ref(ids: list[int], experts: int, block_m: int) -> tuple[list[list[int]], list[int]]:
    """Each used block's assignments and expert, as ``align`` lays them out: experts in order, each
    expert's assignments in order, its run padded to whole blocks."""
    rows, owners = [], []
    for e in range(experts):
        mine = [a for a, x in enumerate(ids) if x == e]
        for b in range(0, len(mine), block_m):
            rows.append(mine[b : b + block_m])
            owners.append(e)
    return rows, owners


@pytest.mark.parametrize("chunk", [None, 16, 64])  # None: shipped (a program an expert here); 16, 64: chunks
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("case", ["random", "one_expert", "few_experts"])
def test_align_groups_every_assignment_once_by_expert(block_m: int, chunk, case: str, monkeypatch) -> None:
    """Every assignment once, by expert then in order; unused blocks marked; a program an expert or
    in chunks."""
    if chunk:
        monkeypatch.setattr(moe_grouping, "GROUP_CHUNK", chunk)
        monkeypatch.setattr(moe_grouping, "EXPERT_PROGRAMS_MAX", 0)
    gen = torch.Generator().manual_seed(block_m)
    experts = 9
    ids = torch.randint(0, experts, (150,), generator=gen)
    ids[:40] = 4  # one expert with more than a block
    if case == "one_expert":
        ids[:] = experts - 1
    elif case == "few_experts":  # most experts get no token
        ids = ids % 2 * 6
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(-7))  # unwritten: visible
    grouped = fused_moe.align(ids.to(DEVICE, torch.int32), experts, block_m)
    monkeypatch.setattr(torch, "empty", empty)
    slots, block_expert, block_rows, _ = (t.cpu() for t in grouped)
    want_rows, want_owners = _grouping_ref(ids.tolist(), experts, block_m)
    used = len(want_owners)
    assert grouped.used.tolist() == [used]
    assert block_expert[:used].tolist() == want_owners
    assert block_rows[:used].tolist() == [len(r) for r in want_rows]
    assert block_expert[used:].tolist() == [-1] * (block_expert.numel() - used)
    assert block_rows[used:].tolist() == [0] * (block_expert.numel() - used)
    for b, rows in enumerate(want_rows):
        assert slots[b * block_m : b * block_m + len(rows)].tolist() == rows


CASES = [  # tokens, experts, top_k, hidden, inter
    (1, 8, 2, 64, 48),
    (7, 5, 2, 40, 24),  # sizes off the tiles
    (33, 16, 4, 64, 32),  # 8+ tokens per expert: 32-row blocks
    (70, 6, 3, 32, 16),  # 35 per expert: 64-row blocks... and more than one block per expert
]


GROUPINGS = {  # (DIRECT_MAX, GROUP_CHUNK, EXPERT_PROGRAMS_MAX): each case's grouping forced
    "shipped": None,
    "grouped": (0, moe_grouping.GROUP_CHUNK, moe_grouping.EXPERT_PROGRAMS_MAX),
    "grouped_in_chunks": (0, 16, 0),
}


# every activation on the shipped grouping; the forced groupings (independent of it) with SiLU
GROUPED_ACTS = [("shipped", act) for act in ("silu", "gelu_pytorch_tanh", "swiglu_oai")]
GROUPED_ACTS += [(grouping, "silu") for grouping in GROUPINGS if grouping != "shipped"]


def _layer(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, act: str) -> tuple:
    """Random (x, w_up, w_down, weights, ids, up_bias, down_bias) on the CPU in fp32; biases for
    gpt-oss's activation only."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w_up = torch.randn(experts * 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(experts * hidden, inter, generator=gen) * inter**-0.5
    weights, ids = route_ref(torch.randn(tokens, experts, generator=gen), top_k, norm=True)
    biased = act == "swiglu_oai"
    up_bias = torch.randn(experts * 2 * inter, generator=gen) if biased else None
    down_bias = torch.randn(experts * hidden, generator=gen) if biased else None
    return x, w_up, w_down, weights, ids, up_bias, down_bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"), CASES)
@pytest.mark.parametrize(("grouping", "act"), GROUPED_ACTS)
def test_experts_match_the_reference(
    tokens, experts, top_k, hidden, inter, act, dtype, grouping, monkeypatch
) -> None:
    """Each token's weighted sum of its experts, whichever way the step groups its assignments: one
    block per assignment (a few), grouped by expert by a program an expert or in chunks."""
    if GROUPINGS[grouping] is not None:
        monkeypatch.setattr(fused_moe, "DIRECT_MAX", GROUPINGS[grouping][0])
        monkeypatch.setattr(moe_grouping, "GROUP_CHUNK", GROUPINGS[grouping][1])
        monkeypatch.setattr(moe_grouping, "EXPERT_PROGRAMS_MAX", GROUPINGS[grouping][2])
    x, w_up, w_down, weights, ids, up_bias, down_bias = _layer(
        tokens * 7 + experts, tokens, experts, top_k, hidden, inter, act
    )
    want = experts_ref(x.double(), w_up.double(), w_down.double(), weights.double(), ids, act,
                       None if up_bias is None else up_bias.double(),
                       None if down_bias is None else down_bias.double())  # fmt: skip
    dev = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    got = fused_moe.experts_forward(
        dev(x), dev(w_up), dev(w_down), weights.to(DEVICE), ids.to(DEVICE, torch.int32),
        fused_moe.ACTIVATIONS[act], dev(up_bias), dev(down_bias),
    )  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


@settings(max_examples=16, deadline=None)
@given(
    tokens=st.integers(1, 80),
    experts=st.integers(1, 12),
    top_k=st.integers(1, 4),
    hidden=st.integers(2, 96),
    inter=st.integers(2, 64),
    act=st.sampled_from(["silu", "gelu_pytorch_tanh", "swiglu_oai"]),
)
def test_experts_match_the_reference_on_random_shapes(tokens, experts, top_k, hidden, inter, act) -> None:
    """The shipped grouping on shapes drawn at random (a step of 1-80 tokens, 1-12 experts, k up to
    4 of them, widths of 2-96), fp32: every drawn case within the fixed cases' tolerance."""
    top_k = min(top_k, experts)
    x, w_up, w_down, weights, ids, up_bias, down_bias = _layer(
        tokens + 13 * experts + hidden, tokens, experts, top_k, hidden, inter, act
    )
    wide = lambda t: None if t is None else t.double()  # noqa: E731
    want = experts_ref(
        wide(x), wide(w_up), wide(w_down), wide(weights), ids, act, wide(up_bias), wide(down_bias)
    )
    dev = lambda t: None if t is None else t.to(DEVICE, torch.float32)  # noqa: E731
    got = fused_moe.experts_forward(
        dev(x), dev(w_up), dev(w_down), weights.to(DEVICE), ids.to(DEVICE, torch.int32),
        fused_moe.ACTIVATIONS[act], dev(up_bias), dev(down_bias),
    )  # fmt: skip
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)


SWAP_CASES = [  # tokens, experts, top_k, hidden, inter, tile (BM, up BN, down BN, BK, warps, stages)
    (1, 8, 2, 64, 48, (16, 64, 64, 128, 4, 4)),  # a direct step; inter off the 64-column tile
    (33, 16, 4, 64, 32, (16, 64, 64, 128, 4, 3)),
    (70, 6, 3, 40, 16, (32, 32, 64, 64, 4, 2)),  # K off the K step
    (96, 5, 4, 64, 96, (64, 64, 128, 64, 4, 3)),  # several 64-row blocks an expert
]


def _tile_case(tokens, experts, top_k, hidden, inter, act, dtype) -> tuple[tuple, tuple, torch.Tensor]:
    """(the experts' tensors on the device, the activation and biases, the fp64 reference of the
    inputs as the kernels see them) of a random layer."""
    x, w_up, w_down, weights, ids, up_bias, down_bias = _layer(
        tokens + inter, tokens, experts, top_k, hidden, inter, act
    )
    dev = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    exact = lambda t: None if t is None else dev(t).double().cpu()  # noqa: E731
    want = experts_ref(
        exact(x), exact(w_up), exact(w_down), weights.double(), ids, act, exact(up_bias), exact(down_bias)
    )
    args = (dev(x), dev(w_up), dev(w_down), weights.to(DEVICE), ids.to(DEVICE, torch.int32))
    return args, (fused_moe.ACTIVATIONS[act], dev(up_bias), dev(down_bias)), want


def _same_sums(got: torch.Tensor, other: torch.Tensor) -> None:
    """The same fp32 sums in the same K order: the same bits on a GPU (H200), the interpreter's
    rounding aside on the CPU."""
    if DEVICE.type == "cuda":
        assert torch.equal(got, other)
    else:
        torch.testing.assert_close(got, other, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "tile"), SWAP_CASES)
def test_transposed_products_match_the_reference(
    tokens, experts, top_k, hidden, inter, tile, act, dtype
) -> None:
    """The expert GEMMs run transposed (``Tile.swap``: the weight's columns on the tensor core's wide
    side) against the reference and against the same tile untransposed."""
    args, rest, want = _tile_case(tokens, experts, top_k, hidden, inter, act, dtype)
    got = fused_moe.experts_forward(*args, *rest, tile=fused_moe.Tile(*tile, swap=True))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)
    _same_sums(got, fused_moe.experts_forward(*args, *rest, tile=fused_moe.Tile(*tile)))


PERSISTENT_CASES = [
    *SWAP_CASES[1:],
    (200, 4, 2, 64, 96, (64, 32, 32, 64, 4, 3)),  # 20-30 tiles, 12 programs
    (280, 2, 2, 32, 48, (128, 32, 32, 64, 4, 3)),  # 128-row blocks: two full and one part an expert
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "tile"), PERSISTENT_CASES)
def test_persistent_programs_match_a_program_a_tile(
    tokens, experts, top_k, hidden, inter, tile, swap, dtype
) -> None:
    """Programs walking the used blocks' tiles (``Tile.persistent``; fewer programs than tiles on
    the interpreter's four SMs) against the reference and against a program a tile."""
    args, rest, want = _tile_case(tokens, experts, top_k, hidden, inter, "swiglu_oai", dtype)
    got = fused_moe.experts_forward(*args, *rest, tile=fused_moe.Tile(*tile, swap=swap, persistent=True))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)
    _same_sums(got, fused_moe.experts_forward(*args, *rest, tile=fused_moe.Tile(*tile, swap=swap)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_taller_blocks_give_the_same_sums(dtype) -> None:
    """128-row blocks (``WIDEST_TILE``'s) against 64-row ones over the same routing: each output is
    the same fp32 sum in the same K order, so a token's bits do not depend on which tile its step's
    size chose."""
    args, rest, want = _tile_case(280, 2, 2, 32, 48, "swiglu_oai", dtype)
    tall = fused_moe.Tile(128, 32, 32, 64, 4, 3, persistent=True, per_sm=2)
    got = fused_moe.experts_forward(*args, *rest, tile=tall)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)
    _same_sums(got, fused_moe.experts_forward(*args, *rest, tile=tall._replace(bm=64, per_sm=3)))


def test_every_token_on_one_expert_and_experts_without_tokens() -> None:
    gen = torch.Generator().manual_seed(5)
    tokens, experts, hidden, inter = 40, 8, 32, 16
    x = torch.randn(tokens, hidden, generator=gen)
    w_up = torch.randn(experts * 2 * inter, hidden, generator=gen) * 0.2
    w_down = torch.randn(experts * hidden, inter, generator=gen) * 0.2
    for ids in (torch.full((tokens, 1), 6), torch.tensor([[1, 6]] * tokens)):
        weights = torch.rand(tokens, ids.shape[1], generator=gen)
        want = experts_ref(x, w_up, w_down, weights, ids)
        got = fused_moe.experts_forward(
            x.to(DEVICE), w_up.to(DEVICE), w_down.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE, torch.int32)
        )
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_direct_step_gives_a_token_the_bits_of_a_batched_step(tokens: int, act: str) -> None:
    """A decode step of one or two tokens (DIRECT: one block per assignment, no grouping) gives each
    token what it gets inside a larger batched step (grouped): the same products, roundings and
    order, so the same bits on a GPU."""
    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter, batch = 16, 8, 96, 64, 24
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = torch.randn(batch, hidden, generator=gen).to(DEVICE, dtype)
    w_up = (torch.randn(experts * 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts * hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    biased = act == "swiglu_oai"
    up_bias = torch.randn(experts * 2 * inter, generator=gen).to(DEVICE, dtype) if biased else None
    down_bias = torch.randn(experts * hidden, generator=gen).to(DEVICE, dtype) if biased else None
    weights, ids = route_ref(torch.randn(batch, experts, generator=gen), top_k, norm=True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE, torch.int32)
    kind = fused_moe.ACTIVATIONS[act]
    assert tokens * top_k <= fused_moe.DIRECT_MAX < batch * top_k
    alone = fused_moe.experts_forward(
        x[:tokens], w_up, w_down, weights[:tokens], ids[:tokens], kind, up_bias, down_bias
    )
    batched = fused_moe.experts_forward(x, w_up, w_down, weights, ids, kind, up_bias, down_bias)
    if DEVICE.type == "cuda":
        assert torch.equal(alone, batched[:tokens])
    else:  # the interpreter's products are NumPy matmuls of other shapes: their order may differ
        torch.testing.assert_close(alone, batched[:tokens], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "rule", "norm", "act"),
    [
        (1, 128, 8, "softmax_topk", True, "silu"),  # Qwen3-30B-A3B's routing
        (2, 128, 8, "softmax_topk", False, "silu"),
        (1, 32, 4, "topk_softmax", False, "swiglu_oai"),  # gpt-oss's
        (2, 7, 3, "softmax_topk", True, "gelu_pytorch_tanh"),
    ],
)
def test_routing_in_the_up_kernel_gives_the_route_kernels_bits(
    tokens: int, experts: int, top_k: int, rule: str, norm: bool, act: str
) -> None:
    """A direct step routed in the up kernel's prologue (``routed_forward``) against the route kernel
    then ``experts_forward``: the same experts, weights and outputs, bit for bit; tied logits take
    the lower index in both."""
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    hidden, inter = 96, 64
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[0, 1::2] = 2.0  # ties at the top
    logits = logits.to(DEVICE, dtype)
    w_up = (torch.randn(experts * 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts * hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    biased = act == "swiglu_oai"
    up_bias = torch.randn(experts * 2 * inter, generator=gen).to(DEVICE, dtype) if biased else None
    down_bias = torch.randn(experts * hidden, generator=gen).to(DEVICE, dtype) if biased else None
    kind = fused_moe.ACTIVATIONS[act]
    weights, ids = fused_moe.route(logits, top_k, rule, norm)
    want = fused_moe.experts_forward(x, w_up, w_down, weights, ids, kind, up_bias, down_bias)
    got = fused_moe.routed_forward(x, logits, top_k, rule, norm, w_up, w_down, kind, up_bias, down_bias)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="direct step"):
        many = torch.zeros(fused_moe.DIRECT_MAX, experts, device=DEVICE, dtype=dtype)
        fused_moe.routed_forward(x.new_zeros(len(many), hidden), many, top_k, rule, norm, w_up, w_down)


@pytest.mark.parametrize(("tokens", "experts", "splits"), [(1, 128, 8), (2, 7, 3)])
def test_router_partials_summed_in_the_up_kernel(tokens: int, experts: int, splits: int) -> None:
    """A direct step handed the router's split-K partials [S, T, E] (``decode_split.router_partials``)
    routes as it does given their in-order fp32 sum rounded to x's dtype (``fused.summed_partials``):
    the same bits; and ``fused.moe_routed_experts`` sums them where the up kernel does not route."""
    from prefixserve.model import fused

    gen = torch.Generator().manual_seed(tokens + experts)
    hidden, inter, top_k = 64, 32, min(8, experts - 1)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    parts = torch.randn(splits, tokens, experts, generator=gen).to(DEVICE)
    w_up = (torch.randn(experts * 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts * hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    summed = fused.summed_partials(parts, dtype)
    want = fused_moe.routed_forward(x, summed, top_k, "softmax_topk", True, w_up, w_down)
    got = fused_moe.routed_forward(x, parts, top_k, "softmax_topk", True, w_up, w_down)
    assert torch.equal(got, want)
    with fused.moe_routing_in_experts(False):  # the route kernel (or the CPU's sort) after the sum
        route = (top_k, "softmax_topk", True)
        alone = fused.moe_routed_experts(x, parts, route, w_up, w_down, "silu")
        torch.testing.assert_close(alone, fused.moe_routed_experts(x, summed, route, w_up, w_down, "silu"))
    with pytest.raises(ValueError, match="fp32"):
        fused_moe.routed_forward(x, parts.to(dtype).half(), top_k, "softmax_topk", True, w_up, w_down)


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 128, 8), (2, 7, 3), (40, 9, 4)])
def test_parts_summed_by_the_norm_give_the_combined_bits(tokens: int, experts: int, top_k: int) -> None:
    """A layer's weighted expert outputs handed to the add-RMSNorm unsummed (``summed=False``: a
    [k, T, H] view, no combine kernel) give the outputs the combined layer gives it, bit for bit: the
    norm sums a token's k rows in fp32 in slot order and rounds once, as the combine kernel does. The
    first two cases are direct steps, the third grouped. ``fused.moe_routed_experts`` hands them only
    when asked and switched on; the torch path sums them alike."""
    from prefixserve.model import fused
    from prefixserve.model.kernels.rms_norm import add_rms_norm

    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    hidden, inter = 96, 64
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE, dtype)
    w_up = (torch.randn(experts * 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts * hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    norm_w = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    weights, ids = fused_moe.route(logits, top_k, "softmax_topk", True)
    whole = fused_moe.experts_forward(x, w_up, w_down, weights, ids)
    parts = fused_moe.experts_forward(x, w_up, w_down, weights, ids, summed=False)
    assert parts.shape == (top_k, tokens, hidden)
    combined = add_rms_norm(whole, norm_w, 1e-5, residual)
    for got, want in zip(add_rms_norm(parts, norm_w, 1e-5, residual), combined, strict=True):
        assert torch.equal(got, want)
    route = (top_k, "softmax_topk", True)
    handed = fused.moe_routed_experts(x, logits, route, w_up, w_down, "silu", parts=True)
    if DEVICE.type == "cuda":  # the kernels' path (the CPU's reference loop sums them itself)
        assert handed.shape == (top_k, tokens, hidden)
        assert torch.equal(add_rms_norm(handed, norm_w, 1e-5, residual)[0], combined[0])
    with fused.moe_parts_to_norm(False):
        assert fused.moe_routed_experts(x, logits, route, w_up, w_down, "silu", parts=True).shape == x.shape
    with fused.triton_kernels(False):  # the torch path: the same in-order fp32 sum, then HF's norm
        torch_out, torch_stream = fused.add_rms_norm(parts, norm_w, 1e-5, residual)
    assert torch.equal(torch_stream, combined[1])
    torch.testing.assert_close(torch_out, combined[0])
    with pytest.raises(ValueError, match="model's dtype"):  # neither fp32 nor the residual's dtype
        add_rms_norm(parts.half(), norm_w, 1e-5, residual)


def test_no_tokens() -> None:
    x = torch.empty(0, 16, device=DEVICE)
    out = fused_moe.experts_forward(
        x, torch.ones(4 * 16, 16, device=DEVICE), torch.ones(4 * 16, 8, device=DEVICE),
        torch.empty(0, 2, device=DEVICE), torch.empty(0, 2, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    assert out.shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 256])  # direct; 32-row blocks; persistent 64-row blocks
def test_pdl_routing_and_experts_in_a_graph_equal_them_without(
    tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routing and the experts' kernels graphed with programmatic dependent launch on give the bits
    they give with it off (each waits for the kernel before, the persistent kernels for the used
    block count the grouping writes; ``triton_support.pdl``)."""
    from prefixserve.triton_support import pdl

    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k = 256, 128, 16, 4
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    w_up = (torch.randn(experts * 2 * inter, hidden, generator=gen) / 16).to(DEVICE, torch.bfloat16)
    w_down = (torch.randn(experts * hidden, inter, generator=gen) / 16).to(DEVICE, torch.bfloat16)

    def layer() -> torch.Tensor:
        weights, ids = fused_moe.route(logits, top_k, "softmax_topk", True)
        out = fused_moe.experts_forward(x, w_up, w_down, weights, ids)
        if tokens * top_k > fused_moe.DIRECT_MAX:
            return out
        return out + fused_moe.routed_forward(x, logits, top_k, "softmax_topk", True, w_up, w_down)

    outs = {}
    for flag in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", flag)
        layer()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[flag] = layer()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(outs[False], outs[True])
