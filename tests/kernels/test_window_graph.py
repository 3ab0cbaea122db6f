"""Sliding layers' graph attention (``attention/window_graph.py``) against an fp64 oracle, over changing
decode steps replayed on one key's buffers (two steps: every case's second step reuses the first's key
with new lengths and contents; a third step took a third of the time and replayed the same way).

Each step: B sequences, most sharing a prefix longer than the window, with ragged own parts; the
backend plans the full layers' graph step, the window graph step adds the sliding layers' work, and
one graph attention per key serves later steps with new contents (partials poisoned in between).
Both KV layouts: the plain one (the block table's window columns) and the freeing one (three sliding
groups on pages of their own, in runs like the block table's or scattered)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from _kernel_helpers import DEVICE, rel_err
from test_window_attention import _oracle

from prefixserve.attention.graph import GraphAttention, HeadShape
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.triton_backend import TritonBackend, TritonPagedBackend
from prefixserve.attention.window_graph import window_graph_step


class _Steps:
    """Decode steps of ``batch`` sequences, the first ``shared`` holding ``prefix`` common blocks."""

    def __init__(self, seed: int, batch: int, shared: int, prefix: int, dim: int, groups: int, scatter: bool):
        self.gen = torch.Generator().manual_seed(seed)
        self.bs, self.groups, kv_heads = 16, groups, 2
        own_blocks = 8
        used = prefix + batch * own_blocks + 2
        self.k = torch.randn(used, self.bs, kv_heads, dim, generator=self.gen)
        self.v = torch.randn(used, self.bs, kv_heads, dim, generator=self.gen)
        perm = torch.randperm(used, generator=self.gen).tolist()
        head, rest = perm[:prefix], perm[prefix:]
        self.tables = [
            (head if i < shared else []) + rest[i * own_blocks : (i + 1) * own_blocks] for i in range(batch)
        ]
        self.lens = [len(t) * self.bs - own_blocks * self.bs + 3 + 5 * i for i, t in enumerate(self.tables)]
        # the freeing layout: group g's copy of block b on page used * (g + 1) + order_g[b]
        self.pages = []
        if groups:
            self.k = torch.cat([self.k, self.k.new_zeros(groups * used, *self.k.shape[1:])])
            self.v = torch.cat([self.v, self.v.new_zeros(groups * used, *self.v.shape[1:])])
            for g in range(groups):
                order = torch.randperm(used, generator=self.gen) if scatter and g else torch.arange(used)
                page = (used * (g + 1) + order).tolist()
                self.k[page], self.v[page] = self.k[:used].clone(), self.v[:used].clone()
                self.pages.append(page)
        self.k, self.v = self.k.to(DEVICE), self.v.to(DEVICE)

    def cut_tables(self) -> list[list[int]]:
        return [t[: math.ceil(n / self.bs)] for t, n in zip(self.tables, self.lens, strict=True)]

    def meta(self):
        return build_metadata(self.bs, [1] * len(self.lens), self.lens, self.cut_tables(), "cpu")

    def group_tables(self, window: int) -> tuple[np.ndarray, np.ndarray] | None:
        if not self.groups:
            return None
        base = np.array([max(0, n - window) // self.bs for n in self.lens], dtype=np.int64)
        tables = self.cut_tables()
        width = max(len(t) - b for t, b in zip(tables, base, strict=True))
        out = np.zeros((self.groups, len(tables), width), dtype=np.int32)
        for g, page in enumerate(self.pages):
            for s, (t, first) in enumerate(zip(tables, base, strict=True)):
                out[g, s, : len(t) - first] = [page[b] for b in t[first:]]
        return out, base

    def advance(self) -> None:
        self.lens = [n + 1 + i % 3 for i, n in enumerate(self.lens)]


@pytest.mark.parametrize(
    ("backend", "groups", "scatter", "group", "batch", "bucket", "window"),
    [
        (TritonBackend, 0, False, 4, 5, 6, 40),  # plain layout; a loner and one padding row
        (TritonBackend, 3, False, 2, 4, 4, 50),  # freeing layout, runs like the block table's
        (TritonBackend, 3, True, 4, 5, 8, 40),  # scattered pages: no contiguous first rows
        (TritonPagedBackend, 2, False, 4, 3, 4, 33),  # no shared plan: the walk alone
        (TritonBackend, 0, False, 1, 3, 3, 300),  # a window longer than every sequence
    ],
)
def test_window_graph_matches_the_oracle_across_changing_steps(
    backend, groups: int, scatter: bool, group: int, batch: int, bucket: int, window: int
) -> None:
    dim, scale = 32, 0.2
    steps = _Steps(1, batch, batch - 1, 9, dim, groups, scatter)
    shape = HeadShape(2 * group, 2, dim, torch.float32, DEVICE)
    be = backend()
    graphs: dict[tuple, GraphAttention] = {}
    reused = 0
    for _ in range(2):  # the first step records its key's graph, the second replays it on new contents
        meta = steps.meta()
        full = be.graph_step(meta, shape, bucket)
        step = window_graph_step(meta, full, shape, bucket, window, steps.group_tables(window))
        assert step is not None and step.key[:2] == ("sliding", bucket)
        assert (step.key[3][4] is None) == (backend is TritonPagedBackend)  # tiles: a shared part
        reused += step.key in graphs
        attn = graphs.setdefault(step.key, step.build())
        for part in (
            (attn.window.launches.o_part, attn.window.launches.lse_part) if attn.window.launches else ()
        ):
            if part is not None:
                part.fill_(math.nan)  # stale partials must never be read
        attn.load(step.arrays)
        q = torch.randn(batch, 2 * group, dim, generator=steps.gen).to(DEVICE)
        padded = torch.cat([q, torch.randn(bucket - batch, *q.shape[1:], generator=steps.gen).to(DEVICE)])
        ref = _oracle(q, steps.k, steps.v, steps.cut_tables(), [1] * batch, steps.lens, scale, window)
        # the first layer records, later ones replay with their group's arrays: each group once, then
        # the first again (its own arrays back after the others')
        views = [*range(max(groups, 1)), 0]
        for layer, g in enumerate(views):
            view = dataclasses.replace(meta, plan=g if groups else None)
            got = attn.window_forward(padded, steps.k, steps.v, view, scale, window)[:batch]
            assert rel_err(got, ref) < 1e-5, (g, layer)
        if step.group_slots is not None:  # each group's write slots: the same cache rows on its pages
            rows = [n - 1 for n in steps.lens]
            for g, page in enumerate(steps.pages):
                want = [
                    page[t[r // steps.bs]] * steps.bs + r % steps.bs
                    for t, r in zip(steps.tables, rows, strict=True)
                ]
                assert step.group_slots[g].tolist() == want
        steps.advance()
    assert reused >= 1  # one key's buffers served a later step


def test_module_blocks_leave_the_step_eager() -> None:
    """A step holding Prompt Cache module blocks (holes only the torch walk skips) gets no graph step."""
    steps = _Steps(2, 3, 2, 4, 32, 0, False)
    meta = steps.meta()
    meta.module_rows = np.zeros(steps.k.shape[0], dtype=np.int64)
    meta.module_rows[steps.tables[0][0]] = 5
    shape = HeadShape(8, 2, 32, torch.float32, DEVICE)
    full = TritonBackend().graph_step(meta, shape, 4)
    assert window_graph_step(meta, full, shape, 4, 40) is None
