"""The own kernel with the merge folded in (``own_merge``) against attention over all of a row's KV.

Each decode row's KV is some shared chunks (their partials computed by the reference, as the shared
kernel would write them, in shuffled slots named by a CSR) and its own paged tokens; the kernel's
output must equal one softmax over all of them, in fp64, for random shapes: GQA 1-8, d 64/128,
blocks 16/32, one to four rows a program, rows without shared parts, without own tokens, and with
neither (a padding row).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _kernel_helpers import DEVICE, paged_cache, rel_err

from prefixserve.attention.kernels.merge import csr_by_row
from prefixserve.attention.kernels.own_merge import launch_own_merge
from prefixserve.attention.reference import attention_with_lse, gather_kv

KV_HEADS = 2


def _case(own_lens, chunk_lens, group, dim, block_size, dtype, seed=0, pack=1):
    """(output, fp64 reference): ``chunk_lens[t]`` are row t's shared chunks (0 = an empty part)."""
    gen = torch.Generator().manual_seed(seed)
    rows, heads = len(own_lens), KV_HEADS * group
    k, v, tables = paged_cache([max(n, 1) for n in own_lens], block_size, KV_HEADS, dim, dtype, gen)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    q = torch.randn(rows, heads, dim, generator=gen).to(DEVICE, dtype)
    scale = 1 / math.sqrt(dim)
    o_parts, lse_parts, part_rows, refs = [], [], [], []
    for t in range(rows):
        ks, vs = [], []
        for n in chunk_lens[t]:
            kc = torch.randn(n, KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
            vc = torch.randn(n, KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
            if n:
                o, lse = attention_with_lse(q[t : t + 1], kc, vc, scale, None, torch.float64)
            else:  # a part that saw no key
                o, lse = torch.zeros(1, heads, dim), torch.full((1, heads), -math.inf)
            o_parts.append(o.float())
            lse_parts.append(lse.float())
            part_rows.append(t)
            ks.append(kc)
            vs.append(vc)
        ks.append(gather_kv(k, tables[t], own_lens[t]))
        vs.append(gather_kv(v, tables[t], own_lens[t]))
        kk, vv = torch.cat(ks), torch.cat(vs)
        if kk.shape[0]:
            refs.append(attention_with_lse(q[t : t + 1], kk, vv, scale, None, torch.float64)[0])
        else:
            refs.append(torch.zeros(1, heads, dim, dtype=torch.float64, device=DEVICE))
    order = torch.randperm(len(part_rows), generator=gen).numpy()  # slots in any order
    spare = 2  # slots no row names
    o_part = torch.randn(len(part_rows) + spare, heads, dim).to(DEVICE)
    lse_part = torch.randn(len(part_rows) + spare, heads).to(DEVICE)
    for slot, i in enumerate(order):
        o_part[slot] = o_parts[i][0].to(DEVICE)
        lse_part[slot] = lse_parts[i][0].to(DEVICE)
    slot_rows = np.asarray(part_rows, dtype=np.int64)[order]
    row_ptr, idx = csr_by_row(slot_rows, rows)
    row_ptr = torch.tensor(row_ptr, dtype=torch.int32, device=DEVICE)
    part_idx = torch.tensor(idx, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(own_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, math.nan)  # poison: an unwritten row fails
    args = (q, k, v, bt, lens, o_part, lse_part, row_ptr, part_idx, scale, out)
    launch = launch_own_merge(*args, pack=pack)
    assert launch is not None
    return out, torch.cat(refs)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("pack", [1, 2, 4])
def test_seeded_own_part_equals_whole_attention(group: int, dim: int, block_size: int, pack: int) -> None:
    own = [5, 0, 70, 33, 0]
    chunks = [[40, 17], [64], [], [9, 0, 30], []]  # row 4 is a padding row: no part, no own token
    out, ref = _case(own, chunks, group, dim, block_size, torch.float32, pack=pack)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out[4].cpu(), torch.zeros_like(out[4].cpu()))


@pytest.mark.parametrize(("group", "pack"), [(8, 1), (4, 4)])
def test_bf16_error_is_bf16_rounding(group: int, pack: int) -> None:
    out, ref = _case([128, 3, 50], [[256, 100], [31], [0]], group, 128, 16, torch.bfloat16, 3, pack)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("seed", range(4))
def test_random_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 9))
    own = [int(x) for x in rng.integers(0, 90, rows)]
    chunks = [[int(x) for x in rng.integers(0, 60, rng.integers(0, 4))] for _ in range(rows)]
    group = int(rng.choice([1, 2, 4, 8]))
    pack = int(rng.choice([1, 2, 4]))
    out, ref = _case(own, chunks, group, 64, 16, torch.float32, seed=seed, pack=pack)
    assert rel_err(out, ref) < 1e-5


def test_launcher_rejects_bad_inputs() -> None:
    q = torch.zeros(2, 4, 64, device=DEVICE)
    k = torch.zeros(4, 16, 2, 64, device=DEVICE)
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    parts = (torch.zeros(1, 4, 64, device=DEVICE), torch.zeros(1, 4, device=DEVICE))
    row_ptr = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    idx = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="own_lens"):
        launch_own_merge(q, k, k, bt, lens.long(), *parts, row_ptr, idx, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="decode rows"):
        launch_own_merge(q, k, k, bt, lens, *parts, row_ptr[:2], idx, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="out"):
        launch_own_merge(q, k, k, bt, lens, *parts, row_ptr, idx, 1.0, torch.empty(2, 4, 32, device=DEVICE))
