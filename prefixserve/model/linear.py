"""The linear layers a model is built from: plain, several projections stacked as one matmul, row- and
vocabulary-parallel pieces under tensor parallelism, and the output head."""

from __future__ import annotations

import torch
from torch import nn

from prefixserve.model import cpu_linear, fp8, fused
from prefixserve.model.meta_init import LoadedLater
from prefixserve.model.parallel import Shard
from prefixserve.model.peer_allreduce import EMBEDDING_SLOT


class Linear(LoadedLater, nn.Linear):
    """``nn.Linear`` that takes oneDNN with a packed weight on the CPU when it has one (``cpu_linear``),
    and on a GPU the skinny kernel for a decode step's few rows where it beats cuBLAS (``fused.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == fp8.FP8:
            return fp8.linear(self, x)
        if x.is_cuda:
            return fused.linear(x, self.weight, self.bias)
        return cpu_linear.linear(self, x)

    @property
    def fp8(self) -> bool:
        """Whether the weight is FP8 codes (``model/fp8.py``): the fused paths that take a 16-bit
        weight tensor (split-K partials, the gated gate-up kernel) then give way to ``forward``."""
        return self.weight.dtype == fp8.FP8

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``self(x)`` without a bias, written into ``out`` [M, N] (a peer all-reduce buffer)."""
        if self.fp8:
            return fp8.linear(self, x, out=out)
        return fused.linear_into(x, self.weight, out)


class Projection(Linear):
    """A layer's projection that is neither stacked from checkpoint parts by rows nor row-parallel, to
    which FP8 weights apply too (``quantized_layers``): a linear-attention layer's input and output
    projections, the gated attention's q/k/v/gate. Unsharded (hybrids refuse tensor parallelism)."""


class MergedLinear(Linear):
    """Several projections of the same input as one matmul, their weights stacked by rows.

    ``parts`` names the stacked projections as checkpoints name them (q_proj, k_proj, v_proj;
    gate_proj, up_proj), in row order: the loaders fill each part's rows from its own tensor, so HF
    state dicts load unchanged. One GEMM reads x once and runs at a larger N (the split q/k/v and
    gate/up GEMMs ran split-K with their own reduce kernels at decode sizes on an H200).
    """

    def __init__(self, in_features: int, parts: list[tuple[str, tuple[int, int], int]], bias: bool) -> None:
        """``parts``: (checkpoint name, this rank's [start, stop) rows of that tensor, its total rows)."""
        super().__init__(in_features, sum(b - a for _, (a, b), _ in parts), bias=bias)
        self.parts = parts

    def part_rows(self) -> dict[str, slice]:
        """Each part's rows of the stacked weight (and bias)."""
        out, at = {}, 0
        for name, (a, b), _ in self.parts:
            out[name] = slice(at, at + b - a)
            at += b - a
        return out


class RowParallelLinear(Linear):
    """A linear layer whose input columns ``src`` = [start, stop) of the checkpoint's ``total`` are
    this rank's; ``reduced`` sums the ranks' partial products."""

    def __init__(self, total_in: int, src: tuple[int, int], out_features: int) -> None:
        super().__init__(src[1] - src[0], out_features, bias=False)
        self.src, self.total_in = src, total_in

    def reduced(self, x: torch.Tensor, shard: Shard, slot: int | None = None) -> torch.Tensor | fused.PeerSum:
        """The product summed over the ranks, for a norm that adds it to the residual stream next.

        With a product ``slot`` (``peer_allreduce``'s: consecutive calls never share one) the sum may
        be left to that norm: where ``product_slot`` gives one, a ``PeerSum`` comes back, which
        ``fused.add_rms_norm`` sums over NVLink with the residual add and the norm in one kernel
        (``kernels/peer_norm.py``, ``kernels/ranks_norm.py``).

        On the peer path the product (cuBLAS, or the skinny kernel at a few rows) is written straight
        into the peer buffer and the sum is returned there: the copies in and out of the buffer (130
        a step of the 8B model) go. That sum lives only until the next all-reduce, which is why only
        these two call sites, whose next op (``add_rms_norm`` with the residual) writes new tensors,
        take it."""
        peer = shard.peer
        if peer is not None and fused.staged_allreduce(x):
            if slot is not None and fused.peer_norm_enabled():
                pending = peer.product_slot(slot, x.shape[0], self.out_features, x.dtype)
                if pending is not None:
                    self.into(x, pending.mine)
                    return pending
            staged = peer.staged(x.shape[0], self.out_features, x.dtype)
            if staged is not None:
                self.into(x, staged)
                return peer.reduce_staged(staged)
        return shard.all_reduce(self(x))


class VocabParallelEmbedding(LoadedLater, nn.Embedding):
    """The embedding rows ``src`` = [start, stop) of the vocabulary; other ids look up zeros here and
    their row on the rank that holds it (the all-reduce sums the ranks' lookups)."""

    def __init__(self, vocab: int, hidden: int, shard: Shard) -> None:
        self.src = shard.vocab_span(vocab)
        super().__init__(self.src[1] - self.src[0], hidden)
        self.vocab, self.shard = vocab, shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if not self.shard.parallel:
            return super().forward(ids)
        return self.shard.all_reduce(fused.shard_lookup(ids, self.weight, self.src[0]))

    def summed_later(self, ids: torch.Tensor) -> torch.Tensor | fused.PeerSum:
        """``forward(ids)``, except that on the fused path (``product_slot``) the lookups are written into
        the embedding's product slot and come back unsummed (``PeerSum``): the first layer's norm
        sums them (``DecoderLayer.before_attention``), saving the all-reduce and its copies."""
        peer = self.shard.peer
        fused_path = fused.staged_allreduce(ids) and fused.peer_norm_enabled()
        if self.shard.parallel and peer is not None and fused_path:
            pending = peer.product_slot(EMBEDDING_SLOT, ids.shape[0], self.embedding_dim, self.weight.dtype)
            if pending is not None:
                fused.shard_embedding(ids, self.weight, self.src[0], pending.mine)
                return pending
        return self(ids)


class ParallelLMHead(Linear):
    """The output projection's vocabulary rows ``src`` (the embedding's, for tied weights)."""

    def __init__(self, hidden: int, vocab: int, shard: Shard) -> None:
        self.src = shard.vocab_span(vocab)
        super().__init__(hidden, self.src[1] - self.src[0], bias=False)


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers FP8 weights apply to: the attention and MLP projections (stacked q/k/v and gate/up,
    o and down, a hybrid's ``Projection`` layers). Not the LM head or embedding (they decide the
    sampled token; a small share of a large model's bytes), routers, Gemma 4's per-layer projections,
    nor MoE experts (not done)."""
    kinds = MergedLinear | RowParallelLinear | Projection
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


def quantize_model(model: nn.Module) -> int:
    """Quantize every layer of ``quantized_layers`` not FP8 already; returns how many."""
    count = 0
    for _, layer in quantized_layers(model):
        if not fp8.is_fp8(layer):
            fp8.quantize_layer(layer)
            count += 1
    return count


__all__ = [
    "Linear",
    "MergedLinear",
    "ParallelLMHead",
    "Projection",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "quantize_model",
    "quantized_layers",
]
