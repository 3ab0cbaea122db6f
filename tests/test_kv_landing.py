"""Host-tier KV landing layer by layer behind the forward that reads it (issue 54, ``kv/landing.py``).

On a CPU copies are plain and done on issue, so the pipeline's order is checked with a copy stream
whose copies land only when the current stream waits for them (``LazyCopier``): a reader that does
not wait for a layer's copies sees the bytes that were there before, as it would race on a GPU.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.kv.landing import MIN_COPY_BYTES, block_runs, worth_layering
from prefixserve.promptcache.store import PromptModules
from prefixserve.worker.piecewise_graph import PiecewiseGraphs
from tests.test_kv_tiers import BLOCK, DTYPES, TINY, random_cache, random_packed
from tests.test_prompt_cache import PROMPTS, SCHEMA

LAYERS = TINY.num_hidden_layers


class _Copies:
    """A lazy copy's event: its copies are made when something waits for it."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], log: list) -> None:
        self.pairs, self.log, self.done = pairs, log, False

    def synchronize(self) -> None:
        if not self.done:
            for dst, src in self.pairs:
                dst.copy_(src)
            self.done = True


class LazyCopier:
    """A copy stream whose copies land only when the current stream waits on their event."""

    def __init__(self, log: list | None = None) -> None:
        self.log: list = [] if log is None else log

    def follow_current(self) -> None:
        self.log.append("follow")

    def copy_all(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> _Copies:
        pairs = list(pairs)
        self.log.append(("copy", len(pairs)))
        return _Copies(pairs, self.log)

    def wait(self, ready: _Copies | None) -> None:
        if ready is not None:
            self.log.append("wait")
            ready.synchronize()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


LAYOUTS = [
    ([6, 7, 8], 10),  # one run, the last block half filled
    ([2, 3, 7, 8, 9, 0], 22),  # three runs
    ([5], 1),
    ([9, 0, 4, 2], 13),  # every block its own run
]


def test_block_runs_and_when_layering_pays() -> None:
    assert block_runs([6, 7, 8], 10, 4) == [(0, 10, 24)]
    assert block_runs([2, 3, 7, 8, 9, 0], 22, 4) == [(0, 8, 8), (8, 20, 28), (20, 22, 0)]
    assert block_runs([], 0, 4) == []
    row = 2048  # one row of one layer's K: 8 heads x 128 x bf16
    assert worth_layering([(0, 10, 0)], 1, cuda=False)  # a CPU copies plainly: always
    assert not worth_layering([], row, cuda=False)
    assert worth_layering([(0, 512, 0)], row, cuda=True)  # a 512-token module in one run: 1 MiB copies
    many = [(i * 16, (i + 1) * 16, 100 * i) for i in range(32)]  # 32 scattered blocks: 32 KiB copies
    assert not worth_layering(many, row, cuda=True)
    assert worth_layering([(0, MIN_COPY_BYTES // row, 0)], row, cuda=True)
    assert worth_layering([(0, 3, 0)], row, cuda=True, joins=True)  # adds no copy: always
    assert not worth_layering([(0, 16, 0), (16, 19, 90)], row, cuda=True, joins=True)  # one 6 KiB copy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("blocks", "rows"), LAYOUTS)
def test_layered_scatter_writes_the_bytes_scatter_rows_writes(
    dtype: torch.dtype, blocks: list[int], rows: int
) -> None:
    """Bit for bit the same pool as the whole copy and scatter: the same rows into the same slots,
    nothing else touched (the tail of a partly filled block, other blocks, the scratch block)."""
    packed = random_packed(rows, dtype)
    whole, layered = random_cache(dtype), random_cache(dtype)
    before = layered.tensor.clone()
    whole.scatter_rows(blocks, packed)
    layered.scatter_rows_layered(blocks, packed)
    assert torch.equal(bits(layered.tensor), bits(before))  # queued: nothing written before the issue
    assert layered.landing.pending
    layered.issue_layered()
    assert not layered.landing.pending  # a CPU's copies are done on issue
    assert torch.equal(bits(layered.tensor), bits(whole.tensor))


def test_copies_go_layer_major_with_one_event_per_layer() -> None:
    """Every queued entry's copies of layer 0, then of layer 1, ...; one event per layer; each layer
    lands when the current stream waits for it, and not before."""
    cache = random_cache(torch.float32)
    cache.landing.copier = copier = LazyCopier()
    first, second = random_packed(7, torch.float32, seed=2), random_packed(10, torch.float32, seed=3)
    want = random_cache(torch.float32)
    want.scatter_rows([1, 2], first)
    want.scatter_rows([5, 6, 8], second)
    cache.scatter_rows_layered([1, 2], first)  # one run
    cache.scatter_rows_layered([5, 6, 8], second)  # two runs
    hook = cache.landing_hook()
    assert hook is not None
    # the copy stream follows the current stream once, then a copy batch per layer: K and V of each run
    assert copier.log == ["follow"] + [("copy", 2 * (1 + 2))] * LAYERS
    before = cache.tensor.clone()
    for layer in range(LAYERS):
        assert torch.equal(cache.tensor[layer:], before[layer:])  # this layer and later: not landed yet
        hook(layer)
        assert torch.equal(cache.tensor[: layer + 1], want.tensor[: layer + 1])
    assert copier.log.count("wait") == LAYERS
    assert not cache.landing.pending and cache.landing_hook() is None  # the next forward checks a None
    assert torch.equal(cache.tensor, want.tensor)


def test_work_outside_a_forward_settles_only_the_blocks_it_touches() -> None:
    cache = random_cache(torch.float32)
    cache.landing.copier = copier = LazyCopier()
    rows = random_packed(6, torch.float32)
    cache.scatter_rows_layered([3, 4], rows)
    untouched = cache.gather_rows([7, 8], 8)  # other blocks: nothing is issued or waited for
    assert copier.log == [] and cache.landing.pending
    assert torch.equal(untouched, random_cache(torch.float32).gather_rows([7, 8], 8))
    assert torch.equal(cache.gather_rows([3, 4], 6), rows)  # these blocks: everything lands first
    assert copier.log == ["follow"] + [("copy", 2)] * LAYERS + ["wait"] * LAYERS
    assert not cache.landing.pending
    cache.scatter_rows_layered([0, 1], random_packed(5, torch.float32, seed=4))
    cache.copy_blocks([(1, 9)])  # a block copy from a landing block waits for it too
    assert torch.equal(cache.tensor[:, :, 9, :1], random_packed(5, torch.float32, seed=4)[:, :, 4:5])


# --- copies of several entries joined: one per layer and K or V for entries adjacent on both sides ---


def test_joined_copies_land_the_rows_per_entry_copies_land() -> None:
    """Entries packed in one host allocation from block boundaries (as ``PromptModules._demote`` packs
    them), some of them queued, in order or not, into random block layouts: every entry's rows land
    bit for bit where per-entry copies put them, nothing outside their blocks is touched, and a copy
    joins the next entry exactly when that entry follows it both in the host allocation and in the
    pool (the joined copy writes the host's padding rows into the holes between them, which no table
    reads). ``mirror`` leaves in the pool the gaps the host has where entries are skipped (a copy
    across them would write blocks outside the landing); ``apart`` puts each entry in an allocation
    of its own, at the offsets it would have in a shared one."""
    rng = random.Random(0)
    for case in range(80):
        dtype = DTYPES[case % len(DTYPES)]
        n = rng.randint(1, 6)
        rows = [rng.randint(1, 3 * BLOCK) for _ in range(n)]
        counts = [-(-r // BLOCK) for r in rows]
        starts = [sum(counts[:i]) * BLOCK for i in range(n)]
        layout = rng.choice(["run", "gaps", "mirror", "scattered", "apart"])
        host = random_packed(sum(counts) * BLOCK, dtype, seed=case)
        views = [host[:, :, s : s + r] for s, r in zip(starts, rows, strict=True)]
        if layout == "apart":
            views = [
                random_packed(sum(counts) * BLOCK, dtype, seed=99)[:, :, s : s + r]
                for s, r in zip(starts, rows, strict=True)
            ]
        order = sorted(rng.sample(range(n), rng.randint(1, n))) if rng.random() < 0.5 else list(range(n))
        if rng.random() < 0.3:
            rng.shuffle(order)
        blocks, nxt = {}, rng.randrange(8)
        free = rng.sample(range(POOL_BLOCKS), POOL_BLOCKS)
        for i in order:
            if layout == "scattered":  # any distinct ids
                blocks[i], free = free[: counts[i]], free[counts[i] :]
                continue
            if layout == "mirror":  # where the host has them, from block 2 on
                nxt = 2 + starts[i] // BLOCK
            nxt += layout == "gaps" and rng.random() < 0.5  # a free block left before the entry
            blocks[i] = list(range(nxt, nxt + counts[i]))
            nxt += counts[i]
        per_entry, joined = pool_cache(dtype), pool_cache(dtype)
        before = joined.tensor.clone()
        want_copies, holes = 0, []
        for k, i in enumerate(order):
            per_entry.scatter_rows(blocks[i], views[i])
            joined.scatter_rows_layered(blocks[i], views[i])
            want_copies += len(block_runs(blocks[i], rows[i], BLOCK))
            prev = order[k - 1] if k else -2
            if layout != "apart" and i == prev + 1 and blocks[i][0] == blocks[prev][-1] + 1:
                want_copies -= 1  # i's first run continues prev's last, in host memory and in the pool
                holes.append(prev)
        joined.issue_layered()
        assert joined.landing.copies == 2 * LAYERS * want_copies, (case, layout)
        flat, want, old = (t.flatten(2, 3) for t in (joined.tensor, per_entry.tensor, before))
        for i in holes:  # the hole rows of prev's last block: the host's rows between the two entries
            last, used = blocks[i][-1] * BLOCK, rows[i] - (counts[i] - 1) * BLOCK
            pad = host[:, :, starts[i] + rows[i] : starts[i] + counts[i] * BLOCK]
            assert torch.equal(bits(flat[:, :, last + used : last + BLOCK]), bits(pad))
            flat[:, :, last + used : last + BLOCK] = old[:, :, last + used : last + BLOCK]
        assert torch.equal(bits(flat), bits(want)), (case, layout)


POOL_BLOCKS = 40


def pool_cache(dtype: torch.dtype) -> KVCache:
    cache = KVCache(TINY, POOL_BLOCKS, BLOCK, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(dtype))
    return cache


class ByteTokenizer:
    """A token per byte, no chat template: enough to lay out a PML schema."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def module_kv(ids: list[int], positions: list[int]) -> torch.Tensor:
    """Made-up KV of a piece, a function of its tokens and positions (exact in fp32)."""
    row = torch.tensor([t * 4096 + p for t, p in zip(ids, positions, strict=True)], dtype=torch.float32)
    lanes = torch.arange(LAYERS * 2 * TINY.num_key_value_heads * TINY.head_dim, dtype=torch.float32)
    return row[None, None, :, None, None] + lanes.view(LAYERS, 2, 1, TINY.num_key_value_heads, -1) / 8


def test_a_schema_restored_in_order_lands_in_one_copy_per_layer_and_k_or_v() -> None:
    """Ten modules of random lengths (holes in their last blocks) moved to host memory together and
    restored by a prompt in schema order into a fresh pool: one run of blocks, one host allocation,
    so 2 x layers copies (one per module was 10 x 2 x layers), and the very rows encoded. Modules
    not adjacent in the host allocation take a copy each."""
    rng = random.Random(1)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(9, 40))) for _ in range(10)]
    body = "".join(f'<module name="m{i}">{t}</module>' for i, t in enumerate(texts))
    pool = BlockPool(512, BLOCK)
    kv = KVCache(TINY, pool.num_blocks, BLOCK, torch.float32, torch.device("cpu"))

    def encode(ids: list[int], positions: list[int], blocks: list[int]) -> None:
        kv.scatter_rows(blocks, module_kv(ids, positions))

    modules = PromptModules(pool, kv, encode, ByteTokenizer(), "test", gpu_fraction=0.9, recompute_reserve=0)
    modules.register(f'<schema name="s">{body}</schema>')

    def pml(names: list[int], question: str) -> str:
        return '<prompt schema="s">' + "".join(f"<m{i}/>" for i in names) + f" {question}</prompt>"

    def restore(names: list[int]) -> int:
        """Copies per layer and K or V of a prompt over ``names``, restored after a ``move_out``."""
        modules.move_out()
        copies = kv.landing.copies
        mp = modules.prepare(pml(names, "Which?"), None)
        assert not kv.landing.pending  # a CPU's copies are done on issue
        assert mp.blocks == list(range(mp.blocks[0], mp.blocks[0] + len(mp.blocks)))  # one run
        start, reg = 0, modules.schemas["s"]
        for i, rows in zip(names, mp.piece_rows, strict=True):
            entry = modules.entries[modules.key_of(reg.pieces[f"m{i}"], None)]
            count = -(-rows // BLOCK)
            got = kv.gather_rows(mp.blocks[start : start + count], rows)
            assert torch.equal(got, module_kv(entry.token_ids, entry.positions))  # bit for bit
            start += count
        modules.release(mp.blocks)
        return (kv.landing.copies - copies) // (2 * LAYERS)

    modules.release(modules.prepare(pml(list(range(10)), "Hi"), None).blocks)
    assert modules.counters["module_encodes_total"] == 10
    assert restore(list(range(10))) == 1
    assert modules.counters["module_loads_host_total"] == 10
    assert restore([0, 2, 5]) == 3  # neighbours in the pool, not in host memory
    assert restore([0, 2, 5]) == 1  # moved out together after that prompt: neighbours now


# --- end to end: modules restored from the host tier, through the engine --------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("piecewise", "recompute"), [(False, "none"), (True, "none"), (False, "link:4")])
def test_host_tier_modules_land_layer_by_layer_in_the_prefill(
    tiny_config_path, piecewise: bool, recompute: str
) -> None:
    """Greedy outputs with modules restored from host memory equal those with the modules on the GPU,
    while each layer's copies land only when that layer waits for them, just before its attention:
    with the pool zeroed after the modules moved out, a layer that read early would read zeros."""
    llm = LLM(
        f"dummy:{tiny_config_path}",
        dtype="float32",
        device="cpu",
        progress=False,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,  # every block but the modules' is computed again
        module_recompute=recompute,
    )
    runner = llm.engine.runner
    if piecewise:
        runner.pieces = PiecewiseGraphs(runner.model, runner.kv, 64, capture=False)
    llm.register_schema(SCHEMA)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    modules = llm.engine.modules
    modules.move_out()  # every module to host memory
    assert modules.gpu_blocks == 0
    runner.kv.tensor.zero_()  # no module KV left on the device to be read by mistake
    log: list = []
    runner.kv.landing.copier = LazyCopier(log)
    attend = runner.backend.forward
    runner.backend.forward = lambda *a, **kw: log.append("attend") or attend(*a, **kw)
    loads = modules.counters["module_loads_host_total"]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert modules.counters["module_loads_host_total"] > loads
    assert runner.kv.landing.copies > 0 and not runner.kv.landing.pending
    layers = runner.kv.landing.layers
    assert log.count("wait") == layers * log.count("follow")  # every issued layer was waited for
    if recompute == "none":  # the first prefill: layer l waits for its copies, then attends
        assert layer_order(log[log.index("wait") :])[: 2 * layers] == ["wait", "attend"] * layers


def layer_order(log: list) -> list:
    """The log's waits and attentions, each run of waits (one per issue that copied the layer) as one."""
    out: list = []
    for item in log:
        if item in ("wait", "attend") and not (item == "wait" and out and out[-1] == "wait"):
            out.append(item)
    return out


# --- on a GPU: real streams and events (skipped without one) ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("blocks", "rows"), [(list(range(3, 9)), 22), ([2, 3, 7, 8, 9, 0], 22)])
def test_layered_scatter_on_cuda_lands_the_bytes_scatter_rows_writes(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, blocks: list[int], rows: int
) -> None:
    """Pinned rows copied on the copy stream a layer at a time, each layer waited for on the current
    stream: the same bytes as the whole copy and scatter (tiny rows: the size rule is lifted)."""
    monkeypatch.setattr("prefixserve.kv.landing.MIN_COPY_BYTES", 0)
    packed = random_packed(rows, dtype).pin_memory()
    whole, layered = random_cache(dtype, "cuda"), random_cache(dtype, "cuda")
    whole.scatter_rows(blocks, packed)
    layered.scatter_rows_layered(blocks, packed)
    hook = layered.landing_hook()
    assert hook is not None and layered.landing.copies == 2 * LAYERS * len(block_runs(blocks, rows, 4))
    for layer in range(LAYERS):
        hook(layer)
    assert not layered.landing.pending
    assert torch.equal(bits(layered.tensor), bits(whole.tensor))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_joined_copies_on_cuda_land_the_rows_per_entry_copies_land(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Three entries of one pinned allocation, each from a block boundary, into one run of blocks:
    one copy per layer and K or V on the copy stream, the rows bit for bit scatter_rows' rows."""
    monkeypatch.setattr("prefixserve.kv.landing.MIN_COPY_BYTES", 0)
    rows, counts = [5, 8, 3], [2, 2, 1]
    host = random_packed(sum(counts) * BLOCK, dtype).pin_memory()
    starts = [0, 2 * BLOCK, 4 * BLOCK]
    views = [host[:, :, s : s + r] for s, r in zip(starts, rows, strict=True)]
    blocks = [[3, 4], [5, 6], [7]]
    whole, layered = random_cache(dtype, "cuda"), random_cache(dtype, "cuda")
    for b, v in zip(blocks, views, strict=True):
        whole.scatter_rows(b, v)
        layered.scatter_rows_layered(b, v)
    hook = layered.landing_hook()
    assert hook is not None and layered.landing.copies == 2 * LAYERS
    for layer in range(LAYERS):
        hook(layer)
    for b, r in zip(blocks, rows, strict=True):
        assert torch.equal(bits(layered.gather_rows(b, r)), bits(whole.gather_rows(b, r)))


@pytest.mark.gpu
def test_host_tier_modules_land_layer_by_layer_on_cuda(
    monkeypatch: pytest.MonkeyPatch, tiny_config_path
) -> None:
    """Greedy outputs with modules restored from pinned host memory, landing layer by layer on the copy
    stream under the prefill (eager and piecewise-graphed), equal those with the modules on the GPU.
    In fp32: in bf16 the restored run's steps differ in shape from the first run's (no module is
    encoded), and on an H100 the greedy tokens then parted at the third token with the whole copy as
    with the layered one."""
    monkeypatch.setattr("prefixserve.kv.landing.MIN_COPY_BYTES", 0)
    llm = LLM(
        f"dummy:{tiny_config_path}",
        device="cuda",
        dtype="float32",
        progress=False,
        num_kv_blocks=256,
        enable_prefix_caching=False,  # every block but the modules' is computed again
    )
    llm.register_schema(SCHEMA)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    kv = llm.engine.runner.kv
    for _ in range(2):  # the second round replays the piecewise graphs captured in the first
        llm.engine.modules.move_out()
        kv.tensor.zero_()  # no module KV left on the device to be read by mistake
        copies = kv.landing.copies
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert kv.landing.copies > copies and not kv.landing.pending
