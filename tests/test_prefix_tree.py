"""Global prefix identification (BatchLLM Algorithm 1) on the compact prefix tree."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.scheduler.prefix_tree import (
    PrefixNode,
    build_tree,
    enlarge_first_level,
    first_level_groups,
    first_level_optimum,
    order_groups,
    saving_ratio,
    tree_tokens,
)

prompt_lists = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=6)


def _saved(prompts: list[list[int]], root: PrefixNode) -> int:
    return sum(map(len, prompts)) - sum(g.prefill_tokens for g in first_level_groups(root))


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _partitions(items: list[int]):
    if not items:
        yield []
        return
    for rest in _partitions(items[1:]):
        yield [[items[0]], *rest]
        for i in range(len(rest)):
            yield [*rest[:i], [items[0], *rest[i]], *rest[i + 1 :]]


def _brute_first_level(prompts: list[list[int]]) -> int:
    """Every partition of the prompts into groups, each sharing its members' common prefix."""
    best = 0
    for part in _partitions(list(range(len(prompts)))):
        saved = 0
        for g in part:
            common = min(_lcp(prompts[g[0]], prompts[i]) for i in g)
            saved += (len(g) - 1) * common
        best = max(best, saved)
    return best


def _paths(root: PrefixNode) -> dict[int, list[int]]:
    """Prompt index -> the tokens on its root-to-node path."""
    out: dict[int, list[int]] = {}
    stack = [(root, [])]
    while stack:
        node, above = stack.pop()
        path = above + node.tokens
        for i in node.requests:
            out[i] = path
        stack.extend((c, path) for c in node.children)
    return out


def test_figure4_example():
    """The paper's Figure 4 text: 'b' is shared by five prompts (saves 4 tokens); prompts 4 and 5
    share their first 8 tokens, so forking 'b' into 'bfghijkl' saves 8 of them."""
    prompts = [list(s) for s in ("axy", "bcd", "bce", "bfghijklm", "bfghijkln", "bo")]
    root = build_tree(prompts)
    assert sorted("".join(c.tokens) for c in root.children) == ["axy", "b"]
    assert _saved(prompts, root) == 4
    enlarge_first_level(root)
    groups = {"".join(g.prefix): g.members for g in first_level_groups(root)}
    assert groups == {"axy": [0], "b": [1, 2, 5], "bfghijkl": [3, 4]}
    assert _saved(prompts, root) == 2 + 8
    assert first_level_optimum(build_tree(prompts)) == 10
    assert tree_tokens(build_tree(prompts)) == sum(map(len, prompts)) - 12


@settings(max_examples=300, deadline=None)
@given(prompt_lists)
def test_tree_is_compact_and_holds_every_prompt(prompts):
    root = build_tree(prompts)
    assert _paths(root) == dict(enumerate(prompts))
    assert root.leaves == len(prompts)
    stack = list(root.children)
    while stack:
        node = stack.pop()
        assert node.tokens
        assert len(node.children) != 1 or node.requests  # one-child chains are merged
        assert node.leaves == len(node.requests) + sum(c.leaves for c in node.children)
        stack.extend(node.children)


@settings(max_examples=300, deadline=None)
@given(prompt_lists)
def test_dp_groups_partition_prompts_and_stay_within_bounds(prompts):
    naive = _saved(prompts, build_tree(prompts))
    optimum = first_level_optimum(build_tree(prompts))
    full = sum(map(len, prompts)) - tree_tokens(build_tree(prompts))
    root = enlarge_first_level(build_tree(prompts))
    assert _paths(root) == dict(enumerate(prompts))  # forking keeps every prompt's tokens
    groups = first_level_groups(root)
    members = sorted(i for g in groups for i in g.members)
    assert members == list(range(len(prompts)))
    for g in groups:
        assert all(prompts[i][: len(g.prefix)] == g.prefix for i in g.members)
    assert naive <= _saved(prompts, root) <= optimum <= full
    assert optimum == _brute_first_level(prompts)


