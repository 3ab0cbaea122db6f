"""A linear-attention hybrid's decode step under CUDA graphs: the state slots a replay reads.

Each Gated DeltaNet layer reads and writes a sequence's states in its slot (``kv/state_slots.py``).
A captured graph holds its tensors' addresses, so a step's slots and fresh flags enter through two
rows of the decode graphs' input buffer, refilled before each replay as the token ids are, and the
layers see a ``LinearStep`` whose device tensors are those rows. Padding rows name the pool's scratch
slot. Outside the graph stay the slot copies made before a step (forked samples, restored
snapshots: ``ModelRunner.forward``) and the snapshots a decode step takes after its token, copied
once the replay is issued (same stream, so after it).

A capture begins with an eager warm-up of the step, and the rule moves states in place: the warm-up
runs on the scratch slot, or every real slot would move twice (warm-up, then the replay). Its full
layers' K/V writes land in the step's own rows, which the replay writes again before any read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prefixserve.kv.state_slots import StatePool
from prefixserve.model.gated_delta import LinearStep

ROWS = 2  # the inputs' rows a hybrid adds: slots, fresh flags (0 / 1)


class LengthOnly(Sequence[int]):
    """A captured step's host list of slots or fresh flags: its length is known, its items are not
    (they change with every replay), so reading one fails instead of reading a placeholder."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("a captured step's slots and fresh flags are on the device only")


class LinearGraphRows:
    """The decode graphs' rows of state slots and fresh flags, and the layers' view of them."""

    def __init__(self, states: StatePool, inputs: torch.Tensor, first_row: int) -> None:
        self.states = states
        self.rows = inputs[first_row : first_row + ROWS]  # [2, cap] int64 views of the graphs' inputs
        self.first_row = first_row
        cap = inputs.shape[1]
        self._starts = torch.arange(cap + 1, dtype=torch.long, device=inputs.device)

    def fill(self, host: np.ndarray, step: LinearStep, bucket: int) -> None:
        """Write ``step``'s slots and fresh flags into the host staging rows ``host`` (the graphs'
        whole staging array); the bucket's padding rows name the scratch slot, fresh."""
        rows, n = host[self.first_row : self.first_row + ROWS], len(step.slots)
        rows[0, :n], rows[1, :n] = step.slots, step.fresh
        rows[0, n:bucket], rows[1, n:bucket] = self.states.scratch_slot, 1

    def step(self, bucket: int) -> LinearStep:
        """The layers' view of a captured step: every row one token, its tensors the input rows."""
        slots, fresh = self.rows[0, :bucket], self.rows[1, :bucket] != 0
        return LinearStep(
            LengthOnly(bucket),  # the replays' slots and flags are the rows': the host has none
            list(range(bucket + 1)),
            LengthOnly(bucket),
            self.states.layers,
            on_device=(slots, self._starts[: bucket + 1], fresh),
        )

    @contextmanager
    def on_scratch(self) -> Iterator[None]:
        """Every row on the scratch slot while inside (a capture's warm-up), the real rows after."""
        real = self.rows.clone()
        self.rows[0].fill_(self.states.scratch_slot)
        self.rows[1].fill_(1)
        try:
            yield
        finally:
            self.rows.copy_(real)

    def after_replay(self, step: LinearStep) -> None:
        """The snapshots the step takes after its token: its slots' states copied into theirs."""
        if any(step.snapshots):
            self.states.copy(step.end_snapshots())


__all__ = ["ROWS", "LinearGraphRows"]
