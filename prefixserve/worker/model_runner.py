"""The model runner: the device side of a step (KV cache, attention backend, CUDA graphs, forward, sampling).

The engine loop hands it plain host data (positions, query and sequence lengths, block tables, token
ids, the rows to sample and their parameters) and gets sampled token ids back; it knows nothing of
requests, the scheduler or outputs. A step goes through it in four calls, so that the device starts
on the forward before the host does the step's bookkeeping, and the host can plan step N+1 while the
device still runs step N (async scheduling):

  ``plan``    host metadata and the attention plan (for a CUDA graph when the batch fits one);
  ``forward`` KV copies, then the forward pass, issued without waiting;
  ``sample``  logits and sampling of the chosen rows, issued without waiting; closes the launch;
  ``wait``    the sampled tokens, and the device's busy / idle time of the step.

A step may even be launched before the host has the tokens of the step before it (the engine's
launch-ahead): the rows that need those tokens name them in a ``PrevTokenFeed`` and read them on the
device, so the GPU runs step N+1 right behind step N while the host checks N's tokens.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixserve.attention import dense_prefill
from prefixserve.attention.backend import backend_for_model
from prefixserve.attention.kv_quant import dequantize, rotate, scales_of
from prefixserve.attention.metadata import AttentionMetadata, build_metadata
from prefixserve.config import EngineConfig
from prefixserve.host_copy import list_to_device
from prefixserve.kv.cache import KVCache, blocks_for_budget, bytes_per_block
from prefixserve.kv.layout import kv_layout, plain_layout
from prefixserve.kv.state_slots import StatePool, bytes_per_slot, slot_counts, snapshot_room
from prefixserve.model import cpu_linear, fp8
from prefixserve.model.linear import quantized_layers
from prefixserve.model.memory_fit import check_kv_fits, step_reserve
from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.rules import LogitsAdjust, LogitsMask
from prefixserve.sampling.sampler import SampleFuture, SampleResult, argmax_only, sample_async, tokens_future
from prefixserve.sampling.token_ban import TokenBan
from prefixserve.worker import cpu_malloc
from prefixserve.worker.argmax_graph import ArgmaxGraphs
from prefixserve.worker.cuda_graph import DecodeGraphs, GraphCaptureError, graph_refusal
from prefixserve.worker.kv_calibration import calibrate_kv_scales
from prefixserve.worker.piecewise_graph import PiecewiseGraphs

if TYPE_CHECKING:
    from prefixserve.kv.block_pool import BlockPool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepBatch:
    """A scheduled step planned on the host: all but the input token ids (known only at launch)."""

    positions: list[int]
    meta: AttentionMetadata
    graph_step: Any  # GraphStep when a captured CUDA graph runs it, else None (eager)
    batch_id: int = 0  # tensor parallelism: which of the workers' plans this is (``TensorParallelRunner``)
    group_tables: tuple[np.ndarray, np.ndarray] | None = None  # the freeing layout's sliding pages
    state_copies: list[tuple[int, int]] | None = None  # hybrids: forked samples' state slots to copy


@dataclass(slots=True)
class PrevTokenFeed:
    """Input ids that are still on the device: row ``dst[i]`` of a step takes the token an earlier
    launch sampled in its row ``src[i]`` (``tokens``). ``dst`` is increasing."""

    dst: list[int]
    src: list[int]
    tokens: torch.Tensor  # [R] int64 on the device: the earlier launch's sampled tokens

    def apply(self, ids: torch.Tensor) -> None:
        """Write the fed rows into the device ids ``ids`` (stream-ordered behind the sampling)."""
        k = len(self.dst)
        if self.dst[-1] == k - 1 and self.src == list(range(k)):  # a decode batch in the same order
            ids[:k].copy_(self.tokens[:k])
            return
        idx = _index(self.dst + self.src, ids.device).view(2, k)
        ids.index_copy_(0, idx[0], self.tokens.index_select(0, idx[1]))


@dataclass(slots=True)
class Launch:
    """A step's device work, issued: its sampled tokens and its timing events are on their way."""

    hidden: torch.Tensor | None  # [tokens, hidden] until ``sample`` has taken its rows
    decode: bool  # every sequence computed one token
    start: torch.cuda.Event | None = None  # timing events around the step's device work (CUDA)
    done: torch.cuda.Event | None = None
    future: SampleFuture | None = None
    graph_hidden: torch.Tensor | None = None  # a replayed decode graph's whole output buffer

    @property
    def tokens(self) -> torch.Tensor | None:
        """The sampled tokens on the device (what a later launch's ``PrevTokenFeed`` reads), or None."""
        return self.future.device_tokens if self.future is not None else None


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device`` without a blocking copy (a pageable copy would wait for the GPU)."""
    return list_to_device(values, device, torch.long)


def _leading(rows: list[int]) -> bool:
    """Whether ``rows`` are the first rows in order (a decode step: every row samples)."""
    return rows == list(range(len(rows)))


def context_length(config: EngineConfig, model: torch.nn.Module) -> int:
    """The longest sequence the engine runs (it sizes the KV pool); the same on every rank."""
    return config.max_model_len or model.config.max_position_embeddings


class ModelRunner:
    """Owns the model, the KV cache tensors, the attention backend and the decode graphs."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, context: int) -> None:
        """Size the KV pool (``config.num_kv_blocks``, else ``_kv_blocks_that_fit``), allocate it, set up
        graphs.

        ``context`` is the longest sequence the engine will run; the pool needs no more blocks than
        ``max_num_seqs`` such sequences hold.
        """
        self.model = model
        self.shard = model.shard  # this process's part of a tensor-parallel model (or all of it)
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype  # the model's, or e4m3 (kv_cache_dtype="fp8")
        old_gpu = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9)
        if old_gpu and self.kv_dtype != self.dtype:  # Triton's e4m3 casts
            raise ValueError("kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or later")
        if old_gpu and any(fp8.is_fp8(layer) for _, layer in quantized_layers(model)):
            raise ValueError(  # every product would dequantize its whole weight to fp32
                "FP8 weights (--quantization fp8 or an FP8 checkpoint) need a GPU of compute capability 8.9 "
                "or later"
            )
        if self.device.type == "cpu":  # before sizing the pool: the packed copies take memory too
            cpu_linear.pack_linear_weights(model)
            cpu_malloc.keep_freed_memory()
        self.block_size = bs = config.block_size
        # linear-attention hybrids: a state slot per running sequence (``kv/state_slots.py``)
        hybrid = model.config.is_hybrid
        self.states: StatePool | None = None
        self.state_sequences = 0  # a hybrid: the sequences (samples included) its slots can run at once
        self.state_snapshots = (0, 0)  # a hybrid: its snapshot slots, and tokens between snapshots
        if hybrid:  # the sequences' slots, then the prefix snapshots'
            room = snapshot_room(model.config, self.dtype, self.device)
            seqs, snaps, every = slot_counts(config.max_num_seqs, config.enable_prefix_caching, bs, room)
            self.states = StatePool(model.config, seqs + snaps, self.dtype, self.device)
            self.state_sequences, self.state_snapshots = seqs, (snaps, every)
        self.layout = kv_layout(model.config, config.frees_sliding_kv)
        pages = self._kv_pages(config.num_kv_blocks)
        self.num_blocks = pages or self._kv_blocks_that_fit(model, config, context)
        self.kv = KVCache(
            model.config,
            self.num_blocks,
            bs,
            self.kv_dtype,
            self.device,
            self.shard,
            model.full_config.num_key_value_heads,
            self.layout,
        )
        if self.kv.scales is not None:  # an e4m3 cache: its scales, fixed before any block is written
            calibrate_kv_scales(model, self.kv, self.dtype)
        log.info(
            "KV pool: %d blocks of %d tokens (%d tokens, %s, %.2f GiB)",
            self.num_blocks,
            bs,
            self.num_blocks * bs,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_blocks * bytes_per_block(model.config, bs, self.kv_dtype, self.layout) / (1 << 30),
        )
        self.backend = backend_for_model(config.attention, model.config.attention_sinks)
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None  # eager steps' dense work (prefills, mixed steps)
        if self.device.type == "cuda" and not config.enforce_eager:
            refusal = graph_refusal(model.config)
            if refusal is None:
                context = context_length(config, model)
                self.graphs = DecodeGraphs(self.model, self.kv, config.max_num_seqs, self.states, context)
            else:  # decode steps run the piecewise graphs, attention between them
                log.info("no decode CUDA graphs: %s", refusal)
            if hybrid:  # a chunk's linear layers run per sequence (fla's varlen kernels): not captured
                log.info("no piecewise CUDA graphs: a linear-attention hybrid runs prefills eagerly")
            else:
                self.pieces = PiecewiseGraphs(self.model, self.kv, config.max_num_batched_tokens)
        # the sliding layers' window, which decode graphs attend within (window_graph.py)
        self.window = model.config.sliding_window if model.config.has_sliding_layers else None
        self.argmax_graphs: ArgmaxGraphs | None = None  # the sharded argmax, under tensor parallelism
        if self.graphs is not None and self.shard.parallel:
            self.argmax_graphs = ArgmaxGraphs(self.model.compute_argmax, self.graphs.pool)
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        # The device's own clock (CUDA): busy time of steps and the gaps between them, where the GPU
        # waited on the host; and the host's time spent waiting on the device (any device).
        self.timers: Counter[str] = Counter()
        self.waited = 0.0
        self._last_done: torch.cuda.Event | None = None
        self._last_decode = False
        # the stream the engine's steps run on, kept: ``current_stream`` builds a new object each call
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _kv_pages(self, blocks: int | None) -> int | None:
        """Pool pages with the memory of ``blocks`` blocks of every layer (``num_kv_blocks``: a freeing
        layout's pages are smaller, ``kv/layout.py``)."""
        if blocks is None:
            return None
        return blocks * plain_layout(self.model.config).page_elements(1) // self.layout.page_elements(1)

    def _kv_blocks_that_fit(self, model: torch.nn.Module, config: EngineConfig, context: int) -> int:
        """The default KV pool, the same on every rank: what ``max_num_seqs`` sequences of ``context``
        tokens can hold (``kv_blocks_for_sequences``), capped by ``memory_fraction`` of free GPU
        memory less what a step needs beside it (``step_reserve``), or of RAM on a CPU, where the pool
        is resident only as far as blocks are written (``pool_zeros``). A pool smaller than one step
        is refused."""
        bs, tokens = self.block_size, config.max_num_batched_tokens
        seqs, gpu = config.max_num_seqs, self.device.type == "cuda"
        reserve = step_reserve(model.config, self.dtype, max(tokens, seqs), seqs) if gpu else 0
        if gpu:  # a long prefill's KV gathered for SDPA (attention/dense_prefill.py)
            reserve += dense_prefill.gather_bytes(model.config, self.dtype, context)
        if self.states is not None and not gpu:  # the hybrids' state slots come off the pool's budget
            # (on a GPU they are allocated already: the free memory read below has them counted)
            reserve += bytes_per_slot(model.config, self.dtype) * self.states.num_slots
        blocks = blocks_for_budget(
            model.config,
            bs,
            self.kv_dtype,
            self.device,
            config.memory_fraction,
            max_blocks=self.layout.pages_for(context, bs) * config.max_num_seqs,
            reserve=reserve,
            utilization=config.gpu_memory_utilization,
            layout=self.layout,
        )
        blocks = self.shard.min_int(blocks)
        check_kv_fits(blocks, bs, min(tokens, context), self.device)
        return blocks

    def make_generator(self, seed: int) -> torch.Generator:
        """A random stream on the device for one seeded sequence."""
        return torch.Generator(device=self.device).manual_seed(seed)

    # ---- a step batch --------------------------------------------------------------------------
    def prepare_batch(
        self,
        positions: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        tables: np.ndarray,
        module_rows: np.ndarray | None = None,
        eager: bool = False,
        group_tables: tuple[np.ndarray, np.ndarray] | None = None,
        state_slots: list[int] | None = None,
        state_copies: list[tuple[int, int]] | None = None,
        state_snapshots: list[list[tuple[int, int]]] | None = None,
    ) -> StepBatch:
        """Host work of a step that needs no token values: metadata and the attention plan.

        A decode batch that fits a CUDA graph is planned for it (host arrays only) unless ``eager``;
        anything else gets device metadata and the backend's eager ``prepare``. ``module_rows``
        marks Prompt Cache module blocks (``AttentionMetadata.module_rows``); ``group_tables`` the
        sliding groups' pages under the freeing KV layout ([R, S, K] from block base[s] on, and base).
        ``state_slots``: a hybrid's sequences' state slots, ``state_copies`` the slot copies (forked
        samples, restored snapshots) to make before the step's forward, ``state_snapshots`` each
        sequence's prefix snapshots to take (rows into its chunk, slot).
        """
        bs = self.block_size
        decode = len(positions) == len(query_lens)  # one token each
        linear = None
        if self.states is not None:
            if state_slots is None:
                raise ValueError("a linear-attention hybrid's step needs its sequences' state slots")
            linear = self.states.step(state_slots, query_lens, seq_lens, state_snapshots)
        if self.graphs is not None and decode and not eager:
            bucket = self.graphs.bucket_for(len(positions))
            if bucket is not None:
                meta = build_metadata(bs, query_lens, seq_lens, tables, "cpu", module_rows)  # host-only
                step = self.backend.graph_step(meta, self.graphs.shape, bucket)
                if step is None:
                    log.info("attention backend %r has no CUDA-graph path: eager steps", self.backend.name)
                    self.graphs = None
                elif self.window is not None and not step.windowed:
                    # the sliding layers' window work beside the full layers'; None: an eager step
                    # (imported here: it loads the Triton kernels, which a CPU engine never needs)
                    from prefixserve.attention.window_graph import window_graph_step

                    step = window_graph_step(meta, step, self.graphs.shape, bucket, self.window, group_tables)
                if step is not None:
                    step = self.graphs.fit(step)  # None: after the seal, a key no graph serves
                if step is not None:
                    meta.linear = linear
                    return StepBatch(
                        positions, meta, step, group_tables=group_tables, state_copies=state_copies
                    )
        meta = build_metadata(bs, query_lens, seq_lens, tables, self.device, module_rows)
        if group_tables is not None:
            meta.with_groups(*group_tables, self.layout.group_of)
        meta.linear = linear
        self.backend.prepare(meta)
        return StepBatch(positions, meta, None, group_tables=group_tables, state_copies=state_copies)

    # ---- launching -----------------------------------------------------------------------------
    def forward(
        self,
        ids: list[int],
        batch: StepBatch,
        copies: list[tuple[int, int]],
        feed: PrevTokenFeed | None = None,
    ) -> Launch:
        """Copy-on-write block copies, then the forward pass, issued without waiting for the device.

        ``feed`` names the rows whose ids are tokens an earlier launch sampled (their ``ids`` entries
        are placeholders)."""
        issued = time.perf_counter()
        self.kv.copy_blocks(copies)
        if batch.state_copies:
            self.states.copy(batch.state_copies)
        timing = self.device.type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if timing else None
        if start is not None:
            start.record()
        hidden, graph_hidden = self._forward(ids, batch, feed)
        if start is None:  # the device work ran inline: the host waited for it (see ``sample``)
            self.waited += time.perf_counter() - issued
        decode = len(ids) == len(batch.meta.query_lens_host)
        return Launch(hidden, decode, start, graph_hidden=graph_hidden)

    def _forward(
        self, ids: list[int], batch: StepBatch, feed: PrevTokenFeed | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model: the batch's captured graph, or eagerly. Returns hidden states [tokens, hidden]
        and, from a graph, its whole output buffer (``Launch.graph_hidden``), else None.

        Host-tier KV still landing in the cache (``kv/landing.py``): each layer of an eager or piecewise
        forward waits for its own copies; one captured graph waits for them all first. Nothing landing
        (every step but those right after a host-tier restore): ``before_layer`` is None."""
        before_layer = self.kv.landing_hook()
        if batch.graph_step is not None:
            if before_layer is not None:
                self.kv.settle()
            meta = batch.meta
            try:
                out = self.graphs.run(
                    ids, batch.positions, meta.slot_mapping.numpy(), batch.graph_step, feed, meta.linear
                )
                return out[: len(ids)], out
            except GraphCaptureError:  # this step reruns eagerly (its KV writes are idempotent)
                log.exception("CUDA graphs are off from now on")
                self.graphs = None
                batch.meta = build_metadata(
                    meta.block_size,
                    meta.query_lens_host,
                    meta.seq_lens_host,
                    meta.block_tables_host,
                    self.device,
                    meta.module_rows,
                )
                if batch.group_tables is not None:
                    batch.meta.with_groups(*batch.group_tables, self.layout.group_of)
                batch.meta.linear = meta.linear
                self.backend.prepare(batch.meta)
        if self.pieces is not None and self.pieces.fits(len(ids)):
            return self.pieces.run(ids, batch.positions, batch.meta, self.backend, feed, before_layer), None
        ids_t = _index(ids, self.device)
        if feed is not None:
            feed.apply(ids_t)
        pos_t = _index(batch.positions, self.device)
        return self.model(ids_t, pos_t, self.kv.layers, batch.meta, self.backend, before_layer), None

    def kv_deviation(self, ids: list[int], batch: StepBatch) -> np.ndarray:
        """Per token of an eager batch whose layer-0 KV is already in the cache: squared L2 distance
        (all heads, K plus V) between the layer-1 K/V in the cache and the K/V the token gets in
        the batch's context (``LlamaForCausalLM.layer_kv``). Nothing is written; waits for the device."""
        self.kv.settle()
        ids_t, pos_t = _index(ids, self.device), _index(batch.positions, self.device)
        k, v = self.model.layer_kv(ids_t, pos_t, self.kv.layers, batch.meta, self.backend)  # [T, Hkv, D]
        layer = self.kv.layers[min(1, len(self.kv.layers) - 1)]
        slots, scales = batch.meta.slot_mapping, scales_of(layer)
        cached_k, cached_v = (c.view(-1, *k.shape[1:]).index_select(0, slots).float() for c in layer)
        if scales is not None:  # an e4m3 cache's values, K rotated (``kv_quant.rotate``)
            cached_k, cached_v = dequantize(cached_k, scales[0]), dequantize(cached_v, scales[1])
            k = rotate(k)
        dev_k = (k.float() - cached_k).pow(2).sum((1, 2))  # [T]
        dev_v = (v.float() - cached_v).pow(2).sum((1, 2))
        return self.shard.all_reduce(dev_k + dev_v).cpu().numpy()  # every rank's heads

    def sample(
        self,
        launch: Launch,
        rows: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        mask: LogitsMask | None = None,
        ban: TokenBan | None = None,
        adjust: LogitsAdjust | None = None,
    ) -> None:
        """Sample the hidden rows ``rows`` (none: nothing to sample), issued; then close the launch.

        The step's request rules (``sampling/rules.py``): ``mask`` (a grammar's token bitmask) applies
        to the logits, ``adjust`` (logit bias, allowed tokens, penalties) then ``ban`` (stops under
        ``min_tokens``, bad words, a thinking budget's forced end) to a copy of them that the choice
        is made from; logprobs are the raw logits'. ``adjust`` sees the sampled tokens on the device.

        Closing records the step's end event (CUDA). On a CPU the device work runs inline: the time
        of this call, as that of ``forward``, is counted as time waited on the device, not spent on
        the host. Only the calls themselves: a sampling issued a step after its forward (launch-ahead,
        ``Engine._sample``) must not count the host's work between them, nor the time between steps,
        which would make a step's host part (``step_host_seconds_total``) negative.
        """
        issued = time.perf_counter()
        sharded = bool(rows) and ban is None and adjust is None and self.sharded_argmax(params, mask)
        changed = ban is not None or adjust is not None  # a processed copy, in fp32
        fp32 = bool(rows) and not sharded and (changed or not argmax_only(params))
        self._before_sampling(rows, sharded, fp32)
        if sharded:
            launch.future = tokens_future(self._argmax(launch, rows))
        elif rows:
            logits = self._logits(launch, rows, fp32=fp32)
            launch.future = self._choose(logits, params, generators, mask, ban, adjust, fp32)
        launch.hidden = None
        if launch.start is not None:
            launch.done = torch.cuda.Event(enable_timing=True)
            launch.done.record()
        else:
            self.waited += time.perf_counter() - issued

    def _choose(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        mask: LogitsMask | None,
        ban: TokenBan | None,
        adjust: LogitsAdjust | None,
        fp32: bool,
    ) -> SampleFuture:
        """The tokens of ``sample``'s logits under the step's rules (issued)."""
        choose = None if fp32 else getattr(mask, "choose", None)  # ``rules.ChoosingMask``
        if choose is not None:  # greedy rows alone, nothing processed: the mask makes the choice
            return choose(logits)
        if mask is not None:
            mask.apply(logits)
        if ban is not None or adjust is not None:
            return self._sample_processed(logits, params, generators, ban, adjust)
        return sample_async(logits, params, generators, self.default_generator)

    def _before_sampling(self, rows: list[int], sharded: bool, fp32: bool) -> None:
        """A hook before the sampling's device work: the tensor-parallel runner tells its workers
        which of their calls it makes (the sharded argmax, or the logits in fp32 or not)."""

    def _sample_processed(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        ban: TokenBan | None,
        adjust: LogitsAdjust | None,
    ) -> SampleFuture:
        """Sampling from a copy of the logits with the rules' adjusts and ban applied (the raw ones
        give the logprobs); the adjusts then see the sampled tokens on the device."""
        processed = logits.clone()
        if adjust is not None:
            adjust.apply(processed)
        if ban is not None:
            ban.apply(processed)
        future = sample_async(logits, params, generators, self.default_generator, processed)
        if adjust is not None:
            adjust.sampled(future.device_tokens)
        return future

    def logits(self, launch: Launch, rows: list[int], fp32: bool = True) -> torch.Tensor:
        """Logits [len(rows), vocab] of the launch's hidden rows ``rows``: fp32, or with ``fp32=False``
        the model's dtype (``compute_logits``)."""
        return self._logits(launch, rows, fp32)

    def _logits(self, launch: Launch, rows: list[int], fp32: bool) -> torch.Tensor:
        """``logits`` on this process's shard (the tensor-parallel runner tells its workers first)."""
        return self.model.compute_logits(self._hidden_rows(launch, rows), fp32)

    def hidden(self, launch: Launch, rows: list[int]) -> torch.Tensor:
        """The launch's final hidden states [len(rows), hidden] of rows ``rows`` (what embeddings pool;
        under tensor parallelism rank 0 holds them whole). May be a view of a graph's buffer."""
        return self._hidden_rows(launch, rows)

    def sharded_argmax(self, params: list[SamplingParams], mask: object | None) -> bool:
        """Greedy rows alone, nothing masked, under tensor parallelism: the ranks exchange each row's
        best column and its score rather than gathering the logits (``compute_argmax``)."""
        return self.shard.parallel and mask is None and argmax_only(params) and self.model.argmax_exact

    def argmax(self, launch: Launch, rows: list[int]) -> torch.Tensor:
        """Greedy tokens [len(rows)] of the launch's hidden rows ``rows``; every rank calls it."""
        return self._argmax(launch, rows)

    def _argmax(self, launch: Launch, rows: list[int]) -> torch.Tensor:
        """The sharded argmax of the launch's rows ``rows``: replayed from a graph of its own after a
        graphed decode step whose every row samples in order (``argmax_graph.py``), else eager."""
        if self.argmax_graphs is not None and launch.graph_hidden is not None and _leading(rows):
            return self.argmax_graphs.run(launch.graph_hidden, len(rows))
        return self.model.compute_argmax(self._hidden_rows(launch, rows))

    def _hidden_rows(self, launch: Launch, rows: list[int]) -> torch.Tensor:
        hidden = launch.hidden
        return hidden[: len(rows)] if _leading(rows) else hidden[_index(rows, self.device)]

    def shutdown(self) -> None:
        """Release what outlives the object (nothing on one device; workers under tensor parallelism)."""

    # ---- completing ----------------------------------------------------------------------------
    def wait(self, launch: Launch) -> SampleResult | None:
        """Wait for a launch's sampled tokens (None when it sampled none); book the device's time."""
        result = None
        if launch.future is not None:
            waited = time.perf_counter()
            result = launch.future.result()
            self.waited += time.perf_counter() - waited
        elif launch.done is not None:
            waited = time.perf_counter()
            launch.done.synchronize()
            self.waited += time.perf_counter() - waited
        if launch.start is not None:
            launch.done.synchronize()  # recorded just after the sampler's event: ready (or nearly)
            # the GPU's own clock: the gap between the previous step's last kernel and this step's first.
            # A step launched ahead records its start while the previous one still runs (a negative
            # gap): it is busy from the previous step's end, and the GPU did not idle.
            busy = launch.start.elapsed_time(launch.done) / 1e3
            idle = self._last_done.elapsed_time(launch.start) / 1e3 if self._last_done is not None else 0.0
            if idle < 0:
                busy, idle = max(0.0, busy + idle), 0.0
            self.timers["gpu_idle_seconds_total"] += idle
            self.timers["gpu_busy_seconds_total"] += busy
            if launch.decode and self._last_decode:  # between two decode steps: the host overhead
                self.timers["decode_gpu_idle_seconds_total"] += idle
                self.timers["decode_gpu_busy_seconds_total"] += busy
            self._last_done, self._last_decode = launch.done, launch.decode
        return result

    def device_idle(self) -> bool:
        """Has the device run everything issued to it? (A CPU runs its work inline: always.)"""
        return self._stream is None or self._stream.query()

    def idle(self) -> None:
        """No step this time: the next step's gap is not the GPU waiting on the host."""
        self._last_done = None

    def capture_pieces(self, pool: BlockPool) -> int:
        """Capture the dense pieces of every eager-step size now (``Engine.capture_graphs``); returns
        how many were captured. Each size runs one synthetic prefill over blocks taken from ``pool``
        and given back."""
        pieces = self.pieces
        if pieces is None:
            return 0
        before, bs = pieces.captures, self.block_size
        for tokens in pieces.buckets:
            if tokens > pool.num_free * bs:
                break
            blocks = pool.allocate(-(-tokens // bs))
            try:
                table = np.array([blocks], np.int32)
                groups = np.repeat(table[None], self.layout.sliding_groups, 0)  # [0, 1, W] if plain
                group_tables = (groups, np.zeros(1, np.int64)) if len(groups) else None  # from block 0 on
                pos = list(range(tokens))
                batch = self.prepare_batch(pos, [tokens], [tokens], table, group_tables=group_tables)
                launch = self.forward([0] * tokens, batch, [])
                self.sample(launch, [], [], [])
                self.wait(launch)
            finally:
                pool.release(blocks)
        self.idle()
        return pieces.captures - before


__all__ = ["Launch", "ModelRunner", "PrevTokenFeed", "StepBatch", "context_length"]
