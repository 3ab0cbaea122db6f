"""The engine: one ``step`` = schedule -> build batch -> forward -> sample -> update sequences.

Everything above (the LLM API, the CLI, the server) drives an Engine through ``add_request``,
``abort`` and ``step``; everything below (model, KV pool, scheduler, attention) knows nothing of
requests beyond the Sequence objects handed to it.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.attention.backend import make_backend
from prefixserve.attention.metadata import AttentionMetadata, build_metadata
from prefixserve.config import EngineConfig
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache, blocks_for_budget
from prefixserve.model.cuda_graph import DecodeGraphs, GraphCaptureError
from prefixserve.model.loader import load_model, load_tokenizer, resolve_model
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.sampler import SampleFuture, sample_async
from prefixserve.scheduler.blocks import BlockManager
from prefixserve.scheduler.scheduler import Scheduler
from prefixserve.sequence import Request, Sequence

log = logging.getLogger(__name__)


PLACEHOLDER_TOKEN = -1  # a sequence's in-flight token until the device returns it (never a real id)


@dataclass(slots=True)
class _Batch:
    """A scheduled step planned on the host: all but the input token ids (known only at launch)."""

    positions: list[int]
    meta: AttentionMetadata
    graph_step: Any  # GraphStep when a captured CUDA graph runs it, else None (eager)


@dataclass(slots=True)
class _InFlight:
    """A launched step: its sampled tokens are on their way from the device."""

    samplers: list[Sequence]  # sequences that sample a token (each holds a placeholder)
    future: SampleFuture | None
    touched: set[Request]
    start: torch.cuda.Event | None  # timing events around the step's device work (CUDA)
    done: torch.cuda.Event | None
    decode: bool = False  # every sequence computed one token


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device`` without a blocking copy (a pageable copy would wait for the GPU)."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@dataclass(slots=True)
class PinnedPrompt:
    """An application's system prompt whose KV is computed once and never evicted."""

    name: str
    token_ids: list[int]
    blocks: list[int]  # the full blocks, held by the pin


GC_THRESHOLD0 = 50_000  # allocations between young-generation collections (CPython's default: 700)


def _tune_gc() -> None:
    """Make Python's cyclic GC rare enough that its full passes do not stall decode steps.

    A full pass visits every element of every list alive: at B=256 with 16K-token prompts that is
    ~8M token ids and positions, ~15 ms, and with CPython's default thresholds one ran every few
    steps (measured on the H200 host: 0.55 s of 1.45 s of host time over 38 decode steps). Raising
    the young-generation threshold makes every generation's passes ~70x rarer; cycles (a request and
    its sequences) are still collected. Nothing is frozen: a frozen object in a cycle would leak.
    """
    threshold0, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(max(threshold0, GC_THRESHOLD0), threshold1, threshold2)


