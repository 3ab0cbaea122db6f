"""The engine loop: one ``step`` = schedule -> plan -> launch on the runner -> update sequences -> outputs.

Everything above (the LLM API, the CLI, the server) drives an Engine through ``add_request``,
``abort`` and ``step``; everything below (model runner, KV pool, scheduler, attention) knows nothing
of requests beyond the Sequence objects handed to it. The device side of a step (inputs, forward,
CUDA graphs, sampling) is the ``ModelRunner``'s; this module owns the requests, their sequences and
the order of a step, as nano-vllm's ``LLMEngine`` and vLLM v1's ``EngineCore`` do.
"""

from __future__ import annotations

import gc
import logging
import numbers
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixserve.config import EngineConfig
from prefixserve.engine.cuda_graph import DecodeGraphs
from prefixserve.engine.model_runner import Feed, Launch, ModelRunner, StepBatch, context_length
from prefixserve.engine.output_processor import ends_by_length, request_output, stop_possible, stop_reason
from prefixserve.engine.pinned import PinnedPrompt, render_system_prompt
from prefixserve.engine.prompt_modules import ModulePrompt, PromptModules
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.kv.prefix_spill import PrefixSpill
from prefixserve.model.loader import load_model, load_tokenizer, resolve_model
from prefixserve.model.parallel import WorkerDiedError
from prefixserve.outputs import RequestOutput
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.promptcache.recompute import parse_recompute
from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.sampler import SampleResult
from prefixserve.scheduler.blocks import BlockManager
from prefixserve.scheduler.groups import GroupJob
from prefixserve.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from prefixserve.sequence import Request, SeqStatus, Sequence, TokenArray, counting_positions, token_array

log = logging.getLogger(__name__)


PLACEHOLDER_TOKEN = -1  # a sequence's in-flight token until the device returns it (never a real id)


@dataclass(slots=True)
class _InFlight:
    """A launched step: its sampled tokens are on their way from the device."""

    samplers: list[Sequence]  # sequences that sample a token (each holds a placeholder)
    indices: list[int]  # where each sampler's placeholder sits in its token ids
    touched: set[Request]
    launch: Launch


# A placeholder still waiting for its token: (its index in the token ids, the launch sampling it, the row)
_Pending = tuple[int, Launch, int]


GC_THRESHOLD0 = 50_000  # allocations between young-generation collections (CPython's default: 700)


def _tune_gc() -> None:
    """Make Python's cyclic GC rare enough that its passes do not stall decode steps.

    A pass visits every element of every list alive. The engine keeps token ids and positions in
    arrays (``sequence.TokenArray``), which a pass does not look inside, so a full pass is short; but
    a caller's lists (prompts held as lists, outputs' lists) are still walked: with CPython's default
    thresholds a pass ran every few decode steps (measured on the H200 host when the engine still
    used lists: 0.55 s of 1.45 s of host time over 38 steps). Raising the young-generation threshold
    makes every generation's passes ~70x rarer; cycles (a request and its sequences) are still
    collected. Nothing is frozen: a frozen object in a cycle would leak.
    """
    threshold0, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(max(threshold0, GC_THRESHOLD0), threshold1, threshold2)


def _int_list(values: Any, name: str) -> list[Any]:
    """A caller's ids or positions as a list: arrays, numpy arrays and tensors through ``tolist`` (plain
    ints at C speed, which the checks after it take fast); text, bytes and scalars refused by name."""
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of integers, not {type(values).__name__}")
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _valid_token_ids(tokens: list[int], vocab: int) -> bool:
    """All ids integers in [0, vocab). Plain ints are checked at C speed (type set, min, max): a
    per-token generator cost about a millisecond per 8K-token prompt on the server's engine thread."""
    if not tokens:
        return True
    if set(map(type, tokens)) == {int}:
        return min(tokens) >= 0 and max(tokens) < vocab
    return all((type(t) is int or isinstance(t, numbers.Integral)) and 0 <= t < vocab for t in tokens)


