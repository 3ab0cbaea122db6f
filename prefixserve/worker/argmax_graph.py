"""The sharded argmax of a graphed decode step, replayed from a CUDA graph of its own.

Under tensor parallelism a greedy step's sampling is ``compute_argmax``: the lm_head shard, the
argmax of each rank's columns, the ranks' exchange of [R, 2] (one kernel over peer memory at two
ranks, else NCCL's all-gather) and the pick, up to fifteen small launches
that rank 0's host issues every step. At two ranks a decode step's GPU work shrinks while the host's
does not, and with launch-ahead the host must finish a step's work within the GPU's step before
(docs/kernels.md §8); this takes those launches down to one replay. Each decode graph's output
buffer (``DecodeGraphs``: one per captured key) gets its own argmax graph, captured on first use into
the decode graphs' memory pool, over all the bucket's rows (padding rows' tokens are never read).
Every rank takes the same path for the same step (the same bucket and rows), so the exchange is
captured on all of them together, as the decode graphs' all-reduces are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from prefixserve.worker.graph_capture import capture_into

log = logging.getLogger(__name__)


class ArgmaxGraphs:
    """One captured ``argmax(hidden)`` per decode graph output buffer; ``run`` replays it."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor], pool: tuple[int, int]) -> None:
        self.argmax, self.pool = argmax, pool
        self.graphs: dict[tuple[int, tuple[int, ...]], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def release(self) -> None:
        """Free every captured argmax now: each holds NCCL's communicator through its all-gather,
        and leaving the group waits for it (``DecodeGraphs.release``)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def run(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """Tokens [rows] of the first ``rows`` rows of ``hidden``, a decode graph's whole output buffer.

        The tokens live in the graph's output buffer until its next replay: a step's sampling reads
        them (into pinned memory, into the next step's fed rows) before the next step's sampling."""
        key = (hidden.data_ptr(), tuple(hidden.shape))
        entry = self.graphs.get(key)
        if entry is None:
            self.argmax(hidden)  # warm-up: kernels compile and the collective is set up outside capture
            torch.cuda.synchronize(hidden.device)
            graph = torch.cuda.CUDAGraph()
            with capture_into(graph, self.pool):
                tokens = self.argmax(hidden)
            entry = self.graphs[key] = (graph, tokens)
            log.info("captured the sharded argmax of %d rows (%d graphs)", hidden.shape[0], len(self.graphs))
        graph, tokens = entry
        graph.replay()
        return tokens[:rows]


__all__ = ["ArgmaxGraphs"]