class Engine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True) -> None:
        self.config = config = config or EngineConfig()
        self.device, self.dtype = config.torch_device, config.torch_dtype
        source = resolve_model(config.model)
        self.model_name = source.name
        self.model, tok_dir = load_model(source, self.dtype, self.device, config.seed, progress)
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(tok_dir)
        bs = config.block_size
        context = config.max_model_len or self.model_config.max_position_embeddings
        num_blocks = config.num_kv_blocks or blocks_for_budget(
            self.model_config,
            bs,
            self.dtype,
            self.device,
            config.memory_fraction,
            max_blocks=-(-context // bs) * config.max_num_seqs,
        )
        self.max_model_len = min(context, num_blocks * bs)
        self.kv = KVCache(self.model_config, num_blocks, bs, self.dtype, self.device)
        self.pool = BlockPool(num_blocks, bs)
        self.blocks = BlockManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_batched_tokens, config.max_num_seqs)
        self.backend = make_backend(config.attention)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.kv, config.max_num_seqs)
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.graphs is not None
        )
        self.eos_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        self.counters: Counter[str] = Counter()
        # Wall time of steps, and the part spent outside the forward pass + sampling (scheduling,
        # planning, metadata, bookkeeping): the host overhead a GPU would wait on.
        self.timers: Counter[str] = Counter()
        self._kv_peak = 0  # most blocks held at once (a gauge: what a workload needed of the pool)
        self._in_flight: _InFlight | None = None
        self._placeholders: set[Sequence] = set()
        self._last_done: torch.cuda.Event | None = None
        self._last_decode = False
        self._waited = 0.0
        self._next_seq_id = 0
        self._finished_outputs: list[RequestOutput] = []
        self._default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.pinned: dict[str, PinnedPrompt] = {}
        for name, text in config.system_prompts.items():
            self.pin_system_prompt(name, text)
        # A sequence must always fit in the blocks nobody pins, or it could preempt itself forever.
        unpinned = self.pool.num_blocks - sum(len(p.blocks) for p in self.pinned.values())
        self.max_model_len = min(self.max_model_len, unpinned * bs)
        if self.max_model_len < 2:
            raise ValueError("pinned system prompts leave no room in the KV pool; add blocks or pin less")
        _tune_gc()

    # ---- pinned system prompts (RelayAttention) ------------------------------------------------
    def render_system_prompt(self, text: str) -> list[int]:
        """Token ids of a system prompt as the chat template renders it at the start of a chat."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot pin a system prompt given as text")
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "system", "content": text}], tokenize=False
            )
        else:
            rendered = text
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def pin_system_prompt(self, name: str, text: str) -> PinnedPrompt:
        """Compute an application's system prompt KV once and hold its full blocks for good.

        Pinned blocks carry a reference of their own, so they are never evicted; any request whose
        prompt starts with these tokens (named by ``application=`` or not) finds them in the prefix index.
        """
        if not self.config.enable_prefix_caching:
            raise ValueError("pinned system prompts need the prefix cache (enable_prefix_caching=True)")
        if not name or name in self.pinned:
            raise ValueError(f"application name {name!r} is empty or already pinned")
        if self.requests:
            raise RuntimeError("pin system prompts at start-up, before any request is queued")
        tokens = self.render_system_prompt(text)
        if not tokens or len(tokens) >= self.max_model_len:
            raise ValueError(f"system prompt of application {name!r} is empty or longer than the context")
        # Start-up work, not traffic: the metrics are put back as they were afterwards.
        counters, timers = Counter(self.counters), Counter(self.timers)
        request_id = f"__pin__{name}"
        req = self.add_request(request_id, params=SamplingParams(max_tokens=1), prompt_token_ids=tokens)
        while request_id in self.requests:
            self.step()
        # The finished prompt's full blocks are now free but indexed: take them out of reach of eviction.
        digests = self.blocks.digests(req.sequences[0], len(tokens) // self.config.block_size)
        blocks = self.pool.lookup(digests)
        if len(blocks) != len(digests):
            raise RuntimeError(f"pinning {name!r}: {len(digests) - len(blocks)} blocks were evicted at once")
        self.pool.acquire(blocks)
        self._finished_outputs = []
        self.counters, self.timers = counters, timers
        pinned = PinnedPrompt(name, tokens, blocks)
        self.pinned[name] = pinned
        return pinned

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        prompt_positions: list[int] | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
        application: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the problem (nothing is queued then).

        ``application`` names a pinned system prompt: the prompt is put after it unless it already
        starts with it (a chat rendered with that system message).
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        tokens = list(prompt_token_ids)
        if application is not None:
            pinned = self.pinned.get(application)
            if pinned is None:
                raise ValueError(f"unknown application {application!r}; pinned: {sorted(self.pinned)}")
            if tokens[: len(pinned.token_ids)] != pinned.token_ids:
                if prompt_positions is not None:
                    raise ValueError("prompt_positions cannot be combined with an application prefix")
                tokens = pinned.token_ids + tokens
        if not tokens:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens, over the context length of {self.max_model_len} "
                "(leaving room for at least one generated token)"
            )
        room = self.max_model_len - len(tokens)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {len(tokens)} tokens and the "
                f"context length is {self.max_model_len}, so at most {room} tokens can be generated"
            )
        positions = list(prompt_positions) if prompt_positions is not None else list(range(len(tokens)))
        if len(positions) != len(tokens):
            raise ValueError("prompt_positions must have one position per prompt token")
        req = Request(request_id, prompt, tokens, positions, params, cache_salt, stream=stream)
        self.requests[request_id] = req
        self._new_sequence(req, 0, list(tokens), list(positions))
        self.scheduler.add(req.sequences[0])
        self.counters["requests_total"] += 1
        self.counters["prompt_tokens_total"] += len(tokens)
        return req

    def _new_sequence(self, req: Request, index: int, tokens: list[int], positions: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, tokens, positions)
        self._next_seq_id += 1
        if req.params.seed is not None:
            seed = hash((req.params.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        req.sequences.append(seq)
        return seq

    def abort(self, request_id: str, report: bool = True) -> bool:
        """Stop a request now and free its blocks; its final output comes from the next ``step``."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish_request(req, "abort", report)
        self.counters["requests_aborted_total"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs) or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of finished requests (and of streaming ones that moved).

        With ``async_scheduling`` (on under CUDA graphs) a step launches its batch and returns while
        the device works; the next call schedules and plans the following batch on the host *before*
        it waits for those tokens, so planning overlaps the GPU. Sequences carry a placeholder for
        their in-flight token meanwhile (``_in_flight``); it is replaced before any text, stop check
        or input id reads it. Outputs of a step come back from the next call.
        """
        started = time.perf_counter()
        self._waited = 0.0
        sched = self.scheduler.schedule()
        self._kv_peak = max(self._kv_peak, self.pool.num_used)
        self.counters["preemptions_total"] += len(sched.preempted)
        self.counters["prefix_cache_hit_tokens_total"] += sched.cache_hit_tokens
        outputs, self._finished_outputs = self._finished_outputs, []
        batch, failed = self._plan_or_fail(sched)
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None  # taken first: a failure must not repeat
            outputs += self._complete_or_fail(flight)
            if batch is not None and any(s.seq.is_finished for s in sched.scheduled):
                # sequences that stopped on the in-flight token drop out; plan the rest again
                sched.scheduled = [s for s in sched.scheduled if not s.seq.is_finished]
                batch, failed = self._plan_or_fail(sched) if sched.scheduled else (None, False)
        if failed:
            self._fail(sched)
        elif batch is not None:
            try:
                flight = self._launch(sched, batch)
            except Exception:  # a failure fails this batch's requests, not the engine
                log.exception("engine step failed; failing the requests in this batch")
                self._fail(sched)
            else:
                if self.async_scheduling:
                    self._in_flight = flight
                else:
                    outputs += self._complete_or_fail(flight)
        if batch is None:
            self._last_done = None  # an idle engine is not a GPU waiting on the host
        outputs += self._finished_outputs
        self._finished_outputs = []
        total = time.perf_counter() - started
        self.timers["step_seconds_total"] += total
        self.timers["step_host_seconds_total"] += total - self._waited
        return outputs

    def _plan_or_fail(self, sched: Any) -> tuple[_Batch | None, bool]:
        if not sched.scheduled:
            return None, False
        try:
            return self._plan(sched), False
        except Exception:
            log.exception("planning the step failed; failing the requests in this batch")
            return None, True

    def _fail(self, sched: Any) -> None:
        for s in sched.scheduled:
            if s.seq.request.request_id in self.requests:
                self._finish_request(s.seq.request, "error")

    def _plan(self, sched: Any) -> _Batch:
        """Host work of a step that needs no token values: metadata and the attention plan.

        A decode batch that fits a CUDA graph is planned for it (host arrays only); anything else
        gets device metadata and the backend's eager ``prepare``.
        """
        pos: list[int] = []
        query_lens, seq_lens = [], []
        for s in sched.scheduled:
            seq, c, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            pos += seq.positions[c : c + n]
            query_lens.append(n)
            seq_lens.append(c + n)
        # one numpy gather from the block manager's mirror (lists would cost ~20 ns a block entry)
        tables = self.blocks.block_tables_np([s.seq for s in sched.scheduled], seq_lens)
        bs = self.config.block_size
        if self.graphs is not None and len(pos) == len(query_lens):  # decode only: one token each
            bucket = self.graphs.bucket_for(len(pos))
            if bucket is not None:
                meta = build_metadata(bs, query_lens, seq_lens, tables, "cpu")  # host-only: the graph copies
                step = self.backend.graph_step(meta, self.graphs.shape, bucket)
                if step is not None:
                    return _Batch(pos, meta, step)
                log.info("attention backend %r has no CUDA-graph path; running eagerly", self.backend.name)
                self.graphs = None
        meta = build_metadata(bs, query_lens, seq_lens, tables, self.device)
        self.backend.prepare(meta)
        return _Batch(pos, meta, None)

    def _launch(self, sched: Any, batch: _Batch) -> _InFlight:
        """Forward and sampling of a planned batch, issued without waiting for the device."""
        self.kv.copy_blocks(sched.copies)
        ids: list[int] = []
        for s in sched.scheduled:
            seq, c, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            ids += seq.token_ids[c : c + n]
            self.counters["prompt_tokens_computed_total"] += max(0, min(c + n, seq.num_prompt_tokens) - c)
        timing = self.device.type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if timing else None
        if start is not None:
            start.record()
        issued = time.perf_counter()
        hidden = self._forward(ids, batch)
        self._count_step(batch.meta.stats, len(ids))

        rows: list[int] = []
        samplers: list[Sequence] = []
        end = 0
        for s in sched.scheduled:
            seq = s.seq
            end += s.num_tokens
            seq.num_computed_tokens += s.num_tokens
            self.blocks.register_computed(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end: nothing to sample yet
            for target in self._fork_if_needed(seq):
                rows.append(end - 1)
                samplers.append(target)
        touched = {s.seq.request for s in sched.scheduled}
        flight = _InFlight(samplers, None, touched, start, None, len(ids) == len(sched.scheduled))
        if samplers:
            contiguous = rows == list(range(len(rows)))  # decode steps: every row samples, in order
            picked = hidden[: len(rows)] if contiguous else hidden[_index(rows, self.device)]
            flight.future = sample_async(
                self.model.compute_logits(picked),
                [q.request.params for q in samplers],
                [q.generator for q in samplers],
                self._default_generator,
            )
            for seq in samplers:  # until the token arrives (``_complete``)
                seq.append_token(PLACEHOLDER_TOKEN)
                self._placeholders.add(seq)
        if timing:
            flight.done = torch.cuda.Event(enable_timing=True)
            flight.done.record()
        else:  # on a CPU the device work ran right here: count it as device time, not host time
            self._waited += time.perf_counter() - issued
        return flight

    def _forward(self, ids: list[int], batch: _Batch) -> torch.Tensor:
        """Run the model: the batch's captured graph, or eagerly. Returns hidden states [tokens, hidden]."""
        if batch.graph_step is not None:
            try:
                return self.graphs.run(
                    ids, batch.positions, batch.meta.slot_mapping.numpy(), batch.graph_step
                )
            except GraphCaptureError:  # this step reruns eagerly (its KV writes are idempotent)
                log.exception("CUDA graphs are off from now on")
                self.graphs = None
                meta = batch.meta
                batch.meta = build_metadata(
                    meta.block_size,
                    meta.query_lens_host,
                    meta.seq_lens_host,
                    meta.block_tables_host,
                    self.device,
                )
                self.backend.prepare(batch.meta)
        ids_t = _index(ids, self.device)
        pos_t = _index(batch.positions, self.device)
        return self.model(ids_t, pos_t, self.kv.layers, batch.meta, self.backend)

    def _complete_or_fail(self, flight: _InFlight) -> list[RequestOutput]:
        try:
            return self._complete(flight)
        except Exception:  # e.g. a device error surfacing at the sync: fail that step's requests
            log.exception("engine step failed; failing the requests in this batch")
            for req in flight.touched:
                if self.requests.get(req.request_id) is req:
                    self._finish_request(req, "error")
            return []

    def _complete(self, flight: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens; put them in place of the placeholders, check stops, report."""
        outputs: list[RequestOutput] = []
        if flight.future is not None:
            waited = time.perf_counter()
            result = flight.future.result()
            self._waited += time.perf_counter() - waited
            now = time.monotonic()
            for i, seq in enumerate(flight.samplers):
                if seq not in self._placeholders:
                    continue  # aborted or failed while in flight
                self._placeholders.discard(seq)
                seq.token_ids[-1] = result.tokens[i]
                if result.logprobs is not None and seq.request.params.logprobs is not None:
                    seq.output_logprobs.append(result.logprobs[i])
                    seq.output_top_logprobs.append(result.top_logprobs[i] if result.top_logprobs else [])
                if seq.request.first_token_time is None:
                    seq.request.first_token_time = now
                self.counters["generation_tokens_total"] += 1
                self._check_stop(seq)
        elif flight.done is not None:
            waited = time.perf_counter()
            flight.done.synchronize()
            self._waited += time.perf_counter() - waited
        if flight.start is not None:
            flight.done.synchronize()  # recorded just after the sampler's event: ready (or nearly)
            # the GPU's own clock: the gap between the previous step's last kernel and this step's first
            busy = flight.start.elapsed_time(flight.done) / 1e3
            idle = self._last_done.elapsed_time(flight.start) / 1e3 if self._last_done is not None else 0.0
            self.timers["gpu_idle_seconds_total"] += idle
            self.timers["gpu_busy_seconds_total"] += busy
            if flight.decode and self._last_decode:  # between two decode steps: the host overhead
                self.timers["decode_gpu_idle_seconds_total"] += idle
                self.timers["decode_gpu_busy_seconds_total"] += busy
            self._last_done, self._last_decode = flight.done, flight.decode
        for req in flight.touched:
            if req.is_finished:
                if self._retire(req):
                    outputs.append(self._output(req))
            elif req.stream:
                outputs.append(self._output(req))
        return outputs

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """When sequence 0 of an n > 1 request finishes its prompt, split off the other samples."""
        req = seq.request
        if req.params.n == 1 or req.forked:
            return [seq]
        req.forked = True
        out = [seq]
        for index in range(1, req.params.n):
            child = self._new_sequence(req, index, list(seq.token_ids), list(seq.positions))
            self.blocks.fork(seq, child)
            self.scheduler.add_running(child)
            out.append(child)
        return out

    def _count_step(self, stats: dict[str, float], num_tokens: int) -> None:
        layers = self.model_config.num_hidden_layers
        c = self.counters
        c["steps_total"] += 1
        c["batched_tokens_total"] += num_tokens
        c["attention_kv_tokens_read_total"] += int(stats.get("kv_tokens_read", 0)) * layers
        c["attention_kv_tokens_logical_total"] += int(stats.get("kv_tokens_logical", 0)) * layers
        c["cascade_steps_total"] += int(stats.get("cascade", 0))
        c["shared_segments_total"] += int(stats.get("shared_segments", 0))
        self._last_step_segments = int(stats.get("shared_segments", 0))

    # ---- stopping and outputs ------------------------------------------------------------------
    def _check_stop(self, seq: Sequence) -> None:
        p = seq.request.params
        token = seq.token_ids[-1]
        out_len = seq.num_tokens - seq.num_prompt_tokens
        reason: str | None = None
        if out_len > p.min_tokens and not p.ignore_eos and token in self.eos_ids:
            reason, seq.stop_reason = "stop", None
        elif out_len > p.min_tokens and token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif p.stop and out_len > p.min_tokens and self._hit_stop_string(seq):
            reason = "stop"
        elif (p.max_tokens is not None and out_len >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if self.tokenizer is None:  # no tokenizer: the text stays "", which holds no (non-empty) stop
            return False
        # Called after every appended token until a stop string shows up, so only the new text and the
        # longest stop's length - 1 characters before it are searched: O(new tokens) per step.
        detok = seq.detokenize(self.tokenizer)
        hit = detok.find_first(seq.request.params.stop or [])  # the earliest, as in the full text
        if hit is None:
            return False
        at, stop = hit
        keep = at + len(stop) if seq.request.params.include_stop_str_in_output else at
        seq.output_text = detok.full_text[:keep]
        seq.stop_reason = stop
        return True

    def _decode(self, seq: Sequence) -> str:
        """The output's text, as ``decode(output ids, skip_special_tokens=True)`` gives it.

        Incremental: the sequence's detokenizer decodes only what was appended since the last call.
        """
        if self.tokenizer is None:
            return ""
        return seq.detokenize(self.tokenizer).full_text

    def _finish_request(self, req: Request, reason: str, report: bool = True) -> None:
        for seq in req.sequences:
            if seq in self._placeholders:  # its in-flight token will never be read: drop the placeholder
                self._placeholders.discard(seq)
                seq.token_ids.pop()
                seq.positions.pop()
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        req.forked = True  # no more samples will be split off
        self._retire(req)
        if report:
            self._finished_outputs.append(self._output(req))

    def _retire(self, req: Request) -> bool:
        """Take a finished request out of the engine; False if it was already out (reported).

        The identity check matters with async scheduling: an aborted request's id may be reused by
        a new request before the old one's in-flight step completes.
        """
        if self.requests.get(req.request_id) is not req:
            return False
        del self.requests[req.request_id]
        req.finish_time = time.monotonic()
        self.counters["requests_finished_total"] += 1
        return True

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.sequences:
            text = seq.output_text if isinstance(seq.stop_reason, str) else self._decode(seq)
            want_lp = req.params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.output_logprobs) if want_lp else None,
                    top_logprobs=list(seq.output_top_logprobs) if want_lp else None,
                )
            )
        times = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            times["first_token_time"] = req.first_token_time
        if req.finish_time is not None:
            times["finish_time"] = req.finish_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=completions,
            finished=req.request_id not in self.requests,
            num_cached_tokens=req.num_cached_tokens,
            metrics=times,
        )

    # ---- observability -------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            k: 0
            for k in (
                "requests_total",
                "requests_finished_total",
                "requests_aborted_total",
                "prompt_tokens_total",
                "prompt_tokens_computed_total",
                "prefix_cache_hit_tokens_total",
                "generation_tokens_total",
                "attention_kv_tokens_read_total",
                "attention_kv_tokens_logical_total",
                "cascade_steps_total",
                "shared_segments_total",
                "steps_total",
                "preemptions_total",
                "batched_tokens_total",
            )
        }
        out.update(self.counters)
        out.update(step_seconds_total=self.timers["step_seconds_total"])
        out.update(step_host_seconds_total=self.timers["step_host_seconds_total"])
        # CUDA: device time of steps, and the gaps between consecutive steps (the GPU waiting on the host)
        out.update(gpu_busy_seconds_total=self.timers["gpu_busy_seconds_total"])
        out.update(gpu_idle_seconds_total=self.timers["gpu_idle_seconds_total"])
        out.update(decode_gpu_busy_seconds_total=self.timers["decode_gpu_busy_seconds_total"])
        out.update(decode_gpu_idle_seconds_total=self.timers["decode_gpu_idle_seconds_total"])
        out.update(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_used=self.pool.num_used,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached,
            kv_blocks_used_peak=self._kv_peak,
            kv_blocks_pinned=sum(len(p.blocks) for p in self.pinned.values()),
            shared_segments_per_step=getattr(self, "_last_step_segments", 0),
        )
        return out
