"""Start-up decode batches (``engine/warmup.py``): every bucket runs, plain and behind a shared prefix,
and the engine is left as it was (no request, no block held, metrics unchanged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixserve import LLM
from prefixserve.engine import warmup


class _FakeGraphs:
    """What the warm-up reads of ``DecodeGraphs`` (a CPU has none): its buckets and capture count."""

    def __init__(self, buckets: list[int]) -> None:
        self.buckets, self.captures, self.resets = buckets, 0, 0

    def reset_hold(self) -> None:
        self.resets += 1

    def hold(self, bucket: int) -> None:
        pass


def test_every_bucket_decodes_plain_and_shared_and_nothing_is_left(
    tiny_config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        dtype="float32",
        num_kv_blocks=512,
        max_num_seqs=8,
        system_prompts={"app": "You are a careful assistant. " * 12},
        progress=False,
    )
    engine = llm.engine
    fake = _FakeGraphs([1, 2, 3, 4, 6, 8])
    monkeypatch.setattr(type(engine), "graphs", property(lambda self: fake))
    before = llm.metrics()
    pinned = engine.system_prompt_kv["app"].token_ids
    decode_batches: list[tuple[int, bool]] = []
    step = engine.step

    def watched() -> list:
        running = list(engine.scheduler.running)
        out = step()
        if running and all(s.num_tokens > len(s.request.prompt_token_ids) for s in running):
            shared = all(list(s.request.prompt_token_ids[: len(pinned)]) == list(pinned) for s in running)
            decode_batches.append((len(running), shared))
        return out

    monkeypatch.setattr(engine, "step", watched)
    assert warmup.warm_decode_graphs(engine, progress=False) == 0
    for bucket in fake.buckets:
        assert (bucket, False) in decode_batches, (bucket, decode_batches)
        assert (bucket, True) in decode_batches, (bucket, decode_batches)
    assert fake.resets == 1
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    after = llm.metrics()
    for key in ("requests_total", "generation_tokens_total", "prompt_tokens_total", "steps_total"):
        assert after[key] == before[key], key
    assert after["kv_blocks_used"] == before["kv_blocks_used"]  # the pinned prompt's blocks alone
    llm.shutdown()


def test_nothing_to_capture_on_a_cpu(tiny_config_path: Path) -> None:
    with LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, progress=False) as llm:
        assert llm.engine.graphs is None
        assert warmup.warm_decode_graphs(llm.engine, progress=False) == 0


def test_mixed_steps_prefill_behind_one_and_two_shared_segments_and_leave_nothing(
    tiny_config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", dtype="float32", num_kv_blocks=1024,
        max_num_seqs=64, max_num_batched_tokens=512, progress=False,
    )  # fmt: skip
    engine = llm.engine
    fake = _FakeGraphs([1, 2, 4, 8])
    monkeypatch.setattr(type(engine), "graphs", property(lambda self: fake))
    before = llm.metrics()
    seen: list[tuple[int, int]] = []  # (tokens, shared segments) of steps that prefilled while others decoded
    step = engine.step

    def watched() -> list:
        out = step()
        stats = engine.stats
        decoding = any(s.num_tokens > s.num_prompt_tokens for s in engine.scheduler.running)
        if decoding and stats.last_step_tokens > len(engine.scheduler.running):
            seen.append((stats.last_step_tokens, stats.last_step_segments))
        return out

    monkeypatch.setattr(engine, "step", watched)
    assert warmup.warm_mixed_steps(engine, progress=False) == 0
    assert any(segments >= 2 for _, segments in seen), seen  # the nested prefix: two shared segments
    assert max(tokens for tokens, _ in seen) >= 256  # prefill chunks of several sizes
    assert fake.resets == 1
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    after = llm.metrics()
    for key in ("requests_total", "generation_tokens_total", "prompt_tokens_total", "steps_total"):
        assert after[key] == before[key], key
    assert after["kv_blocks_used"] == before["kv_blocks_used"]
    llm.shutdown()


def test_held_rows_reach_each_tile_height_a_bucket_runs() -> None:
    """A bucket runs batches of more than a quarter of its rows (a shrinking batch keeps it); the
    start-up plan takes the largest count at each shared tile height (16, 64, 128 stacked rows)."""
    assert warmup.held_rows(1, 4) == [1]
    assert warmup.held_rows(8, 4) == [4, 8]  # 4 rows x 4 heads: 16-row tiles; 8: 64-row ones
    assert warmup.held_rows(96, 4) == [64, 96]  # 64 x 4 = 256 stacked rows: the last 64-row tiles
    assert warmup.held_rows(256, 4) == [256]  # 64 rows would not keep it
    assert warmup.held_rows(16, 1) == [16] and warmup.held_rows(512, 8) == [512]


@pytest.mark.parametrize(
    ("kv_dtype", "kv_heads", "bucket", "forms"),
    [
        (None, 1, 2, {1}),  # one KV head, two rows: few programs, so long rows split (the CPU: 4 SMs)
        ("e4m3", 1, 2, {1}),  # split walks read their block ids ahead: one walk
        ("e4m3", 8, 64, {1, 4}),  # one split a row: short walks once, long ones cut into 4
    ],
)
def test_split_variants_cover_each_two_kernel_key_at_the_item_ceiling(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: str | None, kv_heads: int, bucket: int, forms: set[int]
) -> None:
    """``capture_split_variants``: each captured two-kernel shared key at every own split count and
    e4m3 walk form a step's own parts can choose (every own length up to the context: checked here
    one block at a time), with its own work list and with the bucket's ceiling of items (a step of
    any structure then has a graph after the seal); mixed keys (at the ceiling already, one own
    partial a row) get none."""
    from types import SimpleNamespace

    import torch

    from prefixserve.attention.graph import Ceilings, HeadShape, Scratch
    from prefixserve.attention.graph_attention import own_splits_for, walks_for
    from prefixserve.engine import warmup
    from prefixserve.worker.cuda_graph import DecodeGraphs

    kv = torch.float8_e4m3fn if kv_dtype else None
    shape = HeadShape(
        4 * kv_heads, kv_heads, 128, torch.bfloat16, torch.device("cpu"), kv, Ceilings(256, 16000), Scratch()
    )
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._fits, graphs._fits_over = {}, 0
    graphs.graphs, graphs.shape, graphs.plan_failed, graphs.linear, graphs.captures = (
        {},
        shape,
        False,
        None,
        0,
    )
    two = ("shared", bucket, 256, 1, (16, 64, 2, False, 1, None, 1), 16, 4, 16, 16, 64, 80)
    mixed = ("shared", bucket, 256, 1, (16, 64, 3, True, 1, (64, 64), 1), 64, 4, 16, 16, 64, 80)
    graphs.graphs = dict.fromkeys((two, mixed))
    runner = SimpleNamespace(graphs=graphs, shard=SimpleNamespace(parallel=False), window=None, block_size=16)

    def capture(runner, step, bucket) -> None:
        graphs.graphs[step.key] = None
        graphs.captures += 1

    monkeypatch.setattr(warmup, "_capture_empty", capture)
    context = 16384
    assert warmup.capture_split_variants(runner, context) == len(graphs.graphs) - 2
    variants = [k for k in graphs.graphs if k[4][:6] == two[4][:6] and k != two]
    ceiling = shape.ceilings.shared(bucket)[0]
    choices = {(k[3], k[5]) for k in [*variants, two]}
    picks = {(k[3], k[4][6]) for k in [*variants, two]}
    assert ceiling > 16 and {(c, i) for c, _ in picks for i in (16, ceiling)} <= choices
    for own in range(1, context + 1, 16):  # every own length's choice has its graph
        splits = own_splits_for(own, bucket, 1, shape)
        assert (splits, walks_for(own, splits, bucket, shape, two[2], 16)) in picks, own
    assert len({c for c, _ in picks}) > 1 or bucket > 2  # long own parts split where programs are few
    assert {w for _, w in picks} == forms
    assert not [k for k in graphs.graphs if k[4][:6] == mixed[4][:6] and k != mixed]
