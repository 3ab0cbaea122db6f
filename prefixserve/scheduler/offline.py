"""The offline plan of a batch (BatchLLM): prefix-sharing groups in run order, and what they save.

``plan_batch`` takes every request's prompt token ids before anything runs, builds the compact
prefix tree per cache salt (KV never crosses salts; any hashable key works), groups the requests
and orders the groups by Eq. 3. Two groupings:

- ``first_level`` (BatchLLM Algorithm 1): prefixes enlarged by forking, one level per group;
- ``tree``: the tree's own first level as groups, with members in tree order so deeper shared parts
  (sub-prefixes) run side by side and the prefix cache and shared-segment attention share them.

Pure Python; ``BatchAnalysis`` is what ``prefixserve batch --analyze`` prints.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from prefixserve.scheduler.prefix_tree import (
    PrefixGroup,
    build_tree,
    enlarge_first_level,
    first_level_groups,
    first_level_optimum,
    order_groups,
    saving_ratio,
    tree_tokens,
)

GROUPINGS = ("first_level", "tree")


@dataclass(slots=True)
class BatchAnalysis:
    """Token-saving figures of one batch (BatchLLM Eq. 1) and the shape of its groups."""

    requests: int
    logical_tokens: int  # prompt tokens with no sharing at all
    optimal_tokens: int  # every level of the prefix tree computed once
    first_level_optimum_tokens: int  # the best any one-level grouping can do
    planned_tokens: int  # what the chosen grouping computes
    group_sizes: list[int] = field(default_factory=list)  # in run order
    prefix_lengths: list[int] = field(default_factory=list)  # in run order

    @property
    def optimal_saving(self) -> float:
        return saving_ratio(self.optimal_tokens, self.logical_tokens)

    @property
    def first_level_saving(self) -> float:
        return saving_ratio(self.first_level_optimum_tokens, self.logical_tokens)

    @property
    def planned_saving(self) -> float:
        return saving_ratio(self.planned_tokens, self.logical_tokens)

    def kv_plan(self, block_size: int) -> dict[str, int]:
        """Blocks the group prefixes hold: the largest one, and all of them if held at once."""
        pairs = zip(self.prefix_lengths, self.group_sizes, strict=True)
        blocks = [n // block_size for n, m in pairs if m > 1]
        return {
            "shared_groups": len(blocks),
            "largest_prefix_blocks": max(blocks, default=0),
            "all_prefix_blocks": sum(blocks),
        }

    def to_dict(self, block_size: int = 16) -> dict[str, object]:
        sizes = sorted(self.group_sizes)
        return {
            "requests": self.requests,
            "groups": len(self.group_sizes),
            "group_size_min": sizes[0] if sizes else 0,
            "group_size_median": sizes[len(sizes) // 2] if sizes else 0,
            "group_size_max": sizes[-1] if sizes else 0,
            "logical_prompt_tokens": self.logical_tokens,
            "optimal_saving": round(self.optimal_saving, 4),
            "first_level_optimum_saving": round(self.first_level_saving, 4),
            "planned_saving": round(self.planned_saving, 4),
            **{f"kv_plan_{k}": v for k, v in self.kv_plan(block_size).items()},
        }


@dataclass(slots=True)
class BatchPlan:
    """Groups in run order; ``members`` index the input list."""

    groups: list[PrefixGroup]
    analysis: BatchAnalysis


def plan_batch(
    prompts: Sequence[Sequence[int]],
    salts: Sequence[Hashable] | None = None,
    decode_lengths: Sequence[int] | None = None,
    grouping: str = "first_level",
) -> BatchPlan:
    """Group and order a batch's requests before it runs (see the module docstring)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping {grouping!r} is not one of {', '.join(GROUPINGS)}")
    by_salt: dict[Hashable, list[int]] = {}
    for i in range(len(prompts)):
        by_salt.setdefault(None if salts is None else salts[i], []).append(i)
    groups: list[PrefixGroup] = []
    optimal = first_best = 0
    for members in by_salt.values():
        local = [prompts[i] for i in members]
        optimal += tree_tokens(build_tree(local))
        root = build_tree(local)
        first_best += sum(map(len, local)) - first_level_optimum(root)
        if grouping == "first_level":
            enlarge_first_level(root)
        for g in first_level_groups(root):
            order = g.members if grouping == "first_level" else sorted(g.members, key=lambda i: local[i])
            groups.append(PrefixGroup(g.prefix, [members[i] for i in order], g.distinct_tokens))
    groups = order_groups(groups, decode_lengths)
    # ``tree`` leaves deeper levels to the prefix cache, which shares them while members run side by side.
    planned = sum(g.prefill_tokens for g in groups) if grouping == "first_level" else optimal
    analysis = BatchAnalysis(
        requests=len(prompts),
        logical_tokens=sum(map(len, prompts)),
        optimal_tokens=optimal,
        first_level_optimum_tokens=first_best,
        planned_tokens=planned,
        group_sizes=[len(g.members) for g in groups],
        prefix_lengths=[len(g.prefix) for g in groups],
    )
    return BatchPlan(groups, analysis)


def shard_groups(groups: Sequence[PrefixGroup], num_shards: int) -> list[list[PrefixGroup]]:
    """Split groups over replicas, balanced by prefill tokens; a group never spans two shards.

    Largest group first onto the lightest shard (LPT); each shard keeps the groups' run order."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    load = [0] * num_shards
    owner: dict[int, int] = {}
    for k in sorted(range(len(groups)), key=lambda k: -groups[k].prefill_tokens):
        shard = min(range(num_shards), key=load.__getitem__)
        owner[k] = shard
        load[shard] += groups[k].prefill_tokens
    return [[g for k, g in enumerate(groups) if owner[k] == s] for s in range(num_shards)]
