"""Sliding layers give their KV pages back behind every holder's window (``kv/layout.py``,
``scheduler/sliding_pages.py``): the layout, the books of the pages, and a tiny Gemma 3 whose greedy
tokens do not change when the pages are freed, shared, cut from a prefix-cache hit or pinned, while
the pool holds several times the long sequences it holds keeping every layer's KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixserve import SamplingParams
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.layout import can_free_sliding, kv_layout
from prefixserve.model.config import ModelConfig
from prefixserve.scheduler.block_tables import BlockManager
from prefixserve.scheduler.sliding_pages import SlidingPages
from prefixserve.sequence import Request, Sequence
from tests.conftest import assert_pool_empty
from tests.test_model_families import GREEDY, _llm, _prompt, tiny_checkpoint
from tests.test_model_families import WINDOW as FAMILY_WINDOW

CONFIGS = Path(__file__).resolve().parents[1] / "prefixserve" / "model" / "configs"


# ---- the layout ------------------------------------------------------------------------------------
def test_gemma3_12b_layout_holds_five_times_the_32k_sequences() -> None:
    config = ModelConfig.from_json(CONFIGS / "gemma-3-12b.json")
    freeing, plain = kv_layout(config), kv_layout(config, free_sliding=False)
    assert freeing.num_slots == 8 and freeing.sliding_groups == 5 and freeing.window == 1024
    assert sorted(freeing.group_of).count(0) == 8  # the full layers, one slot each
    assert plain.num_slots == 48 and not plain.frees_sliding
    assert freeing.page_elements(16) * 6 == plain.page_elements(16)  # one plain block = six pages
    # pages of one 32K-token sequence: 2,048 of its blocks, 5 x 65 of its window's sliding pages
    assert freeing.pages_for(32768, 16) == 2048 + 5 * 65
    memory = 10**6 * plain.page_elements(16)  # any pool: the ratio of sequences it holds
    held_free = memory // (freeing.page_elements(16) * freeing.pages_for(32768, 16))
    held_plain = memory // (plain.page_elements(16) * plain.pages_for(32768, 16))
    assert held_free >= 5 * held_plain


def test_models_without_a_mix_keep_the_plain_layout() -> None:
    llama = ModelConfig.from_json(CONFIGS / "llama-3.1-8b.json")
    assert not kv_layout(llama).frees_sliding and "no sliding" in (can_free_sliding(llama) or "")
    sliding = {"sliding_window": 64, "layer_types": ["sliding_attention"] * 32}
    everyone_slides = ModelConfig(**{**llama.to_dict(), **sliding})
    assert "every layer slides" in (can_free_sliding(everyone_slides) or "")


# ---- the books of the pages ------------------------------------------------------------------------
BS, WINDOW, GROUPS = 4, 10, 2


def _manager(pages: int = 64, caching: bool = True) -> BlockManager:
    pool = BlockPool(pages, BS)
    return BlockManager(pool, caching, SlidingPages(pool, GROUPS, WINDOW))


_ids = iter(range(10**6))


def _seq(tokens: list[int]) -> Sequence:
    n = len(tokens)
    req = Request("r", None, list(tokens), list(range(n)), SamplingParams(max_tokens=64))
    return Sequence(next(_ids), req, 0, list(tokens), list(range(n)))


def _run(blocks: BlockManager, seq: Sequence, upto: int, chunk: int = 3) -> None:
    """Compute ``seq`` to ``upto`` tokens, ``chunk`` at a time, as the scheduler would."""
    while seq.num_computed_tokens < upto:
        n = min(chunk, upto - seq.num_computed_tokens)
        assert blocks.reserve(seq, seq.num_computed_tokens + n, [])
        seq.num_computed_tokens += n
        blocks.register_computed(seq)
        _check(blocks)


def _check(blocks: BlockManager) -> None:
    blocks.pool.check_integrity()
    assert blocks.sliding is not None
    blocks.sliding.check()


def _visible_blocks(seq: Sequence) -> range:
    """The blocks the next query of ``seq`` can see."""
    return range(max(0, seq.num_computed_tokens - WINDOW + 1) // BS, -(-seq.num_computed_tokens // BS))


def test_pages_behind_the_window_go_back_and_the_window_keeps_its_pages() -> None:
    blocks = _manager()
    seq = _seq(list(range(3, 63)))
    _run(blocks, seq, 60)
    pages = blocks.group_tables_np([seq])
    assert pages is not None
    tables, base = pages
    seen = _visible_blocks(seq)
    assert base[0] == seen.start  # the pages behind the window were given back
    assert tables.shape == (GROUPS, 1, len(seen)) and (tables > 0).all()
    # 15 blocks, and the sliding pages of the blocks the window reaches (at most window/bs + 1 each)
    assert blocks.pool.num_used <= 15 + GROUPS * (-(-WINDOW // BS) + 1)
    blocks.free(seq)
    assert blocks.pool.num_used == 0
    _check(blocks)


def test_a_hit_takes_its_tail_pages_and_is_cut_where_they_were_evicted() -> None:
    blocks = _manager(pages=40)
    tokens = list(range(3, 43))
    first = _seq(tokens)
    _run(blocks, first, 40)
    blocks.free(first)  # its blocks and its window's pages stay cached; earlier pages were given back
    again = _seq([*tokens, 7])
    hit = blocks.match_prefix(again)
    assert hit == 40  # the window's pages of the hit's end are cached
    sliding = blocks.sliding
    assert sliding is not None and sliding.held_pages(again) > 0
    blocks.free(again)
    # a prompt sharing only the first half: its tail's pages were given back behind the window, and
    # (a full pool later) evicted: the hit is cut to nothing rather than read pages not there
    taken = blocks.pool.allocate(blocks.pool.num_free)  # evicts every unheld cached page and block
    blocks.pool.release(taken)
    half = _seq([*tokens[:20], 9, 9, 9])
    assert blocks.match_prefix(half) == 0
    blocks.free(half)
    assert blocks.pool.num_used == 0
    _check(blocks)


def test_a_hit_on_a_prefix_whose_pages_were_given_back_but_kept_cached() -> None:
    blocks = _manager()
    tokens = list(range(3, 43))
    first = _seq(tokens)
    _run(blocks, first, 40)
    half = _seq([*tokens[:20], 9, 9, 9])
    assert blocks.match_prefix(half) == 20  # pages released by ``first`` are still indexed
    _run(blocks, half, 23)
    for seq in (first, half):
        blocks.free(seq)
    assert blocks.pool.num_used == 0
    _check(blocks)


def test_forks_share_pages_and_copy_them_on_write() -> None:
    blocks = _manager()
    parent = _seq(list(range(3, 25)))
    _run(blocks, parent, 22)  # 22 tokens: the last block is partly filled
    child = _seq(list(range(3, 25)))
    blocks.fork(parent, child)
    sliding = blocks.sliding
    assert sliding is not None
    assert all((a == b).all() for a, b in zip(sliding.tables([parent]), sliding.tables([child]), strict=True))
    copies: list[tuple[int, int]] = []
    child.token_ids.append(5)
    child.positions.append(22)
    assert blocks.reserve(child, 23, copies)  # writes into the shared last block: copied, every group
    assert len(copies) == 1 + GROUPS
    (theirs, base), (ours, _) = sliding.tables([parent]), sliding.tables([child])
    assert (theirs[:, 0, 5 - base[0]] != ours[:, 0, 5 - base[0]]).all()
    for seq in (parent, child):
        blocks.free(seq)
    assert blocks.pool.num_used == 0
    _check(blocks)


def test_without_prefix_caching_pages_still_go_back() -> None:
    blocks = _manager(caching=False)
    seq = _seq(list(range(3, 63)))
    _run(blocks, seq, 60, chunk=1)
    assert blocks.pool.num_used <= 15 + GROUPS * (-(-WINDOW // BS) + 1)
    blocks.free(seq)
    assert blocks.pool.num_used == 0


def test_the_longest_sequence_fits_the_pages() -> None:
    blocks = _manager(pages=40)
    longest = blocks.max_tokens(40)
    assert blocks.pages_for(longest) <= 40 < blocks.pages_for(longest + BS)


# ---- a tiny Gemma 3 end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3_sliding_kv")
    tiny_checkpoint("gemma3_text", directory)
    return directory


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def test_freed_pages_change_no_token(gemma3: Path) -> None:
    """8 prompts behind a prefix of 3 windows, 40 tokens each: keeping every page and freeing them give
    the same greedy tokens, with shared-segment attention, on a prefix-cache repeat and in n=4 groups,
    and freeing holds fewer pages at its peak."""
    prefix = _prompt(5, 3 * FAMILY_WINDOW)
    prompts = [{"prompt_token_ids": prefix + _prompt(10 + i, 3 + 2 * i)} for i in range(8)]
    keep = _llm(gemma3, attention="reference", keep_sliding_kv=True, enable_prefix_caching=False)
    free = _llm(gemma3, attention="cascade", max_num_batched_tokens=64)
    assert free.engine.runner.kv.layout.frees_sliding and not keep.engine.runner.kv.layout.frees_sliding
    want = _tokens(keep.generate(prompts, GREEDY))
    assert _tokens(free.generate(prompts, GREEDY)) == want
    assert _tokens(free.generate(prompts, GREEDY)) == want  # a repeat: hits cut to their cached tails
    assert free.metrics()["prefix_cache_hit_tokens_total"] > 0
    group = SamplingParams(temperature=0.8, n=4, seed=3, max_tokens=12, ignore_eos=True)
    assert _tokens(free.generate(prompts[:2], group)) == _tokens(keep.generate(prompts[:2], group))
    assert_pool_empty(free)
    assert_pool_empty(keep)


def _peak_running(llm: Any, prompts: list[dict[str, Any]], params: SamplingParams) -> tuple[int, list]:
    """The most sequences past their prompt at once, and every request's tokens."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"long-{i}", params=params, prompt_token_ids=p["prompt_token_ids"])
    peak, tokens = 0, {}  # a prompt's first chunks may be preempted: count those past it
    while engine.requests:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        decoding = [s for s in engine.scheduler.running if s.num_computed_tokens >= s.num_prompt_tokens]
        peak = max(peak, len(decoding))
    return peak, [tokens[f"long-{i}"] for i in range(len(prompts))]


