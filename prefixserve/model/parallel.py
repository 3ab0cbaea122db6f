"""Tensor parallelism's group: which slice of each weight a rank holds, and the collectives between ranks.

Megatron's split of a Llama layer: q/k/v and gate/up are split by heads and columns (column parallel,
each rank computes its own heads and its own part of the MLP's intermediate), o_proj and down_proj by
rows (row parallel: each rank's partial product, then one all-reduce), the embedding and lm_head by
vocabulary rows (each rank looks up or scores its own tokens; an all-reduce sums the lookups, an
all-gather joins the logits). KV heads go with their query heads: with more ranks than KV heads, each
KV head is replicated on the ranks whose query heads read it.

The shared-segment attention works per KV head, so it needs nothing from here: each rank attends its
own heads over its own share of every block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from prefixserve.model.config import ModelConfig
from prefixserve.model.peer_allreduce import PeerAllReduce


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process died: the engine cannot compute without its shard."""


@dataclass(slots=True)
class Shard:
    """Which part of the model this process holds: rank ``rank`` of ``size`` (1: the whole model)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None with size 1
    peer: PeerAllReduce | None = None  # decode-sized all-reduces over NVLink peer memory (CUDA)

    @property
    def parallel(self) -> bool:
        return self.size > 1

    # ---- which slice --------------------------------------------------------------------------
    def span(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of ``total`` rows split evenly (``total`` divisible by size)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_span(self, vocab: int) -> tuple[int, int]:
        """This rank's vocabulary rows: ceil(vocab / size) each; the last rank's may run past the
        vocabulary (those padded rows are zero and never sampled)."""
        per = -(-vocab // self.size)
        return self.rank * per, (self.rank + 1) * per

    def kv_head_span(self, kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads: its share when they divide evenly, else the one head its query
        heads read (replicated across ``size // kv_heads`` ranks)."""
        if kv_heads >= self.size:
            return self.span(kv_heads)
        head = self.rank // (self.size // kv_heads)
        return head, head + 1

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as one rank sees it: its heads and intermediate columns (hidden size, layers and
        vocabulary as they are). The KV cache, the attention plans and the CUDA graphs are sized
        from this, so they hold only the rank's heads."""
        if not self.parallel:
            return config
        check_divisible(config, self.size)
        start, stop = self.kv_head_span(config.num_key_value_heads)
        per_layer = {  # Gemma 4's global layers: their own KV heads, split alike
            i: {**sizes, **self._local_kv_heads(sizes)} for i, sizes in config.per_layer_config.items()
        }
        return replace(
            config,
            num_attention_heads=config.num_attention_heads // self.size,
            num_key_value_heads=stop - start,
            intermediate_size=config.intermediate_size // self.size,
            moe_intermediate_size=config.moe_intermediate_size // self.size,
            per_layer_config=per_layer,
        )

    def _local_kv_heads(self, sizes: dict[str, int]) -> dict[str, int]:
        if "num_key_value_heads" not in sizes:
            return {}
        start, stop = self.kv_head_span(sizes["num_key_value_heads"])
        return {"num_key_value_heads": stop - start}

    # ---- collectives --------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (row-parallel outputs, vocab-parallel lookups): through
        peer memory where the message fits its buffer, else NCCL (or gloo on a CPU)."""
        if self.peer is not None and self.peer.fits(x):
            return self.peer(x)
        if self.parallel:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's ``x`` [R, C] side by side, [R, size * C], cut to ``total`` columns."""
        if not self.parallel:
            return x[:, :total]
        every = self.all_gather_stack(x)  # [size, R, C]
        return every.permute(1, 0, 2).reshape(x.shape[0], -1)[:, :total]

    def all_gather_stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x``, stacked in rank order: [size, *x.shape]."""
        if not self.parallel:
            return x[None]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool must have one size everywhere)."""
        if not self.parallel:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def check_divisible(config: ModelConfig, size: int) -> None:
    """Refuse a rank count the model's heads do not split over, naming the numbers."""
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} (nor does {size} divide by it)")
    layer_kv = {sizes.get("num_key_value_heads", kv_heads) for sizes in config.per_layer_config.values()}
    for heads_of_layers in sorted(layer_kv - {kv_heads}):  # Gemma 4's global layers
        if heads_of_layers % size and size % heads_of_layers:
            problems.append(
                f"per_layer_config's num_key_value_heads={heads_of_layers} (nor does {size} divide by it)"
            )
    if inter % size:
        problems.append(f"intermediate_size={inter}")
    if config.moe_intermediate_size % size:  # each expert's columns are split over the ranks
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {', '.join(problems)}")


__all__ = ["Shard", "WorkerDiedError", "check_divisible"]
