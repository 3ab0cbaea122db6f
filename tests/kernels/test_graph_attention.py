"""Graph-safe attention (fixed-capacity buffers, fixed grids) vs the reference, over changing steps.

A captured graph replays the same launches on later steps with new buffer contents, so these tests
build one graph attention per key and reuse it across steps whose structure changes (sequences grow
past block boundaries, lengths are ragged, padding rows fill the bucket), poisoning the partial
buffers in between: every value a step reads must come from that step's ``load``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from _kernel_helpers import DEVICE, padded_table, rel_err

from prefixserve.attention.auto import AutoBackend
from prefixserve.attention.graph import GraphAttention, HeadShape, capacity
from prefixserve.attention.kernels import paged_attention
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.reference import ReferenceBackend
from prefixserve.attention.triton_backend import TritonBackend, TritonPagedBackend
from prefixserve.worker.cuda_graph import batch_buckets


class _Steps:
    """Decode steps of B sequences: ``shared`` of them hold a common prefix, then own blocks."""

    def __init__(
        self, seed: int, bs: int, batch: int, shared: int, prefix_blocks: int, kv_heads: int, dim: int
    ):
        self.gen = torch.Generator().manual_seed(seed)
        self.bs = bs
        num_blocks = prefix_blocks + batch * 6 + 4
        self.k = torch.randn(num_blocks, bs, kv_heads, dim, generator=self.gen).to(DEVICE)
        self.v = torch.randn(num_blocks, bs, kv_heads, dim, generator=self.gen).to(DEVICE)
        perm = torch.randperm(num_blocks, generator=self.gen).tolist()
        prefix, rest = perm[:prefix_blocks], perm[prefix_blocks:]
        self.tables = []
        self.lens = []
        for i in range(batch):
            own = rest[i * 6 : (i + 1) * 6]
            head = prefix if i < shared else []
            self.tables.append(head + own)
            self.lens.append(len(head) * bs + 1 + int(torch.randint(0, 2 * bs, (1,), generator=self.gen)))

    def meta(self):
        tables = [t[: math.ceil(n / self.bs)] for t, n in zip(self.tables, self.lens, strict=True)]
        return build_metadata(self.bs, [1] * len(self.lens), self.lens, tables, "cpu")

    def advance(self) -> None:
        self.lens = [n + 1 + i % 3 for i, n in enumerate(self.lens)]  # ragged growth across blocks


def _run(attn: GraphAttention, q: torch.Tensor, bucket: int, steps: _Steps, scale: float) -> torch.Tensor:
    pad = torch.randn(bucket - q.shape[0], *q.shape[1:], generator=steps.gen).to(DEVICE)
    return attn.forward(torch.cat([q, pad]), steps.k, steps.v, None, scale)[: q.shape[0]]


def _fitted_error(fitted, steps: _Steps, bucket: int) -> float:
    """The relative error of a refitted step's graph attention (8 query heads) against the reference."""
    attn = fitted.build()
    attn.load(fitted.arrays)
    q = torch.randn(len(steps.lens), 8, steps.k.shape[-1], generator=steps.gen).to(DEVICE)
    ref = ReferenceBackend().forward(q, steps.k, steps.v, steps.meta(), 0.1)
    return rel_err(_run(attn, q, bucket, steps, 0.1), ref)


