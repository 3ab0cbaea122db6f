"""Start-up decode batches, so that the decode graphs serving meets first exist before a server is ready.

Decode graphs are captured lazily, one per (batch bucket, attention key): a warm-up forward and a
capture, with Triton compiles the first time, while every running stream waits. A server with a
pinned system prompt met 11 of them in its first burst (issue 52: inter-token gaps of up to 12 s).
Here every bucket runs a few synthetic decode steps twice: on prompts of their own (the plain key)
and on prompts behind a shared prefix (each pinned system prompt, else a synthetic one), the two
shapes a burst meets first. Keys met later (more segments, other kernel choices) are still captured
when first met. The synthetic requests leave no trace in the metrics.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np

from prefixserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)

DECODE_STEPS = 3  # tokens each synthetic request generates: the first decode step captures, the rest replay
OWN_TOKENS = 8  # each synthetic prompt's tokens after the shared prefix


LONG_PREFIX = 4096  # tokens of a synthetic long shared prefix: its steps take other tiles (tall, mixed)


def warm_decode_graphs(engine: Any, progress: bool = True) -> int:
    """Capture every plain paged key (``capture_paged_keys``), then run a decode batch of every graph
    bucket, plain and behind shared prefixes (pinned system prompts, or a short synthetic one, and a
    long one) at each tile height its rows choose (``held_rows``); returns captures."""
    graphs = engine.graphs
    if graphs is None:  # a CPU, or enforce_eager: nothing is captured
        return 0
    before, started = graphs.captures, time.perf_counter()
    rng = random.Random(0)
    vocab = engine.runner.model.full_config.vocab_size
    prefixes = [list(held.token_ids) for held in engine.system_prompt_kv.values()]
    if not prefixes:
        prefixes = [_tokens(rng, vocab, 4 * engine.config.block_size)]
    prefixes.append(_tokens(rng, vocab, min(LONG_PREFIX, engine.max_model_len // 2)))
    prefixes = [p for p in prefixes if len(p) + OWN_TOKENS + DECODE_STEPS < engine.max_model_len]
    config = engine.model_config
    group = config.num_attention_heads // config.num_key_value_heads
    runs = [(bucket, bucket, None) for bucket in graphs.buckets]
    if plan_covers(engine.runner):  # rows held in a larger bucket: ranks would hold them apart
        runs += [(b, rows, p) for b in graphs.buckets for rows in held_rows(b, group) for p in prefixes]
    else:
        runs += [(b, b, p) for b in graphs.buckets for p in prefixes]
    saved = engine.stats.save(engine.runner)  # the synthetic steps and plans leave no trace
    try:
        _planned(capture_paged_keys, engine)
        for bucket, rows, prefix in _progress(runs, progress):
            _decode_batch(engine, rows, prefix or [], rng, vocab, bucket)
        _planned(capture_split_variants, engine)
    finally:
        engine.stats.restore(saved, engine.runner)
        graphs.reset_hold()  # the first real batch picks its own bucket
    captured = graphs.captures - before
    log.info("captured %d decode graphs in %.1f s", captured, time.perf_counter() - started)
    return captured


def held_rows(bucket: int, group: int) -> list[int]:
    """Row counts whose decode steps a bucket runs (its own, and fewer rows that keep it while a batch
    shrinks: ``DecodeGraphs.bucket_for``, more than a quarter of it) at each height of shared tile
    they choose (``pick_shared_tiles``: 16 rows for at most 16 stacked query rows, 64 for at most 256,
    else 128): the largest count of each, as the work tiles are part of a graph's key."""
    picks = {min(bucket, 16 // group), min(bucket, 256 // group), bucket}
    return sorted(r for r in picks if r >= 1 and 4 * r > bucket)


def _planned(part: Any, engine: Any) -> None:
    """Run a synthetic part of the start-up plan; one that fails leaves the plan incomplete (logged):
    the server then captures the keys it meets, as before there was a plan, rather than not start."""
    try:
        part(engine.runner, engine.max_model_len)
    except Exception:
        log.exception("the start-up capture plan failed in %s: graphs are captured when met", part.__name__)
        engine.graphs.plan_failed = True


def plan_covers(runner: Any) -> bool:
    """Whether the start-up plan covers every decode key this engine can meet, so that a server may
    seal its graphs: plain and shared keys of a full-attention model in one process. A sliding
    model's window work, a hybrid's state rows and a tensor-parallel worker's own planning are not
    enumerated: those graphs are still captured when first met."""
    graphs = runner.graphs
    if graphs is None or graphs.plan_failed:
        return False
    return not runner.shard.parallel and runner.window is None and graphs.linear is None


def capture_paged_keys(runner: Any, context: int) -> int:
    """Capture the plain paged graph of every bucket at every split count, e4m3 walk form and table
    width its sequences' lengths can choose (16 tokens to ``context``, by powers of two, and
    ``context``; the least length of each split count and walk form): the start-up plan of unshared
    decode steps. Each is a synthetic step whose rows read nothing (lengths 0) and write their K/V to
    the cache's scratch slot."""
    if not plan_covers(runner):
        return 0
    from prefixserve.attention.graph_attention import paged_choices
    from prefixserve.attention.metadata import build_metadata

    graphs = runner.graphs
    before, bs, blocks = graphs.captures, runner.block_size, runner.kv.num_blocks
    powers = {*(1 << k for k in range(4, max(4, context.bit_length()))), context}
    for bucket in graphs.buckets:
        lengths = sorted(powers | set(paged_choices(bucket, context, bs, graphs.shape).values()))
        for length in lengths:
            cols = -(-length // bs)
            if length > context or cols + bucket > blocks:
                break
            # the key follows the longest row: row 0 that long, the others one block, none shared
            tables = np.zeros((bucket, cols), dtype=np.int32)
            tables[0] = np.arange(cols)
            tables[1:, 0] = cols + np.arange(bucket - 1)
            meta = build_metadata(bs, [1] * bucket, [length] + [1] * (bucket - 1), tables, "cpu")
            step = runner.backend.graph_step(meta, graphs.shape, bucket)
            if step is not None and step.key[0] == "paged" and not graphs.serves(step):
                step.arrays["seq_lens"] = np.zeros(bucket, dtype=np.int32)  # nothing read
                _capture_empty(runner, step, bucket)
    graphs.reset_hold()
    return graphs.captures - before


def capture_split_variants(runner: Any, context: int) -> int:
    """Each captured two-kernel shared key again at every own-part split count and e4m3 walk form its
    bucket can choose (own parts up to ``context`` tokens, ``own_choices``), and each of those again
    with the bucket's ceiling of work items: the warm-up batches' own parts are a few tokens, so they
    meet one count only, and their structures few item counts (a two-kernel key's work list follows
    its step, since each item is a program; the ceiling's graph serves a step of any structure, at the
    cost of its padding programs). Each variant is a synthetic step that reads nothing (no work items,
    own lengths 0). Mixed keys take the ceiling already and write one own partial a row: no variants."""
    if not plan_covers(runner):
        return 0
    from prefixserve.attention.graph import GraphStep, capacity
    from prefixserve.attention.graph_attention import SharedGraph, own_choices

    graphs = runner.graphs
    before, shape = graphs.captures, graphs.shape
    choices: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # (bucket, pack, width) -> its choices
    for key in [k for k in list(graphs.graphs) if k[0] == "shared" and k[4][5] is None]:
        bucket, pack, slots = key[1], key[4][4], key[9]
        if (bucket, pack, key[2]) not in choices:
            own = own_choices(bucket, pack, context, runner.block_size, shape, key[2])
            choices[bucket, pack, key[2]] = sorted(own)
        ceiling = shape.ceilings.shared(bucket)[0] if shape.ceilings is not None else key[5]
        for items in dict.fromkeys((key[5], max(key[5], ceiling))):
            for count, walks in choices[bucket, pack, key[2]]:
                # merge entries as a step plans them: every slot and every row's own splits
                nnz = capacity(slots + count * bucket, 16)
                variant = (*key[:3], count, (*key[4][:6], walks), items, *key[6:10], nnz)
                if variant in graphs.graphs:
                    continue
                arrays = {"qsl": np.arange(bucket + 1, dtype=np.int32)}  # no items, no own lengths
                step = GraphStep(variant, arrays, lambda v=variant: SharedGraph(v, shape))
                _capture_empty(runner, step, bucket)
    return graphs.captures - before


def _capture_empty(runner: Any, step: Any, bucket: int) -> None:
    """Capture ``step`` (a synthetic one that reads nothing) with every row's K/V to the scratch slot."""
    scratch = runner.kv.scratch_slot
    runner.graphs.run([0] * bucket, [0] * bucket, np.full(bucket, scratch), step)


def warm_argmax(runner: Any, rows: int) -> None:
    """Compile now the greedy argmax kernel for every row count a step samples (1 to ``rows``), over
    the model's dtype and fp32 logits: Triton specialises it on each count's chunk sizes, and an
    overload run met two such variants in its first burst (0.1-0.2 s each, every stream waiting).
    A single process only (a tensor-parallel rank's shard compiles in its own process)."""
    if runner.device.type != "cuda" or runner.shard.parallel:
        return
    import torch

    from prefixserve.sampling.argmax import argmax_rows

    vocab = runner.model.full_config.vocab_size
    dtype = next(runner.model.parameters()).dtype
    for kind in dict.fromkeys((dtype, torch.float32)):
        try:
            logits = torch.zeros(rows, vocab, dtype=kind, device=runner.device)
        except torch.OutOfMemoryError:  # the step reserve holds the real ones; these are extra
            log.info("no argmax warm-up in %s: no room for %d x %d logits", kind, rows, vocab)
            continue
        for n in range(1, rows + 1):
            argmax_rows(logits[:n])
        torch.cuda.synchronize(runner.device)
        del logits


MIXED_OWN_TOKENS = (48, 200, 700)  # own prompt lengths of the mixed warm-up's arrivals (prefill sizes)
MIXED_DECODING = 24  # requests decoding while the arrivals prefill
MIXED_ARRIVALS = 12  # arrivals behind each of the two prefixes


def warm_mixed_steps(engine: Any, progress: bool = True) -> int:
    """Run steps that prefill prompts behind a shared prefix and behind a longer one nested in it (two
    shared segments) while other requests decode; returns the graphs captured meanwhile.

    Eager steps (prefill with decode) compile their attention kernels for each plan shape they meet
    first: on an H100 overload run a step over two shared segments first met under load stopped
    the engine for 1-3 s each time (``benchmarks/overload.py``'s slow steps). Here a few sizes of
    such steps run before the server is ready."""
    graphs = engine.graphs
    if graphs is None:  # a CPU, or enforce_eager: no compile worth the start-up time
        return 0
    before, started = graphs.captures, time.perf_counter()
    rng = random.Random(1)
    vocab = engine.runner.model.full_config.vocab_size
    bs = engine.config.block_size
    outer = _tokens(rng, vocab, 8 * bs)
    inner = outer + _tokens(rng, vocab, 4 * bs)
    saved = engine.stats.save(engine.runner)
    try:
        for k, own in enumerate(_progress(list(MIXED_OWN_TOKENS), progress, "warming mixed steps")):
            if len(inner) + own + DECODE_STEPS >= engine.max_model_len:
                break
            decoding = [outer + _tokens(rng, vocab, OWN_TOKENS) for _ in range(MIXED_DECODING)]
            ids = _add(engine, f"__warmup_mix{k}_d", decoding, 8)
            engine.step()  # they prefill, then decode while the arrivals prefill
            for name, prefix in (("o", outer), ("i", inner)):
                arrivals = [prefix + _tokens(rng, vocab, own) for _ in range(MIXED_ARRIVALS)]
                ids += _add(engine, f"__warmup_mix{k}_{name}", arrivals, 2)
            while any(request_id in engine.requests for request_id in ids):
                engine.step()
    finally:
        engine.stats.restore(saved, engine.runner)
        graphs.reset_hold()
    captured = graphs.captures - before
    log.info("warmed mixed steps in %.1f s (%d graphs captured)", time.perf_counter() - started, captured)
    return captured


def _add(engine: Any, tag: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Synthetic requests for ``prompts`` (greedy, EOS ignored); their ids."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, params=params, prompt_token_ids=prompt)
    return ids


def _decode_batch(
    engine: Any, rows: int, prefix: list[int], rng: random.Random, vocab: int, bucket: int | None = None
) -> None:
    """``rows`` synthetic requests behind ``prefix`` to the end, their decode steps in ``bucket``."""
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True)
    ids = [f"__warmup__{rows}_{len(prefix)}_{i}" for i in range(rows)]
    for request_id in ids:
        prompt = prefix + _tokens(rng, vocab, OWN_TOKENS)
        engine.add_request(request_id, params=params, prompt_token_ids=prompt)
    while any(request_id in engine.requests for request_id in ids):
        if bucket is not None and bucket > rows:
            engine.graphs.hold(bucket)
        engine.step()


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    """Ordinary ids, away from the specials that usually sit at the ends of a vocabulary."""
    low = min(100, vocab // 4)
    high = max(min(vocab - 100, 30000), low + 1)
    return [rng.randrange(low, high) for _ in range(n)]


def _progress(runs: list[Any], shown: bool, desc: str = "capturing decode graphs") -> Any:
    if not shown:
        return runs
    from tqdm import tqdm

    return tqdm(runs, desc=desc, unit="batch")


__all__ = [
    "capture_paged_keys",
    "capture_split_variants",
    "held_rows",
    "plan_covers",
    "warm_argmax",
    "warm_decode_graphs",
    "warm_mixed_steps",
]
