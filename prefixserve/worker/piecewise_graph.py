"""Eager steps of up to ``MAX_TOKENS`` tokens with their dense work replayed from CUDA graphs.

A prefill or mixed step cannot be one CUDA graph: its attention depends on the step's shape (how many
sequences, how long, which shared segments), planned afresh each step. Everything else in a layer
(norms, the q/k/v projection, RoPE and the KV write, o_proj, the MLP) depends only on the number of
tokens. Eagerly, a layer of those is about ten launches, which at a few hundred tokens or fewer take the
host longer to issue than the GPU to run: a Prompt Cache first token (36 new tokens after 5K cached
module tokens, 8B model) spent about 19 ms in a step whose kernels took about 5 ms.

So, as vLLM's piecewise graphs do, the forward is cut at each attention (``LlamaForCausalLM``'s
``first_piece`` / ``middle_piece`` / ``last_piece``). For a bucket of padded token counts, each piece is
captured once; a step replays piece 0, runs layer 0's attention eagerly over the real tokens, replays
piece 1, and so on: L + 1 replays and L eager attentions instead of ~10 L launches. The pieces meet in
fixed buffers (the attention's input q, its output, the residual stream); the padding rows write their
K/V to the cache's scratch slot and their outputs are dropped.

``PiecewiseGraphs(capture=False)`` runs the same buffers and padding without graphs (CPU tests).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.graph import HostStaging
from prefixserve.attention.kv_quant import kv_write
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.kv.cache import KVCache
from prefixserve.worker.graph_capture import capture_into

if TYPE_CHECKING:
    from prefixserve.model.rotary import Ropes

log = logging.getLogger(__name__)

MAX_TOKENS = 1024  # above this the GPU time of a step dwarfs its launches
MIN_BUCKET = 16
FINE_FROM, FINE_STEP = 256, 64  # buckets every 64 tokens from 256 on


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: 16, 24, 32, 48, ... 256 (powers of two and 1.5x them), then every 64.

    Small steps are memory-bound (padding rows are nearly free); from a few hundred tokens the GEMMs
    are compute-bound and a padded row costs as much as a real one, so the steps get finer.
    """
    sizes, p = set(), MIN_BUCKET
    while p < min(max_tokens, FINE_FROM):
        sizes |= {p, p * 3 // 2}
        p *= 2
    sizes |= set(range(FINE_FROM, max_tokens, FINE_STEP))
    sizes.add(max_tokens)
    return sorted(s for s in sizes if s <= max_tokens)


@dataclass(slots=True)
class _Bucket:
    """One bucket's fixed buffers and its captured pieces (empty without capture)."""

    q: torch.Tensor  # [bucket, Hq * widest D]: a layer's attention input (``_view`` per layer)
    out: torch.Tensor  # [bucket, Hq * widest D]: its output
    residual: torch.Tensor  # [bucket, hidden]: the residual stream between pieces
    hidden: torch.Tensor  # [bucket, hidden]: the last piece's output
    graphs: list[torch.cuda.CUDAGraph]
    rope: Ropes | None = None  # the angles piece 0 writes, the others read


class PiecewiseGraphs:
    """The model runner asks ``fits(tokens)``, then ``run`` for a step already planned eagerly."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_tokens: int, capture: bool = True) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.model, self.kv, self.capture = model, kv, capture
        self.device, self.dtype = param.device, param.dtype
        self.heads, self.hidden_size = cfg.num_attention_heads, cfg.hidden_size
        # each layer's head size (Gemma 4's global layers are wider): q and the attention's output
        # live in flat buffers of the widest, viewed per layer
        self.head_dims = [cfg.layer_spec(i).head_dim or cfg.head_dim for i in range(cfg.num_hidden_layers)]
        self.layers = cfg.num_hidden_layers
        self.buckets = token_buckets(max(MIN_BUCKET, min(max_tokens, MAX_TOKENS)))
        cap = self.buckets[-1]
        # ids, positions, then each KV group's write slots (one group but under the freeing layout)
        self.groups = kv.layout.group_of
        rows = 3 + kv.layout.sliding_groups
        self.inputs = torch.zeros(rows, cap, dtype=torch.long, device=self.device)
        self._staging = HostStaging((rows, cap), torch.long, self.device)
        self.entries: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0
        self.capture_s = 0.0

    def release(self) -> None:
        """Free every captured piece now (``DecodeGraphs.release`` says why)."""
        for entry in self.entries.values():
            for graph in entry.graphs:
                graph.reset()
        self.entries.clear()

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.buckets[-1]

    @torch.inference_mode()
    def run(
        self,
        ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        feed: Any = None,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The step's final hidden states [tokens, hidden]; ``backend.prepare(meta)`` has run.

        ``feed`` (a ``model_runner.PrevTokenFeed``) overwrites rows of ids with tokens still on the
        device. ``before_layer(l)`` runs before piece l, the first to touch layer l's cache (it
        writes the tokens' K/V): eagerly, between replays, never inside a captured graph (the model
        runner's wait for KV still being copied in, ``kv/landing.py``)."""
        tokens = len(ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, tokens)]
        pinned = self._staging.next()
        host = pinned.numpy()
        host[0, :tokens], host[1, :tokens] = ids, positions
        host[:2, tokens:bucket] = 0
        host[2:, tokens:bucket] = self.kv.scratch_slot
        self.inputs[:, :bucket].copy_(pinned[:, :bucket], non_blocking=True)
        if feed is not None:
            feed.apply(self.inputs[0])
        self.inputs[2, :tokens].copy_(meta.slot_mapping)  # already on the device (no wait for it)
        for g, group in enumerate(meta.group_metas, 3):
            self.inputs[g, :tokens].copy_(group.slot_mapping)
        entry = self.entries.get(bucket)
        if entry is None or not entry.graphs:  # the first time: warm-up, then capture
            return self._eager(bucket, tokens, meta, backend, before_layer)
        for layer in range(self.layers):
            if before_layer is not None:
                before_layer(layer)
            entry.graphs[layer].replay()
            self._attend(entry, layer, tokens, meta, backend)
        entry.graphs[-1].replay()
        return entry.hidden[:tokens]

    def _attend(
        self, entry: _Bucket, layer: int, tokens: int, meta: AttentionMetadata, backend: AttentionBackend
    ) -> None:
        out = self.model.model.layers[layer].self_attn.attend(
            self._view(entry.q, layer)[:tokens],
            self.kv.layers[layer],
            meta.for_layer(layer),
            backend,
            queried=True,
        )
        self._view(entry.out, layer)[:tokens].copy_(out.reshape(tokens, self.heads, self.head_dims[layer]))

    def _view(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """A bucket's flat q or output buffer as layer ``layer``'s [bucket, Hq, D]."""
        bucket, d = flat.shape[0], self.head_dims[layer]
        return flat.view(-1)[: bucket * self.heads * d].view(bucket, self.heads, d)

    def _cache(self, layer: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return kv_write(self.kv.layers[layer], self.inputs[2 + self.groups[layer], :bucket])

    def _piece(self, entry: _Bucket, piece: int, bucket: int, rope: Ropes | None):
        """Run piece ``piece`` on the bucket's buffers (eagerly, or under capture); returns the RoPE
        angles piece 0 computed (the later pieces read them)."""
        model = self.model
        if piece == 0:
            q, residual, rope = model.first_piece(
                self.inputs[0, :bucket], self.inputs[1, :bucket], self._cache(0, bucket)
            )
        elif piece < self.layers:
            q, residual = model.middle_piece(
                piece, self._view(entry.out, piece - 1), entry.residual, rope, self._cache(piece, bucket)
            )
        else:
            entry.hidden.copy_(model.last_piece(self._view(entry.out, piece - 1), entry.residual, rope))
            return rope
        self._view(entry.q, piece).copy_(q)
        entry.residual.copy_(residual)
        return rope

    def _eager(
        self,
        bucket: int,
        tokens: int,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run the step through the pieces eagerly (this compiles every kernel at the bucket's shapes),
        then capture the pieces; returns the step's hidden states."""
        entry = self.entries.get(bucket) or self._new_bucket(bucket)
        rope = None
        for piece in range(self.layers + 1):
            if before_layer is not None and piece < self.layers:
                before_layer(piece)
            rope = self._piece(entry, piece, bucket, rope)
            if piece < self.layers:
                self._attend(entry, piece, tokens, meta, backend)
        hidden = entry.hidden[:tokens].clone()
        if self.capture:
            self._capture(entry, bucket)
        return hidden

    def _new_bucket(self, bucket: int) -> _Bucket:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=self.dtype, device=self.device)

        entry = _Bucket(
            q=zeros(bucket, self.heads * max(self.head_dims)),
            out=zeros(bucket, self.heads * max(self.head_dims)),
            residual=zeros(bucket, self.hidden_size),
            hidden=zeros(bucket, self.hidden_size),
            graphs=[],
        )
        self.entries[bucket] = entry
        return entry

    def _capture(self, entry: _Bucket, bucket: int) -> None:
        """Capture the L + 1 pieces into one memory pool (replayed in the order captured)."""
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        graphs, rope = [], None
        try:
            for piece in range(self.layers + 1):
                graph = torch.cuda.CUDAGraph()
                with capture_into(graph, self.pool):
                    rope = self._piece(entry, piece, bucket, rope)
                graphs.append(graph)
        except Exception:
            log.exception("capturing the dense pieces for %d tokens failed; such steps stay eager", bucket)
            self.capture = False
            return
        entry.graphs, entry.rope = graphs, rope  # the angles stay alive with the graphs that read them
        self.captures += 1
        took = time.perf_counter() - started
        self.capture_s += took
        ms = took * 1e3
        log.info("captured the dense pieces for %d tokens in %.0f ms (%d so far)", bucket, ms, self.captures)


__all__ = ["MAX_TOKENS", "PiecewiseGraphs", "token_buckets"]