@pytest.mark.parametrize(
    ("backend", "group", "dim", "batch", "bucket", "shared"),
    [
        (TritonBackend, 4, 64, 5, 6, 4),  # a prefix held by 4 of 5, a loner, one padding row
        (TritonBackend, 8, 128, 3, 4, 3),  # every row shares; GQA 8, d=128
        (TritonBackend, 1, 64, 4, 4, 2),  # MHA, no padding
        (TritonPagedBackend, 4, 64, 5, 8, 4),  # no sharing path; three padding rows
    ],
)
def test_graph_steps_match_reference_across_changing_steps(
    backend, group, dim, batch, bucket, shared
) -> None:
    kv_heads, bs, scale = 2, 16, 0.1
    steps = _Steps(0, bs, batch, shared, 3, kv_heads, dim)
    shape = HeadShape(kv_heads * group, kv_heads, dim, torch.float32, DEVICE)
    be = backend()
    graphs: dict[tuple, GraphAttention] = {}
    reused = 0
    for _ in range(4):
        meta = steps.meta()
        step = be.graph_step(meta, shape, bucket)
        assert step.key[1] == bucket
        if backend is TritonBackend:
            assert step.key[0] == "shared" and meta.stats["kv_tokens_read"] < meta.stats["kv_tokens_logical"]
        if step.key in graphs:
            reused += 1
        attn = graphs.setdefault(step.key, step.build())
        for buf in ("o_part", "lse_part", "lse"):  # stale partials must never be read
            if getattr(attn, buf, None) is not None:
                getattr(attn, buf).fill_(math.nan)
        attn.load(step.arrays)
        q = torch.randn(batch, kv_heads * group, dim, generator=steps.gen).to(DEVICE)
        out = _run(attn, q, bucket, steps, scale)
        ref = ReferenceBackend().forward(q, steps.k, steps.v, meta, scale)
        assert rel_err(out, ref) < 1e-5
        steps.advance()
    assert reused >= 2  # the same graph served later steps with new contents


def test_paged_kernel_splits_each_sequence_by_its_own_length() -> None:
    """``split_size=0``: the grid's splits cut each sequence's KV evenly; ragged lengths, one empty row."""
    gen = torch.Generator().manual_seed(3)
    bs, kv_heads, group, dim, splits = 16, 2, 4, 64, 3
    lens = [300, 17, 0, 129]
    blocks = sum(math.ceil(n / bs) for n in lens) + 2
    k = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(DEVICE)
    v = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(DEVICE)
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at : at + max(1, math.ceil(n / bs))])
        at += max(1, math.ceil(n / bs))
    bt = padded_table(tables)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen).to(DEVICE)
    t, h = q.shape[:2]
    o_part = torch.full((splits * t, h, dim), math.nan, device=DEVICE)
    lse_part = torch.full((splits * t, h), math.nan, device=DEVICE)
    paged_attention.launch_paged(
        q, k, v, bt, seq_lens, qsl, 0.1, 1, splits, 0, o_part, lse_part, t * h * dim, t * h
    )
    from prefixserve.attention.kernels.merge import merge_partials

    out, lse = merge_partials(o_part, lse_part, t, num_parts=splits, part_stride=t)
    live = [0, 1, 3]  # row 2 has no KV: zeros and lse = -inf
    ref_meta = build_metadata(bs, [1] * 3, [lens[i] for i in live], [tables[i] for i in live], DEVICE)
    ref = ReferenceBackend().forward(q[live], k, v, ref_meta, 0.1)
    assert rel_err(out[live], ref) < 1e-5
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))


def test_capacities_and_buckets() -> None:
    assert [capacity(n, 4) for n in (0, 1, 4, 5, 17)] == [4, 4, 4, 8, 32]
    buckets = batch_buckets(256)
    assert buckets[:6] == [1, 2, 3, 4, 6, 8] and buckets[-1] == 256
    assert all(b / a <= 1.5 for a, b in itertools.pairwise(buckets[2:]))
    assert batch_buckets(100)[-1] == 100


def test_graph_buffers_clear_work_list_tails() -> None:
    """A smaller step after a larger one must not leave old work items behind (they would run)."""

    class Probe(GraphAttention):
        def forward(self, *args):  # pragma: no cover - never called
            raise AssertionError

    probe = Probe({"items": ((4, 2), True), "rows": ((3,), False)}, torch.device("cpu"))
    probe.load({"items": np.ones((3, 2), np.int32), "rows": np.array([7, 8, 9], np.int32)})
    probe.load({"items": np.full((1, 2), 5, np.int32), "rows": np.array([1], np.int32)})
    assert probe.buffer("items").tolist() == [[5, 5], [0, 0], [0, 0], [0, 0]]
    assert probe.buffer("rows").tolist()[0] == 1  # the rest is stale, bounded by lengths in the kernels
    # the host mirrors are used in turn: a step's arrays never overwrite a mirror whose copy may be pending
    first, second = probe.staging.next(), probe.staging.next()
    assert first.data_ptr() != second.data_ptr() and probe.staging.next().data_ptr() == first.data_ptr()
    assert probe.spans["rows"][0] % 4 == 0


