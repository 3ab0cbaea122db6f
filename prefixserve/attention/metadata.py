"""What one engine step tells the attention backends.

The batch is a flat list of query tokens. Sequence ``s`` owns query rows
``query_start_loc[s]:query_start_loc[s+1]``; its KV lives in the paged cache at the blocks of
``block_tables[s]`` and holds ``seq_lens[s]`` tokens *after* this step's tokens were written.

Causality is by cache index, not by position ID (positions are data and need not be
monotone): the ``j``-th query of sequence ``s`` attends to KV indices
``0 .. seq_lens[s] - query_lens[s] + j`` inclusive.

KV cache layout of one layer: ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Batch layout for one step; built once per step and shared by every layer."""

    block_size: int
    query_start_loc: torch.Tensor  # [S+1] int32 on the model's device
    seq_lens: torch.Tensor  # [S] int32: KV tokens per sequence, this step's included
    block_tables: torch.Tensor  # [S, max_blocks] int32, right-padded with 0
    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) of each new token
    query_lens_host: list[int]
    seq_lens_host: list[int]
    block_tables_host: list[list[int]]  # each list covers exactly ceil(seq_len / block_size) blocks
    plan: Any = None  # backend-specific per-step plan (e.g. shared segments), made in ``prepare``
    stats: dict[str, float] = field(default_factory=dict)  # per-step counters a backend reports

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_host)

    def logical_kv_tokens(self) -> int:
        """KV token-rows a per-sequence path reads per layer: every sequence reads its whole KV."""
        return sum(self.seq_lens_host)


def build_metadata(
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    device: torch.device | str,
) -> AttentionMetadata:
    """Make device tensors (and the write slots of the new tokens) from host lists."""
    num_seqs = len(seq_lens)
    if not (len(query_lens) == len(block_tables) == num_seqs):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    starts = [0]
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if q_len < 1 or q_len > s_len:
            raise ValueError(f"query length {q_len} must be in [1, seq_len={s_len}]")
        if len(table) * block_size < s_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
        starts.append(starts[-1] + q_len)
        for idx in range(s_len - q_len, s_len):
            slots.append(table[idx // block_size] * block_size + idx % block_size)
    width = max((len(t) for t in block_tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(num_seqs, width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        block_tables_host=[list(t) for t in block_tables],
    )
