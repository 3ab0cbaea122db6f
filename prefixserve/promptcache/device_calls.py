"""The Prompt Cache's device work, run through the engine's model runner outside the scheduler.

``PromptModules`` is handed these calls at start-up (``prompt_modules``): encoding a module piece
alone into fresh blocks, and measuring how far cached module rows are from their in-context K/V
(accuracy recovery). The runner is the engine's ``ModelRunner``, taken by what it does (``plan``,
``forward``, ``kv_deviation``, ``kv``) so that this package does not import the engine above it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixserve.config import EngineConfig
from prefixserve.kv.block_pool import BlockPool
from prefixserve.promptcache.store import PromptModules


def prompt_modules(
    runner: Any, config: EngineConfig, pool: BlockPool, tokenizer: Any, source: Any
) -> PromptModules:
    """The engine's Prompt Cache, wired to ``runner`` through a ``ModuleDeviceCalls``."""
    model_id = str(getattr(source, "path", None) or source.name)
    if getattr(source, "kind", None) == "dummy":  # random weights: the seed is part of the KV
        model_id = f"{source.name}|seed={config.seed}"
    if config.quantization is not None:  # FP8 weights compute other KV than the checkpoint's own
        model_id += f"|weights={config.quantization}"
    device_calls = ModuleDeviceCalls(runner, config)
    device_calls.modules = PromptModules(
        pool,
        runner.kv,
        device_calls.encode_piece,
        tokenizer,
        model_id,
        config.module_gpu_fraction,
        config.module_host_bytes,
        config.module_store,
        device_calls.deviation,
        config.module_recompute,
        int((1.0 - config.kv_admit_threshold) * pool.num_blocks),
    )
    return device_calls.modules


class ModuleDeviceCalls:
    """``encode_piece`` and ``deviation`` for ``PromptModules``, in chunks of the step budget.

    ``modules`` (the ``PromptModules`` these calls serve) is set once it exists: it is built with them.
    """

    def __init__(self, runner: Any, config: EngineConfig) -> None:
        self.runner, self.config = runner, config
        self.modules: Any = None

    def encode_piece(self, token_ids: list[int], positions: list[int], blocks: list[int]) -> None:
        """Compute a module piece's KV alone (attending only within itself) into ``blocks``.

        A forward of one sequence outside the scheduler, in chunks of the step budget; its outputs
        are dropped. It is issued on the device's stream after any step in flight, whose blocks it
        never touches (``blocks`` are freshly allocated).
        """
        table = np.asarray([blocks], dtype=np.int32)
        chunk = self.config.max_num_batched_tokens
        for start in range(0, len(token_ids), chunk):
            end = min(len(token_ids), start + chunk)
            batch = self.runner.prepare_batch(positions[start:end], [end - start], [end], table, eager=True)
            self.runner.forward(token_ids[start:end], batch, [])

    def row_batches(
        self, blocks: list[int], runs: list[tuple[int, int]]
    ) -> list[tuple[list[tuple[int, int]], np.ndarray]]:
        """Runs of table rows packed, in order, into batches of at most the step budget (a longer run
        is split), each with its block tables: run (a, b) is one sequence whose queries are rows
        a..b-1 and whose context is every row before b, with ``blocks`` as its table."""
        budget, bs = self.config.max_num_batched_tokens, self.config.block_size
        parts = [(a + i, min(b, a + i + budget)) for a, b in runs for i in range(0, b - a, budget)]
        batches: list[list[tuple[int, int]]] = [[]]
        used = 0
        for a, b in parts:
            if batches[-1] and used + b - a > budget:
                batches.append([])
                used = 0
            batches[-1].append((a, b))
            used += b - a
        out = []
        for batch in batches:
            if not batch:
                continue
            table = np.zeros((len(batch), max(-(-b // bs) for _, b in batch)), dtype=np.int32)  # [S, W]
            for s, (_, b) in enumerate(batch):
                table[s, : -(-b // bs)] = blocks[: -(-b // bs)]
            out.append((batch, table))
        return out

    def deviation(
        self, token_ids: list[int], positions: list[int], blocks: list[int], runs: list[tuple[int, int]]
    ) -> list[np.ndarray]:
        """Per row of each run: how far its cached layer-1 K/V is from the K/V it has in this context
        (squared L2 over heads, K and V summed). Layer 0 runs over the cached rows as they are (they
        equal the in-context ones there); nothing is written."""
        per_row: list[np.ndarray] = []
        for batch, table in self.row_batches(blocks, runs):
            pos = [p for a, b in batch for p in positions[a:b]]
            ids = [t for a, b in batch for t in token_ids[a:b]]
            q_lens, s_lens = [b - a for a, b in batch], [b for _, b in batch]
            step = self.runner.prepare_batch(pos, q_lens, s_lens, table, self.modules.module_rows, eager=True)
            per_row.append(self.runner.kv_deviation(ids, step))
        flat = np.concatenate(per_row) if per_row else np.zeros(0)
        out, start = [], 0
        for a, b in runs:
            out.append(flat[start : start + b - a])
            start += b - a
        return out


__all__ = ["ModuleDeviceCalls", "prompt_modules"]