def test_auto_has_no_graph_path_on_cpu() -> None:
    steps = _Steps(1, 16, 2, 2, 2, 2, 64)
    shape = HeadShape(8, 2, 64, torch.float32, torch.device("cpu"))
    assert AutoBackend().graph_step(steps.meta(), shape, 2) is None


def test_a_smaller_step_refits_into_a_captured_keys_capacities() -> None:
    """Fewer holders later (requests finished): the step can be planned into the bigger key."""
    kv_heads, dim = 2, 64
    shape = HeadShape(8, kv_heads, dim, torch.float32, DEVICE)
    big = _Steps(4, 16, 20, 20, 3, kv_heads, dim)
    key = TritonBackend().graph_step(big.meta(), shape, 32).key
    small = _Steps(5, 16, 5, 5, 2, kv_heads, dim)  # 5 rows: the same 64-row tiles, less of everything
    step = TritonBackend().graph_step(small.meta(), shape, 32)
    assert step.key != key and step.key[:5] == key[:5]
    fitted = step.refit(key)
    assert fitted.key == key
    assert _fitted_error(fitted, small, 32) < 1e-5
    paged = TritonPagedBackend().graph_step(small.meta(), shape, 32)
    wide = ("paged", 32, paged.key[2] * 2, *paged.key[3:])
    assert paged.refit(wide).key == wide


def test_shrinking_batches_keep_their_bucket_for_a_while() -> None:
    from prefixserve.worker.cuda_graph import HOLD_STEPS, DecodeGraphs

    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._fits, graphs._fits_over = {}, 0
    graphs.buckets, graphs._current, graphs._held = batch_buckets(1024), None, 0

    def step(batch: int) -> int | None:  # what a decode step does: choose (maybe twice), then run
        bucket = graphs.bucket_for(batch)
        assert graphs.bucket_for(batch) == bucket  # asking again changes nothing
        if bucket is not None:
            graphs._ran(batch, bucket)
        return bucket

    assert step(1024) == 1024
    assert step(700) == 1024 and step(300) == 1024  # within 4x: held
    assert step(200) == 256  # over 4x: its own bucket
    for _ in range(HOLD_STEPS):
        assert step(100) == 256
    assert step(100) == 128  # a batch that stays small gets its own graph
    assert step(2000) is None


def test_ceilings_fix_a_buckets_capacities_whatever_the_structure() -> None:
    """With the engine's ceilings, every step of a bucket plans into the same capacities: its keys
    differ only in split counts and tiles, however many sequences share and however long they grow."""
    from prefixserve.attention.graph import Ceilings, Scratch

    kv_heads, dim, bucket = 2, 64, 16
    shape = HeadShape(8, kv_heads, dim, torch.float32, DEVICE, None, Ceilings(64, 400), Scratch())
    keys = set()
    for seed, (batch, shared, prefix) in enumerate(
        [(16, 16, 3), (12, 5, 1), (9, 9, 6), (16, 2, 2), (11, 8, 4), (14, 14, 5)]
    ):
        steps = _Steps(seed, 16, batch, shared, prefix, kv_heads, dim)
        for _ in range(3):
            keys.add(TritonBackend().graph_step(steps.meta(), shape, bucket).key)
            steps.advance()
    # two kernels (the CPU's path): the work list follows the step (a program per item), the rest fixed
    capacities = {(k[0], k[2], *k[6:]) for k in keys}
    assert len(capacities) == 1, capacities
    ((kind, width, *caps),) = capacities
    assert kind == "shared" and width == 64 and tuple(caps[:4]) == Ceilings(64, 400).shared(bucket)[1:]
    assert all(k[5] < Ceilings(64, 400).shared(bucket)[0] for k in keys)
    plain = {
        TritonPagedBackend().graph_step(_Steps(s, 16, 9, 0, 0, kv_heads, dim).meta(), shape, bucket).key
        for s in range(3)
    }
    assert {k[2] for k in plain} == {64}