class Engine:
    """Requests in, RequestOutputs out, one batch per ``step``; the model runner does the device work."""

    def __init__(self, config: EngineConfig | None = None, progress: bool = True) -> None:
        self.config = config = config or EngineConfig()
        self.device, self.dtype = config.torch_device, config.torch_dtype
        source = resolve_model(config.model)
        self.model_name = source.name
        if config.tensor_parallel_size > 1:  # this process is rank 0; workers hold the other shards
            from prefixserve.engine.tp_runner import TensorParallelRunner

            self.runner = TensorParallelRunner(config, source, progress)
            tok_dir = self.runner.tokenizer_dir
        else:
            model, tok_dir = load_model(source, self.dtype, self.device, config.seed, progress)
            self.runner = ModelRunner(model, config, context_length(config, model))  # sizes the KV pool
        try:
            self._set_up(config, source, tok_dir)
        except BaseException:  # tensor parallelism: no worker outlives a failed start
            self.runner.shutdown()
            raise

    def _set_up(self, config: EngineConfig, source: Any, tok_dir: Any) -> None:
        """Everything past the model runner: pool, scheduler, Prompt Cache, pinned prompts, schemas."""
        self.model_config = self.runner.model.full_config
        self.tokenizer = load_tokenizer(tok_dir)
        bs = config.block_size
        context = context_length(config, self.runner.model)
        num_blocks = self.runner.num_blocks
        self.max_model_len = min(context, num_blocks * bs)
        self.pool = BlockPool(num_blocks, bs)
        self.blocks = BlockManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks, config.max_num_batched_tokens, config.max_num_seqs, config.kv_admit_threshold
        )
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.graphs is not None
        )
        # launch-ahead: a step goes to the device before the host has the tokens of the step ahead
        # of it (they are read on the device), so the GPU never waits on that step's bookkeeping
        self.launch_ahead = self.async_scheduling and self.runner.feeds_tokens
        self.eos_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        self.counters: Counter[str] = Counter()
        # Wall time of steps, and the part spent outside the forward pass + sampling (scheduling,
        # planning, metadata, bookkeeping): the host overhead a GPU would wait on.
        self.timers: Counter[str] = Counter()
        self._kv_peak = 0  # most blocks held at once (a gauge: what a workload needed of the pool)
        self._last_step_segments = 0
        self._in_flight: _InFlight | None = None
        self._pending: dict[Sequence, list[_Pending]] = {}  # sequences with tokens still on the device
        # requests whose recovery rows are still to compute: steps look at the batch only if any
        self._to_recover: set[Request] = set()
        self._next_seq_id = 0
        self._finished_outputs: list[RequestOutput] = []
        model_id = str(getattr(source, "path", None) or source.name)
        if getattr(source, "kind", None) == "dummy":  # random weights: the seed is part of the KV
            model_id = f"{source.name}|seed={config.seed}"
        self.modules = PromptModules(
            self.pool,
            self.runner.kv,
            self._encode_piece,
            self.tokenizer,
            model_id,
            config.module_gpu_fraction,
            config.module_host_bytes,
            config.module_store,
            self._module_deviation,
            config.module_recompute,
            int((1.0 - config.kv_admit_threshold) * self.pool.num_blocks),
        )
        self.spill: PrefixSpill | None = None
        if config.spill_prefix_cache and config.enable_prefix_caching:
            self.spill = PrefixSpill(self.pool, self.runner.kv, self.modules.host)
            self.blocks.restore = self.spill.restore
        self.pinned: dict[str, PinnedPrompt] = {}
        for name, text in config.system_prompts.items():
            self.pin_system_prompt(name, text)
        # A sequence must always fit in the blocks nobody pins, or it could preempt itself forever.
        unpinned = self.pool.num_blocks - sum(len(p.blocks) for p in self.pinned.values())
        self.max_model_len = min(self.max_model_len, unpinned * bs)
        if self.max_model_len < 2:
            raise ValueError("pinned system prompts leave no room in the KV pool; add blocks or pin less")
        for text in config.schemas:
            self.register_schema(text)
        _tune_gc()

    def shutdown(self) -> None:
        """Release the device side: under tensor parallelism, stop the worker processes."""
        self.runner.shutdown()

    # ---- the device side, as callers and tests inspect it --------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def kv(self) -> KVCache:
        return self.runner.kv

    @property
    def backend(self) -> Any:
        return self.runner.backend

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.runner.graphs

    def capture_graphs(self) -> int:
        """Capture the dense pieces of every eager-step size now; returns how many were captured.

        A server calls this at start-up: captured lazily, each new size of prefill or mixed step
        (and a server meets many) stalls every running stream for a warm-up forward and L + 1
        captures. Each size runs one synthetic prefill over blocks taken from the pool and given back.
        """
        pieces = self.runner.pieces
        if pieces is None:
            return 0
        before, bs = pieces.captures, self.runner.block_size
        for tokens in pieces.buckets:
            if tokens > self.pool.num_free * bs:
                break
            blocks = self.pool.allocate(-(-tokens // bs))
            try:
                table = np.array([blocks], np.int32)
                batch = self.runner.plan(list(range(tokens)), [tokens], [tokens], table)
                launch = self.runner.forward([0] * tokens, batch, [])
                self.runner.sample(launch, [], [], [])
                self.runner.wait(launch)
            finally:
                self.pool.release(blocks)
        self.runner.idle()
        return pieces.captures - before

    # ---- pinned system prompts (RelayAttention) ------------------------------------------------
    def render_system_prompt(self, text: str) -> list[int]:
        """Token ids of a system prompt as the chat template renders it at the start of a chat."""
        return render_system_prompt(self.tokenizer, text)

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
        saved = Counter(self.counters), Counter(self.timers), Counter(self.runner.timers)
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
        self.counters, self.timers, self.runner.timers = saved
        pinned = PinnedPrompt(name, tokens, blocks, list(digests))
        self.pinned[name] = pinned
        return pinned

    # ---- Prompt Cache schemas -------------------------------------------------------------------
    def register_schema(
        self,
        text: str,
        encode: bool = True,
        pin: bool = False,
        replace: bool = False,
        module_recompute: str | None = None,
    ) -> str:
        """Register a PML schema; with ``encode`` its modules are encoded now (else at first use).

        Returns the schema's name. ``pin`` keeps its modules on the GPU for good; ``module_recompute``
        is the schema's accuracy-recovery setting (``promptcache/recompute.py``).
        """
        schema = self.modules.register(text, replace=replace, recompute=module_recompute)
        if encode or pin:
            try:
                self.modules.encode_schema(schema.name, pin=pin)
            except BaseException:
                self.modules.unregister(schema.name)
                raise
        return schema.name

    def unregister_schema(self, name: str) -> None:
        self.modules.unregister(name)

    def list_schemas(self) -> list[dict[str, Any]]:
        return self.modules.list_schemas()

    def _encode_piece(self, token_ids: list[int], positions: list[int], blocks: list[int]) -> None:
        """Compute a module piece's KV alone (attending only within itself) into ``blocks``.

        A forward of one sequence outside the scheduler, in chunks of the step budget; its outputs
        are dropped. It is issued on the device's stream after any step in flight, whose blocks it
        never touches (``blocks`` are freshly allocated).
        """
        table = np.asarray([blocks], dtype=np.int32)
        chunk = self.config.max_num_batched_tokens
        for start in range(0, len(token_ids), chunk):
            end = min(len(token_ids), start + chunk)
            batch = self.runner.plan(positions[start:end], [end - start], [end], table, eager=True)
            self.runner.forward(token_ids[start:end], batch, [])

    def _row_batches(
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

    def _module_deviation(
        self, token_ids: list[int], positions: list[int], blocks: list[int], runs: list[tuple[int, int]]
    ) -> list[np.ndarray]:
        """Per row of each run: how far its cached layer-1 K/V is from the K/V it has in this context
        (squared L2 over heads, K and V summed). Layer 0 runs over the cached rows as they are (they
        equal the in-context ones there); nothing is written."""
        per_row: list[np.ndarray] = []
        for batch, table in self._row_batches(blocks, runs):
            pos = [p for a, b in batch for p in positions[a:b]]
            ids = [t for a, b in batch for t in token_ids[a:b]]
            q_lens, s_lens = [b - a for a, b in batch], [b for _, b in batch]
            step = self.runner.plan(pos, q_lens, s_lens, table, self.modules.module_rows, eager=True)
            per_row.append(self.runner.kv_deviation(ids, step))
        flat = np.concatenate(per_row) if per_row else np.zeros(0)
        out, start = [], 0
        for a, b in runs:
            out.append(flat[start : start + b - a])
            start += b - a
        return out

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: Iterable[int] | None = None,
        prompt_positions: Iterable[int] | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
        application: str | None = None,
        queue: bool = True,
        module_recompute: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the problem (nothing is queued then).

        ``application`` names a pinned system prompt: the prompt is put after it unless it already
        starts with it (a chat rendered with that system message). ``queue=False`` leaves the request
        for ``add_group`` (offline batches), which queues it as a member of a prefix-sharing group.
        ``module_recompute`` ("none", "link:K", "blend:R") overrides a PML prompt's recovery setting.
        """
        params = params or SamplingParams()
        if module_recompute is not None:
            parse_recompute(module_recompute)  # a bad setting is refused whatever the prompt
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None and prompt is not None and self.is_pml_prompt(prompt):
            if application is not None or prompt_positions is not None:
                raise ValueError("a PML prompt takes neither application nor prompt_positions")
            mp = self.modules.prepare(prompt, cache_salt, module_recompute)  # module blocks held from here on
            try:
                req = self._add(
                    request_id, prompt, params, mp.token_ids, mp.positions, cache_salt, stream, queue, mp
                )
            except BaseException:
                self.modules.release(mp.blocks)
                raise
            self.counters["module_tokens_reused_total"] += mp.module_tokens - mp.recomputed_tokens
            return req
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        tokens = _int_list(prompt_token_ids, "prompt_token_ids")
        pinned = None
        if application is not None:
            pinned = self.pinned.get(application)
            if pinned is None:
                raise ValueError(f"unknown application {application!r}; pinned: {sorted(self.pinned)}")
            if tokens[: len(pinned.token_ids)] != pinned.token_ids:
                if prompt_positions is not None:
                    raise ValueError("prompt_positions cannot be combined with an application prefix")
                tokens = pinned.token_ids + tokens
        req = self._add(request_id, prompt, params, tokens, prompt_positions, cache_salt, stream, queue, None)
        if pinned is not None and prompt_positions is None and cache_salt is None:
            # the pinned blocks' digests are this prompt's first ones: not hashed again (512 per 8K prompt)
            req.sequences[0].block_digests = list(pinned.digests)
        return req

    def is_pml_prompt(self, prompt: str) -> bool:
        """A text prompt that is a Prompt Cache ``<prompt schema=...>`` document."""
        return is_pml_prompt(prompt)

    def _add(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        tokens: list[int],
        prompt_positions: list[int] | None,
        cache_salt: str | None,
        stream: bool,
        queue: bool,
        modules: ModulePrompt | None,
    ) -> Request:
        """Check a prompt's tokens against the model and the context, then make and queue the request."""
        if not tokens:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        holes = modules.holes if modules is not None else 0
        if holes:  # a module block's empty rows hold placeholders that are never computed
            tokens = list(tokens)
            check = tokens[len(modules.blocks) * self.config.block_size :]
        else:
            check = tokens
        if not _valid_token_ids(check, vocab):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), as integers")
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
        if prompt_positions is None:
            positions = counting_positions(len(tokens))
        else:
            try:
                positions = token_array(_int_list(prompt_positions, "prompt_positions"))
            except (TypeError, OverflowError):
                raise ValueError("prompt_positions must be integers (int64)") from None
        if len(positions) != len(tokens):
            raise ValueError("prompt_positions must have one position per prompt token")
        ids = token_array(tokens)
        req = Request(request_id, prompt, ids, positions, params, cache_salt, stream=stream)
        if modules is not None:
            req.module_blocks, req.module_digests = modules.blocks, modules.digests
            req.num_hole_tokens, req.num_module_tokens = modules.holes, modules.module_tokens
            req.num_recomputed_tokens = modules.recomputed_tokens
            req.num_private_module_rows = modules.private_rows
            req.recompute_runs = modules.recompute_runs
            if req.recompute_runs:
                self._to_recover.add(req)
            req.num_cached_tokens = modules.module_tokens - modules.recomputed_tokens
        self.requests[request_id] = req
        self._new_sequence(req, 0, token_array(ids), token_array(positions))
        if queue:
            self.scheduler.add(req.sequences[0])
        self.counters["requests_total"] += 1
        self.counters["prompt_tokens_total"] += len(tokens) - holes
        return req

    def add_group(self, requests: list[Request], prefix_len: int) -> None:
        """Queue requests added with ``queue=False`` as one prefix-sharing group (BatchLLM): the first
        computes the shared ``prefix_len`` tokens, the group holds them until its last member ends."""
        seqs = [r.sequences[0] for r in requests]
        if any(s.status is not SeqStatus.WAITING or s.block_table for s in seqs):
            raise ValueError("add_group takes requests added with queue=False and not yet queued")
        self.scheduler.add_group(GroupJob(members=seqs, prefix_len=prefix_len))

    def _new_sequence(self, req: Request, index: int, tokens: TokenArray, positions: TokenArray) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, tokens, positions)
        seq.block_digests = list(req.module_digests)
        self._next_seq_id += 1
        if req.params.seed is not None:
            seed = hash((req.params.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF
            seq.generator = self.runner.make_generator(seed)
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

    def fail_all(self) -> list[RequestOutput]:
        """Finish every request with an error now, without the device (after ``WorkerDiedError``:
        no step can run); returns their final outputs."""
        self._in_flight = None
        for req in list(self.requests.values()):
            self._finish_request(req, "error")
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs) or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of finished requests (and of streaming ones that moved).

        With ``async_scheduling`` (on under CUDA graphs) a step launches its batch and returns while
        the device works; outputs of a step come back from the next call. Sequences carry a
        placeholder for each in-flight token (``_pending``); it is replaced before any text, stop
        check, prefix-cache digest or output reads it. With ``launch_ahead`` the next call even
        launches its batch *before* it waits for those tokens: rows that compute them read them on
        the device (``Feed``), and the host checks them while the device already runs the next step.
        A sequence that stops on such a token has computed one row for nothing, which is dropped.
        """
        started = time.perf_counter()
        waited = self.runner.waited
        sched = self.scheduler.schedule()
        self._kv_peak = max(self._kv_peak, self.pool.num_used)
        self.counters["preemptions_total"] += len(sched.preempted)
        self.counters["prefix_cache_hit_tokens_total"] += sched.cache_hit_tokens
        outputs, self._finished_outputs = self._finished_outputs, []
        prev, self._in_flight = self._in_flight, None  # taken first: a failure must not repeat
        if prev is not None and self.launch_ahead:
            self._drop_surely_finished(sched)
        batch, failed = self._plan_or_fail(sched)
        ahead = prev is not None and self.launch_ahead and batch is not None
        if prev is not None and not ahead:
            outputs += self._complete_or_fail(prev)
            prev = None
            if batch is not None and any(s.seq.is_finished for s in sched.scheduled):
                # sequences that stopped on the in-flight token drop out; plan the rest again
                sched.scheduled = [s for s in sched.scheduled if not s.seq.is_finished]
                batch, failed = self._plan_or_fail(sched) if sched.scheduled else (None, False)
        if failed:
            self._fail(sched)
        elif batch is not None:
            try:
                flight = self._launch(sched, batch, prev)
            except WorkerDiedError:  # the engine itself is gone: no later step can run
                raise
            except Exception:  # a failure fails this batch's requests, not the engine
                log.exception("engine step failed; failing the requests in this batch")
                self._fail(sched)
            else:
                if self.async_scheduling:
                    self._in_flight = flight
                else:
                    outputs += self._complete_or_fail(flight)
        if prev is not None:  # launched ahead of it (or failed to): now wait for its tokens
            outputs += self._complete_or_fail(prev, later=self._in_flight)
        if batch is None:
            self.runner.idle()  # an idle engine is not a GPU waiting on the host
        outputs += self._finished_outputs
        self._finished_outputs = []
        total = time.perf_counter() - started
        self.timers["step_seconds_total"] += total
        self.timers["step_host_seconds_total"] += total - (self.runner.waited - waited)
        return outputs

    def _drop_surely_finished(self, sched: SchedulerOutput) -> None:
        """Launch-ahead: leave out sequences whose in-flight token is their last by length (max_tokens
        or the context); their row would be computed for nothing."""
        pending, limit = self._pending, self.max_model_len
        keep = [s for s in sched.scheduled if s.seq not in pending or not ends_by_length(s.seq, limit)]
        if len(keep) < len(sched.scheduled):
            sched.scheduled = keep

    def _plan_or_fail(self, sched: SchedulerOutput) -> tuple[StepBatch | None, bool]:
        if not sched.scheduled:
            return None, False
        try:
            return self._plan(sched), False
        except WorkerDiedError:
            raise
        except Exception:
            log.exception("planning the step failed; failing the requests in this batch")
            return None, True

    def _fail(self, sched: SchedulerOutput) -> None:
        for s in sched.scheduled:
            if s.seq.request.request_id in self.requests:
                self._finish_request(s.seq.request, "error")

    def _plan(self, sched: SchedulerOutput) -> StepBatch:
        """Gather the step's positions, lengths and block tables; the runner plans the device side."""
        pos: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        seqs: list[Sequence] = []
        for s in sched.scheduled:  # once per sequence per step: a decode row's position is one index
            seq, n = s.seq, s.num_tokens
            c = seq.num_computed_tokens
            if n == 1:
                pos.append(seq.positions[c])
            else:
                pos += seq.positions[c : c + n]
            query_lens.append(n)
            seq_lens.append(c + n)
            seqs.append(seq)
        # one numpy gather from the block manager's mirror (lists would cost ~20 ns a block entry)
        tables = self.blocks.block_tables_np(seqs, seq_lens)
        rows = self.modules.module_rows if self.modules.active else None
        runs = self._recompute_runs(sched)
        if runs:  # module rows to recompute in context lead the batch, each run a sequence of its own
            bs = self.config.block_size
            width = max(tables.shape[1], *(-(-b // bs) for _, a, b in runs))
            lead = np.zeros((len(runs), width), dtype=np.int32)  # [R, W]
            for i, (seq, _, b) in enumerate(runs):
                lead[i, : -(-b // bs)] = seq.block_table[: -(-b // bs)]
            tables = np.concatenate((lead, np.pad(tables, ((0, 0), (0, width - tables.shape[1])))))
            pos = [p for seq, a, b in runs for p in seq.positions[a:b]] + pos
            query_lens = [b - a for _, a, b in runs] + query_lens
            seq_lens = [b for _, _, b in runs] + seq_lens
        return self.runner.plan(pos, query_lens, seq_lens, tables, rows, eager=bool(runs))

    def _recompute_runs(self, sched: SchedulerOutput) -> list[tuple[Sequence, int, int]]:
        """Accuracy recovery rows still to compute, for requests in their first prefill step.

        Each run (rows a..b-1 of the request's module blocks, private copies) goes in the same
        forward as the request's own tokens, as a sequence of its own whose context is the table up
        to its rows: each layer writes every new row's K/V before attending, so a run sees the runs
        before it, and the own tokens see all of them, at that very layer, exactly as one causal
        prefill would (recomputing every row is full prefill). One forward, not two: on a GPU an
        extra eager forward costs as much host time as the whole module-cached first token.
        """
        if not self._to_recover:  # nearly every step: no pass over the batch
            return []
        return [(s.seq, a, b) for s in sched.scheduled for a, b in s.seq.request.recompute_runs]

    def _launch(
        self, sched: SchedulerOutput, batch: StepBatch, ahead_of: _InFlight | None = None
    ) -> _InFlight:
        """Forward and sampling of a planned batch, issued without waiting for the device.

        The forward is issued first, so the device works while the host advances the sequences
        (computed tokens, prefix index, forks) and picks the rows to sample. ``ahead_of``: the
        launched step whose tokens are not on the host yet; rows that compute them read them on
        the device.
        """
        runs = self._recompute_runs(sched)
        ids: list[int] = [t for seq, a, b in runs for t in seq.token_ids[a:b]]
        lead = len(ids)  # the recomputed module rows come first; nothing is sampled from them
        for seq, _, _ in runs:
            seq.request.recompute_runs = []
            self._to_recover.discard(seq.request)
        scheduled = sched.scheduled
        dst, src = self._gather_ids(scheduled, ids, ahead_of)
        feed = Feed(dst, src, ahead_of.launch.tokens) if dst else None
        launch = self.runner.forward(ids, batch, sched.copies, feed)
        self._count_step(batch.meta.stats, len(ids))

        flight, rows, params, generators = self._advance(scheduled, lead, launch)
        self.runner.sample(launch, rows, params, generators)
        return flight

    def _gather_ids(
        self, scheduled: list[ScheduledSeq], ids: list[int], ahead_of: _InFlight | None
    ) -> tuple[list[int], list[int]]:
        """Append the step's token ids to ``ids``; returns the rows fed on the device (dst, src).

        Once per sequence per step: a decode row's id is read with one index, not a slice, and the
        prompt-token counter is bumped once for the batch (a ``Counter`` update per sequence cost more
        than the rest of the loop body).
        """
        pending = self._pending
        dst: list[int] = []
        src: list[int] = []
        prompt_computed = 0
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            c = seq.num_computed_tokens
            if pending and seq in pending:  # tokens of this step still on the device (or a bug)
                for idx, launch, row in pending[seq]:
                    if c <= idx < c + n:
                        if ahead_of is None or launch is not ahead_of.launch:
                            self.counters["prompt_tokens_computed_total"] += prompt_computed
                            raise RuntimeError(f"sequence {seq.seq_id} would compute a token not yet sampled")
                        dst.append(len(ids) + idx - c)
                        src.append(row)
            if n == 1:
                ids.append(seq.token_ids[c])
            else:
                ids += seq.token_ids[c : c + n]
            num_prompt = seq.request.num_prompt_tokens
            if c < num_prompt:
                prompt_computed += min(c + n, num_prompt) - c
        self.counters["prompt_tokens_computed_total"] += prompt_computed
        return dst, src

    def _advance(
        self, scheduled: list[ScheduledSeq], lead: int, launch: Launch
    ) -> tuple[_InFlight, list[int], list[SamplingParams], list[torch.Generator | None]]:
        """Mark the step's tokens computed, index filled blocks, split off n > 1 samples, and give
        each sampling sequence a placeholder for its token until it arrives (``_complete``).

        Returns the launched step and what its sampling takes: the hidden rows, their parameters and
        generators. One pass over the batch (the host's cost per sequence is mostly reaching each
        sequence's objects): placeholders go in before the sampling is issued, which reads no token
        ids; should that fail, ``_fail`` drops them with the sequences' other pending tokens.
        """
        pending = self._pending
        register_computed, bs = self.blocks.register_computed, self.blocks.block_size
        flight = _InFlight([], [], set(), launch)
        samplers, indices, touched = flight.samplers, flight.indices, flight.touched
        rows: list[int] = []
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        end = lead
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            req = seq.request
            touched.add(req)
            end += n
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            # register_computed indexes nothing unless a block filled up since its last call (it
            # never indexes past the computed tokens): most decode steps skip the call
            if computed // bs > seq.num_indexed_blocks:
                held = pending.get(seq)
                register_computed(seq, len(seq.token_ids) - len(held) if held else None)
            if computed < len(seq.token_ids):
                continue  # a prefill chunk that does not reach the end: nothing to sample yet
            p = req.params
            if p.n == 1 or req.forked:
                targets: tuple[Sequence, ...] | list[Sequence] = (seq,)
            else:
                targets = self._fork_if_needed(seq)  # copies seq's tokens before its placeholder
            for target in targets:
                token_ids, positions = target.token_ids, target.positions
                entry = (len(token_ids), launch, len(samplers))
                token_ids.append(PLACEHOLDER_TOKEN)  # target.append_token, inlined
                positions.append(positions[-1] + 1)
                held = pending.get(target)
                if held is None:
                    pending[target] = [entry]
                else:
                    held.append(entry)
                rows.append(end - 1)
                samplers.append(target)
                indices.append(entry[0])
                params.append(p)
                generators.append(target.generator)
        return flight, rows, params, generators

    def _complete_or_fail(self, flight: _InFlight, later: _InFlight | None = None) -> list[RequestOutput]:
        try:
            return self._complete(flight, later)
        except WorkerDiedError:
            raise
        except Exception:  # e.g. a device error surfacing at the sync: fail that step's requests
            log.exception("engine step failed; failing the requests in this batch")
            for req in flight.touched:
                if self.requests.get(req.request_id) is req:
                    self._finish_request(req, "error")
            return []

    def _complete(self, flight: _InFlight, later: _InFlight | None = None) -> list[RequestOutput]:
        """Wait for a launched step's tokens; put them in place of the placeholders, check stops, report.

        ``later``: the step launched after this one (launch-ahead). Its placeholders are hidden
        while this step's tokens are checked and reported, so texts, stop checks and outputs see
        the sequences as they are after this step.
        """
        hidden = self._hide(later)
        try:
            return self._fill(flight)
        finally:
            self._unhide(hidden)

    def _fill(self, flight: _InFlight) -> list[RequestOutput]:
        result = self.runner.wait(flight.launch)
        if result is not None:
            self._place_tokens(flight, result)
        outputs: list[RequestOutput] = []
        interval = self.config.stream_interval
        for req in flight.touched:
            # ``req.is_finished`` runs a generator over the request's samples: asked only when its
            # last sample is finished, which it requires (a request always has a sample)
            seqs = req.sequences
            if seqs[-1].status is SeqStatus.FINISHED and req.is_finished:
                if self._retire(req):
                    outputs.append(self._output(req))
            elif req.stream and (not req.streamed or req.unreported >= interval * len(seqs)):
                req.streamed, req.unreported = True, 0
                outputs.append(self._output(req))
        return outputs

    def _place_tokens(self, flight: _InFlight, result: SampleResult) -> None:
        """Put each sampled token in place of its placeholder and check whether the sequence stops.

        Once per sequence per step, so the loop reads attributes directly, bumps the generated-tokens
        counter once, and calls ``_check_stop`` only where ``stop_reason`` could return a reason (or
        search stop strings): its own conditions without the token and text lookups that decide
        most of them (``output_processor.stop_possible``), so the result is the same as calling it every time.
        """
        now = time.monotonic()
        pending, tokens_out = self._pending, result.tokens
        want_logprobs = result.logprobs is not None
        launch_ahead, eos_ids, max_len = self.launch_ahead, self.eos_ids, self.max_model_len
        generated = 0
        try:
            for i, seq in enumerate(flight.samplers):
                held = pending.get(seq)
                idx = flight.indices[i]
                if not held or held[0][0] != idx or seq.status is SeqStatus.FINISHED:
                    continue  # aborted, failed or stopped while in flight (its placeholders are gone)
                if len(held) == 1:
                    del pending[seq]
                else:
                    held.pop(0)
                token_ids = seq.token_ids
                token_ids[idx] = tokens_out[i]
                req = seq.request
                p = req.params
                if want_logprobs and p.logprobs is not None:
                    seq.output_logprobs.append(result.logprobs[i])
                    seq.output_top_logprobs.append(result.top_logprobs[i] if result.top_logprobs else [])
                req.unreported += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                generated += 1
                if launch_ahead:  # the block this token fills was computed at the next launch
                    self.blocks.register_computed(seq, idx + 1)
                if stop_possible(seq, eos_ids, max_len):
                    self._check_stop(seq)
        finally:
            if generated:
                self.counters["generation_tokens_total"] += generated

    def _hide(self, later: _InFlight | None) -> list[tuple[Sequence, int, int]]:
        """Take the later step's placeholders off the ends of its sequences for now."""
        if later is None:
            return []
        hidden = []
        pending = self._pending
        for seq in later.samplers:
            held = pending.get(seq)
            if held and held[-1][1] is later.launch and len(seq.token_ids) == held[-1][0] + 1:
                hidden.append((seq, seq.token_ids.pop(), seq.positions.pop()))
        return hidden

    def _unhide(self, hidden: list[tuple[Sequence, int, int]]) -> None:
        """Put hidden placeholders back; a sequence that stopped meanwhile drops its later token."""
        pending = self._pending
        for seq, token, position in hidden:
            if not seq.is_finished:
                seq.token_ids.append(token)
                seq.positions.append(position)
                continue
            held = pending.get(seq)
            if held:
                held.pop()
                if not held:
                    del pending[seq]

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """When sequence 0 of an n > 1 request finishes its prompt, split off the other samples."""
        req = seq.request
        if req.params.n == 1 or req.forked:
            return [seq]
        req.forked = True
        out = [seq]
        for index in range(1, req.params.n):
            child = self._new_sequence(req, index, token_array(seq.token_ids), token_array(seq.positions))
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

    # ---- stopping, finishing and outputs -------------------------------------------------------
    def _check_stop(self, seq: Sequence) -> None:
        reason = stop_reason(seq, self.eos_ids, self.max_model_len, self.tokenizer)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _finish_request(self, req: Request, reason: str, report: bool = True) -> None:
        for seq in req.sequences:
            held = self._pending.pop(seq, None)
            if held:  # its in-flight tokens will never be read: drop the placeholders
                del seq.token_ids[-len(held) :]
                del seq.positions[-len(held) :]
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
        self._to_recover.discard(req)
        if req.module_blocks:  # the request's own hold on its module blocks
            self.modules.release(req.module_blocks)
            req.module_blocks = []
        req.finish_time = time.monotonic()
        self.counters["requests_finished_total"] += 1
        return True

    def _output(self, req: Request) -> RequestOutput:
        return request_output(req, self.tokenizer, finished=req.request_id not in self.requests)

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
        out["module_tokens_reused_total"] = 0
        out.update(self.counters)
        out.update(self.modules.metrics())
        out["prefix_cache_host_hit_tokens_total"] = self.blocks.restored_tokens
        out["prefix_cache_spilled_blocks_total"] = self.spill.spilled_blocks if self.spill else 0
        out.update(step_seconds_total=self.timers["step_seconds_total"])
        out.update(step_host_seconds_total=self.timers["step_host_seconds_total"])
        # CUDA: device time of steps, and the gaps between consecutive steps (the GPU waiting on the host)
        device = self.runner.timers
        out.update(gpu_busy_seconds_total=device["gpu_busy_seconds_total"])
        out.update(gpu_idle_seconds_total=device["gpu_idle_seconds_total"])
        out.update(decode_gpu_busy_seconds_total=device["decode_gpu_busy_seconds_total"])
        out.update(decode_gpu_idle_seconds_total=device["decode_gpu_idle_seconds_total"])
        graphs, pieces = self.runner.graphs, self.runner.pieces
        captures = (graphs.captures if graphs else 0) + (pieces.captures if pieces else 0)
        out["cuda_graph_captures_total"] = captures
        out["cuda_graph_capture_seconds_total"] = (graphs.capture_s if graphs else 0.0) + (
            pieces.capture_s if pieces else 0.0
        )
        out.update(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_used=self.pool.num_used,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached,
            prefix_cache_evicted_blocks_total=self.pool.evictions,
            kv_scattered_allocations_total=self.pool.scattered_allocations,
            kv_blocks_used_peak=self._kv_peak,
            kv_blocks_pinned=sum(len(p.blocks) for p in self.pinned.values()),
            shared_segments_per_step=self._last_step_segments,
        )
        return out
