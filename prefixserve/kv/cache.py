"""The KV cache tensors (one K and one V per layer, paged) and how many blocks fit in memory."""

from __future__ import annotations

import os

import torch

from prefixserve.model.config import ModelConfig


class KVCache:
    """All layers' paged K/V in one allocation.

    Shape ``[layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]``; ``layers[i]`` is (K, V) of
    layer i. The last block is scratch, outside the pool: a captured decode graph runs a fixed number
    of rows, and the padding rows write their K/V to ``scratch_slot`` so no pool block is touched.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (
            config.num_hidden_layers,
            2,
            num_blocks + 1,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(config.num_hidden_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks  # blocks the pool hands out (the scratch block is not one)
        self.scratch_slot = num_blocks * block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate each ``src`` block's K/V into ``dst`` in every layer."""
        if not pairs:
            return
        src, dst = torch.tensor(pairs, dtype=torch.long).T.contiguous()
        if self.tensor.device.type == "cuda":  # no blocking copy: the host may be ahead of the GPU
            src = src.pin_memory().to(self.tensor.device, non_blocking=True)
            dst = dst.pin_memory().to(self.tensor.device, non_blocking=True)
        self.tensor[:, :, dst] = self.tensor[:, :, src]


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def available_memory(device: torch.device) -> int:
    """Free bytes the KV cache may draw from: free GPU memory, or physical RAM on a CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def blocks_for_budget(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory_fraction: float,
    max_blocks: int | None = None,
) -> int:
    """Blocks that fit in ``memory_fraction`` of the available memory, capped at ``max_blocks``."""
    budget = int(available_memory(device) * memory_fraction)
    blocks = budget // bytes_per_block(config, block_size, dtype)
    if max_blocks is not None:
        blocks = min(blocks, max_blocks)
    if blocks < 1:
        raise ValueError(
            f"memory fraction {memory_fraction} leaves no room for one KV block "
            f"({bytes_per_block(config, block_size, dtype)} bytes)"
        )
    return int(blocks)
