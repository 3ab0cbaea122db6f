"""Building an Engine: the model runner (one device, or rank 0 of tensor-parallel workers), the
tokenizer, the KV pool and block manager, the scheduler and its policy, launch-ahead's choice, the
Prompt Cache's modules and host tier, the prefix cache's spill, pinned system prompts and schemas,
the request and output rules (``request_rules``: the features the loop calls through one interface).

``Engine`` (``llm_engine``) inherits it, so the loop's module holds only requests and the order of a
step; ``_set_up`` makes what the block manager's and the scheduler's hooks call before them and gives
the hooks at their construction (``BlockManagerHooks``, ``SchedulerHooks``; nothing assigns a hook
afterwards): the output rules and the prefix cache's host tier to the block manager, the Prompt
Cache's holds, the loop's own ``_refuse`` and the speculator to the scheduler. The speculator needs
the longest sequence, decided only once pinned system prompts hold their blocks: it drafts nothing
until ``Speculator.set_max_model_len``. ``_set_up`` also picks the step the loop runs (``_step_sync``
or ``_step_launch_ahead``).
"""

from __future__ import annotations

from pathlib import Path

from prefixserve.config import EngineConfig
from prefixserve.engine.cache_pins import CachePins
from prefixserve.engine.gc_tuning import tune_gc
from prefixserve.engine.hybrid import hybrid_config
from prefixserve.engine.in_flight import InFlightTokens, LaunchedStep
from prefixserve.engine.input_processor import InputProcessor
from prefixserve.engine.module_holds import WaitingModuleHolds
from prefixserve.engine.request_rules import output_rules, request_rules
from prefixserve.engine.speculative import Speculator
from prefixserve.engine.stats import EngineStats
from prefixserve.engine.system_prompts import SystemPromptKV
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.prefix_spill import PrefixSpill
from prefixserve.kv.snapshot_spill import SnapshotSpill
from prefixserve.kv.state_slots import StateSlots, snapshot_spacing
from prefixserve.model.loader import (
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_model,
    with_chat_template,
)
from prefixserve.outputs import RequestOutput
from prefixserve.promptcache.device_calls import prompt_modules
from prefixserve.scheduler.block_tables import BlockManager, BlockManagerHooks
from prefixserve.scheduler.scheduler import Scheduler, SchedulerHooks
from prefixserve.scheduler.sliding_pages import SlidingPages
from prefixserve.sequence import Request
from prefixserve.worker.model_runner import ModelRunner, context_length


