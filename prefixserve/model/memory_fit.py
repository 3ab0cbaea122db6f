"""Will the model fit this device? Weights checked before they are allocated, and the memory a step
needs beside them kept out of the KV pool, so a model too large for its GPUs is refused at start with
the numbers, never by an out-of-memory error in the middle of loading or of the first long step."""

from __future__ import annotations

import math

import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.parallel import Shard

GiB = 1 << 30
FIXED_RESERVE = 1 * GiB  # CUDA context growth, NCCL and peer buffers, graph pools
# The caching allocator keeps freed blocks of one step's sizes that the next step's sizes do not fit:
# a 70B rank at TP=2 (2 x H100, 16,384-token steps) held 0.95 GiB unallocated beside a 2.86 GiB
# activation peak (the estimate below said 2.84) when the next allocation failed. Half again over the
# estimate covers that with room to spare.
FRAGMENTATION = 0.5


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (tied weights once); works on a meta-device model."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def step_reserve(config: ModelConfig, dtype: torch.dtype, max_tokens: int, max_seqs: int) -> int:
    """Memory a step takes beside weights and KV: the widest activations of ``max_tokens`` tokens
    (residual, q/k/v, gate and up columns of this rank, their products; a mixture of experts' k
    routed copies of each token), fp32 logits of ``max_seqs``
    rows with their softmax and the gathered copy, ``FRAGMENTATION`` more for the allocator's
    unusable free blocks, and a fixed part (``FIXED_RESERVE``)."""
    item = torch.tensor([], dtype=dtype).element_size()
    specs = [config.layer_spec(i) for i in range(config.num_hidden_layers)]
    qkv = max((config.num_attention_heads + 2 * s.kv_heads) * s.head_dim for s in specs)
    inter = max(s.intermediate_size for s in specs)
    per_layer = 2 * config.num_hidden_layers * config.hidden_size_per_layer_input  # Gemma 4's inputs
    per_token = 4 * config.hidden_size + qkv + 3 * inter + per_layer
    if config.num_experts:  # router logits, and per routed copy its activation and weighted output
        per_token += 2 * config.num_experts + config.num_experts_per_tok * (
            config.moe_intermediate_size + config.hidden_size
        )
    logits = 3 * max_seqs * config.vocab_size * 4
    variable = max_tokens * per_token * item + logits
    return int(variable * (1 + FRAGMENTATION)) + FIXED_RESERVE


def kv_blocks_for_sequences(context: int, block_size: int, max_num_seqs: int) -> int:
    """Blocks that ``max_num_seqs`` sequences of ``context`` tokens hold at most: the most a pool can
    be used by running sequences (blocks past it only keep more of the prefix cache). The default
    pool's size, capped by memory (``blocks_for_budget``)."""
    return -(-context // block_size) * max_num_seqs


def check_weights_fit(model: torch.nn.Module, device: torch.device, shard: Shard) -> None:
    """Refuse a model (``model`` built on the meta device) whose weights do not fit the device's free
    memory with room for a step, naming the sizes and the rank count that would fit."""
    if device.type != "cuda":
        return
    need = weight_bytes(model)
    free, total = torch.cuda.mem_get_info(device)
    room = free - FIXED_RESERVE
    if need <= room:
        return
    whole = need * shard.size
    fits = math.ceil(whole / max(room, 1))
    raise ValueError(
        f"the model's weights need {need / GiB:.1f} GiB on {device} at tensor_parallel_size="
        f"{shard.size} ({whole / GiB:.1f} GiB in all), but it has {free / GiB:.1f} GiB free of "
        f"{total / GiB:.1f} GiB, {FIXED_RESERVE / GiB:.0f} GiB of which a step needs: use "
        f"tensor_parallel_size >= {fits} (GPUs of this size), or a smaller dtype or model"
    )


def check_kv_fits(num_blocks: int, block_size: int, max_tokens: int, device: torch.device) -> None:
    """Refuse a KV pool that cannot hold one step's worth of tokens (``max_num_batched_tokens``)."""
    if num_blocks * block_size < max_tokens:
        more = "more GPUs (tensor_parallel_size), " if device.type == "cuda" else ""
        raise ValueError(
            f"after the weights, {device} has room for {num_blocks} KV blocks ({num_blocks * block_size} "
            f"tokens), fewer than one step's max_num_batched_tokens={max_tokens}: use {more}a higher "
            f"kv_memory_fraction, kv_cache_dtype='fp8', or a smaller max_num_batched_tokens"
        )


__all__ = [
    "check_kv_fits",
    "check_weights_fit",
    "kv_blocks_for_sequences",
    "step_reserve",
    "weight_bytes",
]