def test_the_same_pool_runs_more_long_sequences_at_once(gemma3: Path) -> None:
    """The memory of 160 blocks of 8 tokens in every layer; prompts of 19 windows (456 tokens) and 40
    tokens out. Keeping every layer's KV, a sequence holds 62 blocks: 2 run at once. Freeing the three
    sliding layers' pages, the same memory is 640 one-layer pages and a sequence holds 62 of them and
    3 x 4 of its window's: 8 run at once."""
    prompts = [{"prompt_token_ids": _prompt(40 + i, 19 * FAMILY_WINDOW)} for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    keep = _llm(gemma3, keep_sliding_kv=True, enable_prefix_caching=False, max_num_batched_tokens=512)
    free = _llm(gemma3, enable_prefix_caching=False, max_num_batched_tokens=512)
    assert free.engine.pool.num_blocks == 4 * keep.engine.pool.num_blocks  # one memory, smaller pages
    (held_keep, want), (held_free, got) = (
        _peak_running(keep, prompts, params),
        _peak_running(free, prompts, params),
    )
    assert held_keep == 2 and held_free >= 3 * held_keep, (held_free, held_keep)
    assert got == want  # long prompts: blocks taken ahead, sliding pages chunk by chunk
    assert_pool_empty(free)
    assert_pool_empty(keep)


def test_a_pinned_system_prompt_keeps_its_tail_pages(gemma3: Path) -> None:
    """A pinned prompt of 4 windows holds its blocks and its last window's sliding pages: after other
    prompts have cycled through the whole pool, a prompt opening with it still hits all of it."""
    system = "".join(chr(97 + i % 26) for i in range(4 * FAMILY_WINDOW))
    llm = _llm(gemma3)
    engine = llm.engine
    engine.pin_system_prompt("app", system)
    pinned = engine.system_prompt_kv["app"]
    sliding = engine.blocks.sliding
    assert sliding is not None and len(pinned.blocks) > len(pinned.digests)  # the tail's pages too
    others = [{"prompt_token_ids": _prompt(90 + i, 10 * FAMILY_WINDOW)} for i in range(8)]
    llm.generate(others, SamplingParams(max_tokens=2, ignore_eos=True))
    ids = list(pinned.token_ids) + _prompt(3, 5)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.num_cached_tokens == len(pinned.digests) * engine.config.block_size


def test_speculated_drafts_over_freed_pages_change_no_token(gemma3: Path) -> None:
    """Prompt lookup drafts tokens past what is verified; the pages behind the window go back only
    behind the verified tokens' window (a rejected draft cannot have released what the next query
    sees). Prompts that repeat themselves, so drafts are taken and some rejected."""
    pattern = _prompt(61, 10)
    prompts = [{"prompt_token_ids": pattern * 6 + _prompt(70 + i, 5)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    keep = _llm(gemma3, keep_sliding_kv=True, enable_prefix_caching=False)
    spec = _llm(gemma3, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec.engine.runner.kv.layout.frees_sliding
    assert _tokens(spec.generate(prompts, params)) == _tokens(keep.generate(prompts, params))
    assert spec.metrics()["spec_decode_draft_tokens_total"] > 0
    assert_pool_empty(spec)


def test_launch_ahead_over_freed_pages_changes_no_token(gemma3: Path) -> None:
    """With launch-ahead a step is planned before the tokens of the step ahead of it are on the host:
    pages go back only behind the settled tokens' window."""
    prefix = _prompt(5, 3 * FAMILY_WINDOW)
    prompts = [{"prompt_token_ids": prefix + _prompt(80 + i, 4 + i)} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    keep = _llm(gemma3, keep_sliding_kv=True, enable_prefix_caching=False)
    ahead = _llm(gemma3, async_scheduling=True, max_num_batched_tokens=64)
    assert ahead.engine.launch_ahead and ahead.engine.runner.kv.layout.frees_sliding
    assert _tokens(ahead.generate(prompts, params)) == _tokens(keep.generate(prompts, params))
    assert_pool_empty(ahead)