def _batchllm_synthetic(seed: int, groups: int, subs: int, per_sub: int) -> list[list[int]]:
    """A short global instruction, a long per-group document, a per-query sub-prefix, a random tail."""
    rng = random.Random(seed)
    instruction = [rng.randrange(32000) for _ in range(16)]
    prompts = []
    for _ in range(groups):
        doc = [rng.randrange(32000) for _ in range(rng.randint(300, 600))]
        for _ in range(subs):
            sub = [rng.randrange(32000) for _ in range(rng.randint(20, 80))]
            for _ in range(per_sub):
                prompts.append(instruction + doc + sub + [rng.randrange(32000) for _ in range(40)])
    rng.shuffle(prompts)
    return prompts


def test_synthetic_saving_near_first_level_optimum_and_above_naive():
    prompts = _batchllm_synthetic(0, groups=12, subs=3, per_sub=4)
    logical = sum(map(len, prompts))
    naive = saving_ratio(logical - _saved(prompts, build_tree(prompts)), logical)
    optimum = first_level_optimum(build_tree(prompts)) / logical
    achieved = saving_ratio(logical - _saved(prompts, enlarge_first_level(build_tree(prompts))), logical)
    assert achieved >= optimum - 0.01
    assert naive < 0.1 < 0.5 < achieved


def test_order_groups_by_eq3():
    prompts = [[1] * 50 + [2], [1] * 50 + [3], [4] * 5, [5] * 5 + [6], [5] * 5 + [7]]
    groups = first_level_groups(enlarge_first_level(build_tree(prompts)))
    ordered = order_groups(groups)
    sizes = [len(g.prefix) + g.distinct_tokens for g in ordered]
    assert sizes == sorted(sizes)  # R_group = 1 / (L_prefix + sum L_distinct), largest first
    # A long-decoding group moves ahead of a shorter prompt group.
    decode = [1000, 1000, 1, 1, 1]
    assert order_groups(groups, decode)[0].members == [0, 1]


def test_plan_batch_groupings_salts_and_analysis():
    from prefixserve.scheduler.offline import plan_batch

    prompts = _batchllm_synthetic(3, groups=5, subs=2, per_sub=3)
    first = plan_batch(prompts)
    a = first.analysis
    assert sorted(i for g in first.groups for i in g.members) == list(range(len(prompts)))
    assert a.planned_saving == a.first_level_saving <= a.optimal_saving
    assert a.kv_plan(16)["shared_groups"] == 5
    tree = plan_batch(prompts, grouping="tree")
    assert tree.analysis.planned_saving == a.optimal_saving
    for g in tree.groups:  # members in tree order: sub-prefix siblings side by side
        assert [prompts[i] for i in g.members] == sorted(prompts[i] for i in g.members)
    # KV never crosses cache salts: the same prompts under two salts make twice the groups.
    salted = plan_batch(prompts + prompts, salts=[None] * len(prompts) + ["t"] * len(prompts))
    assert len(salted.groups) == 2 * len(first.groups)
    for g in salted.groups:
        assert len({i < len(prompts) for i in g.members}) == 1
    with pytest.raises(ValueError, match="grouping"):
        plan_batch(prompts, grouping="sorted")


def test_shard_groups_balances_tokens_and_keeps_groups_whole():
    from prefixserve.scheduler.offline import plan_batch, shard_groups

    prompts = _batchllm_synthetic(4, groups=9, subs=2, per_sub=2)
    groups = plan_batch(prompts).groups
    shards = shard_groups(groups, 2)
    assert sorted(id(g) for s in shards for g in s) == sorted(id(g) for g in groups)
    loads = [sum(g.prefill_tokens for g in s) for s in shards]
    assert max(loads) - min(loads) <= max(g.prefill_tokens for g in groups)
    for s in shards:  # run order kept inside each shard
        assert [groups.index(g) for g in s] == sorted(groups.index(g) for g in s)
    with pytest.raises(ValueError):
        shard_groups(groups, 0)