def test_mixed_keys_take_the_item_ceiling_and_carry_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed launch walks only the items a step uses (their count loaded on the device), so its key
    takes the bucket's ceiling of work items whatever the structure; every step's arrays carry the
    count of its items, padding excluded."""
    from prefixserve.attention import graph_attention
    from prefixserve.attention.graph import Ceilings, Scratch
    from prefixserve.attention.planning.mixed_rule import MixedTiles

    plan_work = graph_attention.plan_step_work

    def mixed_plan(*args, **kw):
        work, _ = plan_work(*args, **kw)
        return work, MixedTiles(64, 64)

    kv_heads, dim, bucket = 2, 64, 16
    shape = HeadShape(8, kv_heads, dim, torch.float32, DEVICE, None, Ceilings(64, 400), Scratch())
    ceiling = Ceilings(64, 400).shared(bucket)
    for mixed in (False, True):
        if mixed:
            monkeypatch.setattr(graph_attention, "plan_step_work", mixed_plan)
        for seed, (batch, shared, prefix) in enumerate([(16, 16, 3), (12, 5, 1), (9, 9, 6)]):
            step = TritonBackend().graph_step(
                _Steps(seed, 16, batch, shared, prefix, kv_heads, dim).meta(), shape, bucket
            )
            items = step.arrays["items"]
            assert step.arrays["count"].tolist() == [items.shape[0]] and items.shape[0] < ceiling[0]
            assert (step.key[4][5] is not None) == mixed
            assert (step.key[5] == ceiling[0]) == mixed  # two kernels: the list follows the step


def test_a_step_refits_into_a_key_of_other_own_splits_and_pack() -> None:
    """A captured shared key of the same tiles serves a step whose own part chose another split
    count or pack: the step is planned into the key's (its merge CSR with them), and the replay
    matches the reference."""
    kv_heads, dim, bucket = 2, 64, 8
    shape = HeadShape(8, kv_heads, dim, torch.float32, DEVICE)
    steps = _Steps(7, 16, 6, 6, 2, kv_heads, dim)
    step = TritonBackend().graph_step(steps.meta(), shape, bucket)
    key = step.key
    other_tiles = (*key[4][:4], 2 if key[4][4] == 1 else 1, *key[4][5:])
    other = (*key[:3], key[3] * 4, other_tiles, *(2 * c for c in key[5:]))
    fitted = step.refit(other)
    assert fitted.key == other
    assert _fitted_error(fitted, steps, bucket) < 1e-5
    block_m = key[4][0]  # other work tiles: the work list was cut for them, no refit
    taller = (*key[:4], (block_m * 2, *key[4][1:]), *key[5:])
    assert step.refit(taller).key != taller


def test_after_the_seal_a_key_no_graph_serves_runs_eagerly() -> None:
    """``DecodeGraphs.fit``: a captured key replays; before the seal a step of another split count is
    captured (a refit keeps the split count: every count the start-up plan meets gets its graph);
    after it, a step runs in a graph of another count (the nearest, at least half its own), else
    eagerly, counted, logged once, and a held bucket let go."""
    from prefixserve.attention.graph import GraphStep
    from prefixserve.worker.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._fits, graphs._fits_over = {}, 0
    graphs.graphs, graphs.sealed, graphs.misses, graphs.missed = {}, False, 0, set()
    graphs._current, graphs._held = 6, 3
    captured = ("paged", 4, 64, 2, 1)
    graphs.graphs[captured] = object()

    def step(key):  # a paged step: any floor of its kind, bucket and width takes the floor's splits
        return GraphStep(key, {}, lambda: None, refit=lambda f: step(f if f[:3] == key[:3] else key))

    assert graphs.fit(step(captured)).key == captured
    assert graphs.fit(step(("paged", 4, 64, 3, 1))).key == ("paged", 4, 64, 3, 1)  # captured by run()
    assert graphs.serves(step(captured)) and not graphs.serves(step(("paged", 4, 64, 3, 1)))
    new = step(("paged", 8, 64, 1, 1))
    assert graphs.fit(new) is new
    graphs.seal()
    assert graphs.fit(step(("paged", 4, 64, 3, 1))).key == captured  # 2 splits: at least half of 3
    assert graphs.fit(new) is None and graphs.fit(step(("paged", 4, 64, 8, 1))) is None  # 2 < 8 / 2
    assert graphs.fit(new) is None
    assert graphs.misses == 3 and graphs.missed == {new.key, ("paged", 4, 64, 8, 1)}
    assert graphs._current is None  # the held bucket let go
    assert graphs.fit(step(captured)).key == captured
    # a step over contiguous blocks (TMA tiles) whose pointer-load twin the plan captured
    twin = ("shared", 4, 64, 1, (64, 64, 2, False, 1, None, 1), 16)
    graphs.graphs[twin] = object()
    contiguous = GraphStep(("shared", 4, 64, 1, (64, 64, 3, True, 1, None, 1), 16), {}, lambda: None)
    contiguous.plain = lambda: step(twin)
    assert graphs.fit(contiguous).key == twin and graphs.misses == 3


def test_a_two_kernel_step_past_a_captured_work_list_takes_the_ceiling_variant() -> None:
    """Two-kernel keys' work lists follow their steps, so the start-up plan also captures each with
    the bucket's ceiling of items (``warmup.capture_split_variants``): after the seal a step with more
    items than the warm-up's runs in that variant (and matches the reference), while a step that fits
    the shorter list keeps it (``_refit`` orders by table width, then items)."""
    from prefixserve.attention.graph import Ceilings, Scratch
    from prefixserve.worker.cuda_graph import DecodeGraphs

    kv_heads, dim, bucket = 2, 64, 64
    shape = HeadShape(8, kv_heads, dim, torch.float32, DEVICE, None, Ceilings(64, 400), Scratch())

    def paired(seed: int, pairs: int) -> _Steps:
        """Rows whose first ``2 pairs`` share 2 blocks by pairs: ``pairs`` segments, 16-row tiles."""
        steps = _Steps(seed, 16, bucket, 0, 0, kv_heads, dim)
        spare = steps.k.shape[0]
        grow = torch.randn(2 * pairs, *steps.k.shape[1:], generator=steps.gen).to(DEVICE)
        steps.k, steps.v = torch.cat([steps.k, grow]), torch.cat([steps.v, grow.flip(-1)])
        for i in range(2 * pairs):
            steps.tables[i] = [spare + i // 2 * 2, spare + i // 2 * 2 + 1, *steps.tables[i]]
            steps.lens[i] += 32
        return steps

    small, large = paired(0, 4), paired(1, bucket // 2)
    tight = TritonBackend().graph_step(small.meta(), shape, bucket).key
    step = TritonBackend().graph_step(large.meta(), shape, bucket)
    assert tight[4][5] is None and step.key[5] > tight[5]  # two kernels; the large one needs more items
    ceiling = (*tight[:5], shape.ceilings.shared(bucket)[0], *tight[6:])
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._fits, graphs._fits_over = {}, 0
    graphs.graphs, graphs.sealed, graphs.misses, graphs.missed = {}, False, 0, set()
    graphs._current, graphs._held = None, 0
    graphs.graphs[tight] = graphs.graphs[ceiling] = object()
    graphs.seal()
    fitted = graphs.fit(step)
    assert fitted is not None and fitted.key[:6] == ceiling[:6] and graphs.misses == 0
    assert _fitted_error(fitted, large, bucket) < 1e-5
    assert graphs.fit(TritonBackend().graph_step(small.meta(), shape, bucket)).key == tight


def test_a_refit_choice_is_kept_until_the_captured_keys_change() -> None:
    """``_refit`` searches the captured keys once a step key (a search replans the step per candidate)
    and tries its choice first after that, choosing afresh once a graph is added."""
    from prefixserve.attention.graph import GraphStep
    from prefixserve.worker.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._fits, graphs._fits_over = {}, 0
    graphs.graphs = dict.fromkeys([("paged", 4, 64, 2, 1), ("paged", 4, 128, 2, 1), ("paged", 8, 64, 2, 1)])
    tried = []

    def step(key):  # a paged step: any key of its kind and bucket at least as wide holds it
        def refit(f):
            tried.append(f)
            return step(f if f[:2] == key[:2] and f[2] >= key[2] else key)

        return GraphStep(key, {}, lambda: None, refit=refit)

    assert graphs._refit(step(("paged", 4, 100, 2, 1)))[0].key == ("paged", 4, 128, 2, 1)
    assert tried == [("paged", 4, 64, 2, 1), ("paged", 4, 128, 2, 1)]  # the narrowest first
    tried.clear()
    assert graphs._refit(step(("paged", 4, 100, 2, 1)))[0].key == ("paged", 4, 128, 2, 1)
    assert tried == [("paged", 4, 128, 2, 1)]  # the choice, tried first
    assert graphs._refit(step(("paged", 4, 32, 2, 1)))[0].key == ("paged", 4, 64, 2, 1)
    graphs.graphs[("paged", 4, 96, 2, 1)] = None  # a narrower one that holds 32 columns is no better...
    graphs.graphs[("paged", 4, 33, 2, 1)] = None  # ...but this one is: chosen once the keys changed
    assert graphs._refit(step(("paged", 4, 32, 2, 1)))[0].key == ("paged", 4, 33, 2, 1)


def test_an_e4m3_graph_key_takes_the_walk_form_of_its_steps_rows_not_of_its_tables() -> None:
    """A decode graph's block tables are its bucket's (``Ceilings``: 1,024 columns at 256 rows, 16K
    tokens), so a launch sizing its e4m3 walk by them cut short walks into 4 (``e4m3_walks``): the own
    parts behind a shared prefix and short plain decodes ran 1.1-2x slower (H200). The key now holds
    the form its step's longest row asks for (``walks_for``); a refit before the seal keeps it, after
    the seal any form serves; bf16 caches keep one form."""
    from prefixserve.attention.graph import Ceilings, GraphStep
    from prefixserve.attention.graph_attention import paged_graph_step, walks_for
    from prefixserve.attention.planning.e4m3_walks import E4M3_WALK_MIN_RUN
    from prefixserve.worker.cuda_graph import DecodeGraphs

    bucket, bs = 256, 16
    e4m3 = HeadShape(32, 8, 128, torch.bfloat16, DEVICE, torch.float8_e4m3fn, Ceilings(8192, 10**6))
    bf16 = HeadShape(32, 8, 128, torch.bfloat16, DEVICE, None, Ceilings(8192, 10**6))

    def key(shape: HeadShape, longest: int) -> tuple:
        lens = [longest] + [1] * (bucket - 1)
        tables = np.zeros((bucket, -(-longest // bs)), dtype=np.int32)
        return paged_graph_step(build_metadata(bs, [1] * bucket, lens, tables, "cpu"), shape, bucket).key

    short, long = key(e4m3, 128), key(e4m3, 4 * E4M3_WALK_MIN_RUN)
    assert short[2] == long[2] == e4m3.ceilings.width(bucket, 64)  # the same tables, the bucket's
    assert short[3] == long[3] == 1 and short[4] == 1 and long[4] > 1  # one walk; cut walks
    assert short[4] == walks_for(128, 1, bucket, e4m3, short[2], bs)
    assert key(bf16, 128)[4] == key(bf16, 4 * E4M3_WALK_MIN_RUN)[4] == 1
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._fits, graphs._fits_over = {}, 0
    graphs.graphs, graphs.sealed, graphs.misses, graphs.missed = {long: object()}, False, 0, set()
    graphs._current, graphs._held = None, 0

    def step(k):  # any floor of its kind, bucket and width serves (as paged_graph_step's refit)
        return GraphStep(k, {}, lambda: None, refit=lambda f: step(f if f[:3] == k[:3] else k))

    assert graphs.fit(step(short)).key == short  # before the seal: captured in its own form
    graphs.seal()
    assert graphs.fit(step(short)).key == long and graphs.misses == 0  # after: the captured one serves
