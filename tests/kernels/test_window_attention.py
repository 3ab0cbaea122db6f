"""Sliding-window attention against an fp64 oracle: the Triton kernel and the torch path, on random
shapes, decode and prefill rows mixed, sequences sharing prefix blocks, and windows that end before the
shared prefix, at its edge, inside it, and windows longer than every sequence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _kernel_helpers import DEVICE, rel_err

from prefixserve.attention.backend import make_backend
from prefixserve.attention.kernels.window_attention import window_attention as window_kernel
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.window import attend_layer, window_attention_torch


def _oracle(q, k_cache, v_cache, tables, query_lens, seq_lens, scale, window, sinks=None):
    """Dense fp64 attention per sequence with the window written out as a mask; ``sinks`` [Hq]: a
    logit per head beside the keys, with no value (gpt-oss)."""
    bs = k_cache.shape[1]
    out, start = [], 0
    for table, q_len, s_len in zip(tables, query_lens, seq_lens, strict=True):
        k = k_cache[table].flatten(0, 1)[:s_len].double()  # [N, Hkv, D]
        v = v_cache[table].flatten(0, 1)[:s_len].double()
        qs = q[start : start + q_len].double()  # [M, Hq, D]
        group = qs.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("mhd,nhd->hmn", qs, k) * scale
        i = torch.arange(s_len - q_len, s_len, device=q.device)[:, None]
        j = torch.arange(s_len, device=q.device)[None, :]
        visible = (j <= i) & (j > i - window) if window else j <= i
        scores = scores.masked_fill(~visible, -math.inf)
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        out.append(torch.einsum("hmn,nhd->mhd", probs, v))
        start += q_len
        assert len(table) * bs >= s_len
    return torch.cat(out)


def _case(seed: int, query_lens, seq_lens, shared_blocks: int, group: int, dim: int, bs: int, dtype):
    """A paged cache where every sequence's first ``shared_blocks`` blocks are the same blocks."""
    gen = torch.Generator().manual_seed(seed)
    own = [math.ceil(s / bs) - shared_blocks for s in seq_lens]
    assert min(own) >= 0
    need = shared_blocks + sum(own) + 2
    kv_heads = 2
    k = torch.randn(need, bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(need, bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    perm = torch.randperm(need, generator=gen).tolist()
    prefix, at = perm[:shared_blocks], shared_blocks
    tables = []
    for n in own:
        tables.append(prefix + perm[at : at + n])
        at += n
    q = torch.randn(sum(query_lens), kv_heads * group, dim, generator=gen).to(DEVICE, dtype)
    meta = build_metadata(bs, query_lens, seq_lens, tables, DEVICE)
    return q, k, v, tables, meta


# (query_lens, seq_lens, shared blocks of 16, window): decode rows whose windows end before the shared
# prefix (64 keys), at its edge, inside it; a prefill chunk reaching back into it; one row of one key
CASES = [
    ([1, 1, 1], [100, 90, 120], 4, 20),  # every window behind the prefix
    ([1, 1], [80, 80], 4, 16),  # window starts exactly at the prefix's edge (key 64)
    ([1, 1, 1], [70, 75, 66], 4, 16),  # windows end inside the prefix
    ([7, 1, 20], [70, 66, 84], 4, 9),  # prefill chunks and a decode row, windows across blocks
    ([33, 1], [33, 1], 0, 5),  # a whole prompt, a one-key sequence
    ([3, 2], [40, 50], 2, 64),  # window longer than every sequence: plain causal attention
]


@pytest.mark.parametrize(
    ("case", "group"),
    # decode rows (one query a sequence) take every group alike, so one group a case; a prefill
    # chunk's tiles hold BLOCK_M // group queries, so every group for each of those
    [(CASES[0], 1), (CASES[1], 3), (CASES[2], 4)] + [(case, g) for case in CASES[3:] for g in (1, 3, 4)],
)
def test_window_kernel_and_torch_path_match_the_oracle(case, group: int) -> None:
    query_lens, seq_lens, shared, window = case
    q, k, v, tables, meta = _case(7, query_lens, seq_lens, shared, group, 32, 16, torch.float32)
    scale = 32**-0.5
    ref = _oracle(q, k, v, tables, query_lens, seq_lens, scale, window)
    assert rel_err(window_attention_torch(q, k, v, meta, scale, window), ref) < 1e-5
    assert rel_err(window_kernel(q, k, v, meta, scale, window), ref) < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_window_kernel_random_shapes_bf16(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 5, (1,), generator=gen))
    seq_lens = torch.randint(40, 140, (n,), generator=gen).tolist()
    query_lens = [
        int(torch.randint(1, s + 1, (1,), generator=gen)) if i % 2 else 1 for i, s in enumerate(seq_lens)
    ]
    window = int(torch.randint(1, 90, (1,), generator=gen))
    q, k, v, tables, meta = _case(seed, query_lens, seq_lens, 2, 2, 64, 16, torch.bfloat16)
    ref = _oracle(q, k, v, tables, query_lens, seq_lens, 0.125, window)
    assert rel_err(window_kernel(q, k, v, meta, 0.125, window), ref) < 2e-2


@pytest.mark.parametrize("name", ["reference", "cascade", "triton"])
def test_backends_take_the_window(name: str) -> None:
    """``attend_layer`` with a window equals the oracle on every backend (the shared prefix planned as a
    segment for the full layers); a window covering every sequence keeps the backend's own path."""
    query_lens, seq_lens, shared = [1, 1, 5], [70, 75, 69], 4
    q, k, v, tables, meta = _case(3, query_lens, seq_lens, shared, 2, 32, 16, torch.float32)
    backend = make_backend(name)
    backend.prepare(meta)
    for window in (10, 16, 30, 200, None):
        ref = _oracle(q, k, v, tables, query_lens, seq_lens, 0.2, window)
        assert rel_err(attend_layer(backend, q, k, v, meta, 0.2, window), ref) < 1e-5, window


def _tree_case(seed: int, dtype: torch.dtype, own: list[int]):
    """Decode rows over a two-level tree of 16-token blocks: 4 blocks every row holds, then 2 blocks
    held by rows 0-2 and 2 others by rows 3-5, then each row's own tokens (``own``)."""
    gen = torch.Generator().manual_seed(seed)
    bs, kv_heads, dim, group = 16, 2, 32, 2
    own_blocks = [math.ceil(n / bs) for n in own]
    need = 4 + 2 + 2 + sum(own_blocks) + 1
    k = torch.randn(need, bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(need, bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    perm = torch.randperm(need, generator=gen).tolist()
    root, left, right, at = perm[:4], perm[4:6], perm[6:8], 8
    tables = []
    for i, n in enumerate(own_blocks):
        tables.append(root + (left if i < 3 else right) + perm[at : at + n])
        at += n
    seq_lens = [6 * bs + n for n in own]
    q = torch.randn(len(own), kv_heads * group, dim, generator=gen).to(DEVICE, dtype)
    meta = build_metadata(bs, [1] * len(own), seq_lens, tables, DEVICE)
    return q, k, v, tables, seq_lens, meta


@pytest.mark.parametrize("window", [5, 20, 40, 70, 100, 140])
@pytest.mark.parametrize("backend_name", ["cascade", "triton"])
def test_decode_windows_share_the_segments_inside_them(window: int, backend_name: str) -> None:
    """Windows that end before the tree's segments, at a segment's edge, inside one, and cover both
    levels: the segments wholly inside every holder's window are read once (the plan's KV rows fewer
    than the rows' windows), the others masked by each row's walk; both paths equal the oracle."""
    from prefixserve.attention.kernels.window_attention import window_shared_attention
    from prefixserve.attention.planning.window_plan import window_plan
    from prefixserve.attention.window import window_attention

    own = [3, 17, 30, 9, 24, 1]
    q, k, v, tables, seq_lens, meta = _tree_case(11, torch.float32, own)
    make_backend(backend_name).prepare(meta)
    ref = _oracle(q, k, v, tables, [1] * len(own), seq_lens, 0.3, window)
    plan = window_plan(meta, window)
    windows = sum(min(window, n) for n in seq_lens)
    if window >= 40:  # the second level's blocks (keys 64-96) lie inside several rows' windows
        assert plan is not None and plan.kv_tokens_read < windows
    if window <= 20:  # no whole block of a segment lies inside two of its holders' windows
        assert plan is None
    assert rel_err(window_attention(q, k, v, meta, 0.3, window), ref) < 1e-5
    if plan is not None and backend_name == "triton":
        assert rel_err(window_shared_attention(q, k, v, meta, plan, 0.3, window), ref) < 1e-5
        # a later layer of the step: the recorded launches again, with its own q, K and V
        q2, k2, v2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        ref2 = _oracle(q2, k2, v2, tables, [1] * len(own), seq_lens, 0.3, window)
        assert rel_err(window_shared_attention(q2, k2, v2, meta, plan, 0.3, window), ref2) < 1e-5


def test_decode_window_sharing_bf16() -> None:
    from prefixserve.attention.kernels.window_attention import window_shared_attention
    from prefixserve.attention.planning.window_plan import window_plan

    own = [40, 5, 33, 12, 2, 60]
    q, k, v, tables, seq_lens, meta = _tree_case(12, torch.bfloat16, own)
    make_backend("triton").prepare(meta)
    plan = window_plan(meta, 120)
    assert plan is not None
    ref = _oracle(q, k, v, tables, [1] * len(own), seq_lens, 0.3, 120)
    assert rel_err(window_shared_attention(q, k, v, meta, plan, 0.3, 120), ref) < 2e-2


@pytest.mark.parametrize("window", [40, 50, 64])
def test_a_long_prefix_is_cut_to_the_blocks_inside_every_window(window: int) -> None:
    """One 8-block prefix that every row holds, far longer than the window: its last blocks (from the
    latest window start on) are read once, the rest walked or skipped per row; exact either way."""
    from prefixserve.attention.kernels.window_attention import window_shared_attention
    from prefixserve.attention.planning.window_plan import window_plan
    from prefixserve.attention.window import window_attention

    own = [5, 9, 14, 20]
    query_lens = [1] * len(own)
    seq_lens = [128 + n for n in own]
    q, k, v, tables, meta = _case(4, query_lens, seq_lens, 8, 2, 32, 16, torch.float32)
    make_backend("triton").prepare(meta)
    plan = window_plan(meta, window)
    assert plan is not None and plan.num_segments == 1
    latest = max(seq_lens) - window
    assert plan.seg_num_tokens == [128 - math.ceil(latest / 16) * 16]
    assert plan.kv_tokens_read < sum(min(window, n) for n in seq_lens)
    ref = _oracle(q, k, v, tables, query_lens, seq_lens, 0.3, window)
    assert rel_err(window_attention(q, k, v, meta, 0.3, window), ref) < 1e-5
    assert rel_err(window_shared_attention(q, k, v, meta, plan, 0.3, window), ref) < 1e-5


def test_window_and_paged_kernels_compile_for_hopper() -> None:
    """The real compiler (sm_90, no GPU needed) takes the window kernel in both forms at Gemma's
    256-wide heads and the paged kernel, whose shared walk (``attend_range``) gained the window bound,
    with and without its decode merge (``merge_last``: "skip" marks the merged form here, which
    reads its block ids ahead of the walk), and the paged and packed decode kernels over e4m3 read
    their operands from shared memory as over bf16 (the paged one's tiles fetched into registers, not
    copied in by the pipeline)."""
    from _kernel_helpers import compiled_for_hopper

    results = compiled_for_hopper("_window_compile.py")
    assert [(r["kernel"], r["skip"]) for r in results] == [
        ("window", False),
        ("window", True),
        ("paged", False),
        ("paged", True),
        ("paged_e4m3", True),
        ("paged_e4m3", False),
        ("packed", False),
        ("packed_e4m3", False),
    ]
    assert all(r["ok"] for r in results)
    ldmatrix = {(r["kernel"], r["skip"]): r.get("ldmatrix") for r in results}
    copies = {(r["kernel"], r["skip"]): r.get("cp_async") for r in results}
    # e4m3 tiles widened once and staged as fp16 (attend.widened_kv), not staged as bytes and
    # rebuilt into operands by scalar shared loads (Triton's own cast: 4 ldmatrix against 28); where
    # fetched a tile ahead (attend.widened_words), not behind a join Triton reads as 8-bit loads
    # (ld.shared.v2: 8 ldmatrix)
    assert ldmatrix["paged_e4m3", True] == ldmatrix["paged", True] > 0
    assert ldmatrix["packed_e4m3", False] == ldmatrix["packed", False] > 0
    assert copies["paged_e4m3", True] == 0 < copies["packed_e4m3", False]  # packed: still pipelined
    assert copies["paged_e4m3", False] == 0 < ldmatrix["paged_e4m3", False]  # cut into walks


@pytest.mark.parametrize("case", CASES[:4])
def test_a_sliding_groups_window_columns_alone_give_the_same_attention(case) -> None:
    """The freeing KV layout's group tables hold only the columns the windows reach (row s from block
    base[s] on, zeros where no page is held any more): the kernel and the torch path read the same."""
    query_lens, seq_lens, shared, window = case
    q, k, v, tables, _ = _case(11, query_lens, seq_lens, shared, 2, 32, 16, torch.float32)
    scale = 32**-0.5
    ref = _oracle(q, k, v, tables, query_lens, seq_lens, scale, window)
    bs = 16
    first_keys = [max(0, s - q_len - window + 1) for q_len, s in zip(query_lens, seq_lens, strict=True)]
    base = np.array(first_keys) // bs
    width = max(len(t) - b for t, b in zip(tables, base, strict=True))
    pages = np.zeros((1, len(tables), width), dtype=np.int32)
    for s, (table, first) in enumerate(zip(tables, base, strict=True)):
        pages[0, s, : len(table) - first] = table[first:]
    full = build_metadata(bs, query_lens, seq_lens, tables, DEVICE)
    full.with_groups(pages, base, (1,))
    group = full.for_layer(0)
    assert group.table_base is not None and group.block_tables.shape[1] == width
    assert rel_err(window_attention_torch(q, k, v, group, scale, window), ref) < 1e-5
    assert rel_err(window_kernel(q, k, v, group, scale, window), ref) < 1e-5
    assert torch.equal(group.slot_mapping, full.slot_mapping)  # the same pages: the same write slots


@pytest.mark.parametrize("contiguous", [True, False])
def test_sliding_groups_share_one_recorded_plan_with_their_own_pages(contiguous: bool) -> None:
    """The freeing KV layout: three sliding groups hold copies of the window blocks on pages of their
    own (in runs like the block table's, or scattered: then each group plans alone). Their plans share
    one recorded launch set, each group replaying it with its tables, segment blocks and work items,
    and every group's attention equals the oracle over the block table's KV."""
    from prefixserve.attention.kernels.window_attention import window_shared_attention
    from prefixserve.attention.planning.window_plan import window_plan

    own, window, bs = [5, 9, 14, 20], 50, 16
    query_lens, seq_lens = [1] * len(own), [128 + n for n in own]
    q, k, v, tables, meta = _case(4, query_lens, seq_lens, 8, 2, 32, bs, torch.float32)
    make_backend("triton").prepare(meta)
    ref = _oracle(q, k, v, tables, query_lens, seq_lens, 0.3, window)
    base = np.array([max(0, s - window) // bs for s in seq_lens])
    width = max(len(t) - b for t, b in zip(tables, base, strict=True))
    groups, used = 3, k.shape[0]
    k = torch.cat([k, k.new_zeros(groups * used, *k.shape[1:])])
    v = torch.cat([v, v.new_zeros(groups * used, *v.shape[1:])])
    pages = np.zeros((groups, len(tables), width), dtype=np.int32)
    gen = torch.Generator().manual_seed(9)
    for g in range(groups):  # group g's copy of block b: page used*(g+1) + b, or a shuffled one
        order = torch.arange(used) if contiguous or g == 0 else torch.randperm(used, generator=gen)
        page = (used * (g + 1) + order).tolist()
        k[page], v[page] = k[:used].clone(), v[:used].clone()
        for s, (table, first) in enumerate(zip(tables, base, strict=True)):
            pages[g, s, : len(table) - first] = [page[b] for b in table[first:]]
    meta.with_groups(pages, base, tuple(range(groups + 1)))
    plans = [window_plan(meta.for_layer(g + 1), window) for g in range(groups)]
    assert all(p is not None and p.groups and p.derived is plans[0].derived for p in plans)
    # the first call records, the rest replay with their group's arrays: each group once, then the
    # first again (its own arrays back after the others')
    for call, g in enumerate([*range(groups), 0]):
        view = meta.for_layer(g + 1)
        got = window_shared_attention(q, k, v, view, plans[g], 0.3, window)
        assert rel_err(got, ref) < 1e-5, (g, call)
    (layout,) = plans[0].derived.values()  # one layout for the three groups
    assert layout.groups is not None and len(layout.groups) == groups