class EngineSetup:
    """Mixed into ``Engine``: its construction."""

    def __init__(self, config: EngineConfig | None = None, progress: bool = True) -> None:
        self.config = config = config or EngineConfig()
        self.device, self.dtype = config.torch_device, config.torch_dtype
        source = resolve_model(config.model)
        self.model_name = config.served_model_name[0] if config.served_model_name else source.name
        if config.tensor_parallel_size > 1:  # this process is rank 0; workers hold the other shards
            from prefixserve.worker.tp_runner import TensorParallelRunner

            self.runner = TensorParallelRunner(config, source, progress)
            tok_dir = self.runner.tokenizer_dir
        else:
            model, tok_dir = load_model(
                source, self.dtype, self.device, config.seed, progress, quantization=config.quantization
            )
            self.runner = ModelRunner(model, config, context_length(config, model))  # sizes the KV pool
        try:
            # a linear-attention hybrid: what it cannot run is refused by name
            self.config = config = hybrid_config(config, self.runner.model.full_config)
            self._set_up(config, source, tok_dir)
        except BaseException:  # tensor parallelism: no worker outlives a failed start
            self.runner.shutdown()
            raise

    def _set_up(self, config: EngineConfig, source: ModelSource, tok_dir: Path | None) -> None:
        """Everything past the model runner: pool, scheduler, Prompt Cache, pinned prompts, schemas."""
        self.model_config = self.runner.model.full_config
        self.tokenizer = with_chat_template(load_tokenizer(tok_dir), config.chat_template)
        bs = config.block_size
        context = context_length(config, self.runner.model)
        num_blocks = self.runner.num_blocks
        self.pool = BlockPool(num_blocks, bs, self.runner.kv.scheme)  # digests name the KV format
        layout = self.runner.kv.layout
        sliding = None
        if layout.frees_sliding:  # the sliding layers' pages, given back behind the windows
            assert layout.window is not None
            sliding = SlidingPages(self.pool, layout.sliding_groups, layout.window)
        # what reads a step's prompt rows before the sampling takes them (prompt logprobs, pooling);
        # the block manager asks them how far a prefix-cache hit may go (their kept per-block results)
        self.output_rules = output_rules(self.device, bs)
        self.modules = prompt_modules(self.runner, config, self.pool, self.tokenizer, source)
        self.spill: PrefixSpill | None = None  # the prefix cache's host tier: the block manager restores
        snapshot_host_bytes = config.module_host_bytes // 2 if self.model_config.is_hybrid else 0
        if config.spill_prefix_cache and config.enable_prefix_caching:
            if not self.runner.kv.spills:
                raise ValueError("spill_prefix_cache needs every layer's KV in one shape; this model's vary")
            self.modules.host.capacity_bytes -= snapshot_host_bytes  # a hybrid's snapshots take half
            self.spill = PrefixSpill(self.pool, self.runner.kv, self.modules.host)
        block_hooks = BlockManagerHooks(
            restore=self.spill.restore if self.spill is not None else None,
            host_blocks=self.spill.available if self.spill is not None else None,
            row_keepers=self.output_rules.rules,
        )
        states = None
        if self.model_config.is_hybrid:  # the runner's slots: the sequences', then the snapshots'
            snaps, every = self.runner.state_snapshots
            spacing = snapshot_spacing(self.model_config, every, config.torch_dtype)
            spill = None  # with the prefix cache's host tier, evicted snapshots go to host memory too
            if self.spill is not None and self.runner.states is not None:
                spill = SnapshotSpill(self.runner.states.layers, snapshot_host_bytes)
            states = StateSlots(self.runner.state_sequences, snaps, every, spacing, spill)
        self.blocks = BlockManager(
            self.pool, config.enable_prefix_caching, sliding, hooks=block_hooks, states=states
        )
        self.max_model_len = min(context, self.blocks.max_tokens(num_blocks))
        self.requests: dict[str, Request] = {}
        # requests whose recovery rows are still to compute: steps look at the batch only if any
        self._to_recover: set[Request] = set()
        holds = WaitingModuleHolds(self.modules, self.requests, self._to_recover, self._fail_request)
        speculative = config.speculative
        # drafts appended before each step is planned; none until max_model_len is set (below)
        speculator = Speculator(speculative) if speculative is not None else None
        scheduler_hooks = SchedulerHooks(
            reclaim=holds.reclaim, ready=holds.ready, refuse=self._refuse, speculate=speculator
        )
        self.scheduler = Scheduler(
            self.blocks,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.kv_admit_threshold,
            config.scheduling_policy,
            hooks=scheduler_hooks,
            tenant_weights=config.tenant_weights,
        )
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.graphs is not None and speculative is None  # drafts read each step's tokens
        )
        # launch-ahead: a step goes to the device before the host has the tokens of the step ahead
        # of it (they are read on the device), so the GPU never waits on that step's bookkeeping
        self.launch_ahead = self.async_scheduling
        self._step_mode = self._step_launch_ahead if self.launch_ahead else self._step_sync  # chosen once
        self.eos_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.stats = EngineStats()
        self._launched: LaunchedStep | None = None  # async: the step whose tokens are still on the device
        self.in_flight_tokens = InFlightTokens()  # placeholders of tokens still on the device
        self._finished_outputs: list[RequestOutput] = []
        # what a request asks of its sampling beyond the sampler's params (grammars, min_tokens, bad
        # words, thinking budgets): admitted at intake, asked at each step (``sampling/rules.py``)
        vocab = self.model_config.vocab_size
        self.rules = request_rules(
            self.eos_ids, vocab, self.runner.device, config.max_num_seqs, config.reasoning_parser
        )
        self.system_prompt_kv: dict[str, SystemPromptKV] = {}
        self.input_processor = InputProcessor(
            self.runner, self.modules, self.system_prompt_kv, self.requests, vocab, bs, self.rules
        )
        self.cache_pins = CachePins(self.blocks, 0)  # its budget once the pinned prompts are known
        for name, text in config.system_prompts.items():
            self.pin_system_prompt(name, text)
        # A sequence must always fit in the blocks nobody pins, or it could preempt itself forever.
        unpinned = self.pool.num_blocks - sum(len(p.blocks) for p in self.system_prompt_kv.values())
        self.max_model_len = min(self.max_model_len, self.blocks.max_tokens(unpinned))
        if self.max_model_len < 2:
            raise ValueError("pinned system prompts leave no room in the KV pool; add blocks or pin less")
        # cache breakpoints' pins (Anthropic's cache_control TTLs) within their share of the pool, never
        # the room one sequence of max_model_len needs
        room = unpinned - -(-self.max_model_len // bs)
        self.cache_pins.budget = max(0, min(int(config.cache_control_fraction * self.pool.num_blocks), room))
        if speculator is not None:  # the scheduler's hook, complete: it drafts from now on
            speculator.set_max_model_len(self.max_model_len)
        for text in config.schemas:
            self.register_schema(text)
        tune_gc()


__all__ = ["EngineSetup"]
